"""Evaluation: tasks through a decoder, the reports made from the results, and lm-eval's adapter.

    evaluate.py      one task through a decoder: records and a summary (accuracy with CI, TPS, TPF)
    run.py           `refusion eval`: tasks checked, result files written, every task run
    report.py        tables and plots from result files
    lm_eval.py       `lm_eval --model refusion`
    lm_eval_hook.py  the .pth hook that registers it (standard library only)
"""
