"""Evaluation: tasks through a decoder, the reports made from the results, and lm-eval's adapter.

    evaluate.py      `refusion eval`: records and summaries (accuracy with CI, TPS, TPF)
    report.py        tables and plots from result files
    lm_eval.py       `lm_eval --model refusion`
    lm_eval_hook.py  the .pth hook that registers it (standard library only)
"""
