"""`refusion eval` (tasks through a decoder: accuracy and speed) and `refusion report` (tables, plots)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from refusion.cli.args import MODEL_HELP, add_runtime_flags, positive_int, resolve_model_dir, utf8_text
from refusion.cli.decoder_flags import add_decoder_flags, add_parameter_flags, add_removed_flags, choose_decoder
from refusion.decoding import registry


def add_parsers(sub: argparse._SubParsersAction) -> None:
    from refusion.tasks import all_tasks

    e = sub.add_parser("eval", help="evaluate a model on tasks with a decoder (accuracy and speed)")
    e.add_argument("--model", help=MODEL_HELP)
    e.add_argument("--task", required=True, help="task name(s), comma-separated: " + ", ".join(all_tasks()))
    e.add_argument("--n", type=positive_int, help="number of samples, drawn with --seed (default: the whole split)")
    e.add_argument("--split", default="test", help="train or test (benchmarks have only test)")
    e.add_argument("--batch-size", type=positive_int, default=1,
                   help="prompts decoded at once (ar and speculative: a continuous batch, each record what batch size 1 gives)")
    e.add_argument("--system", type=utf8_text, help="system message for the chat template")
    e.add_argument("--label", type=utf8_text, help="model name in the results (default: the run directory's name); NAME@STEP "
                                   "makes it a point of NAME's curve over training steps in `refusion report`")
    e.add_argument("--tag", type=utf8_text, help="suffix for the decoder name, to tell parameter settings apart")
    e.add_argument("--setting", action="append", metavar="'DECODER [FLAGS]'",
                   help="a decoder with its parameter flags and --tag, e.g. 'refusion --slot-size 8 --tag s8'; "
                        "repeat it to evaluate several settings with the model loaded once, one after the other. "
                        "The decoder flags given outside apply to every setting (a setting's own win); "
                        "replaces --decoder and --tag")
    e.add_argument("--out", default="results", help="directory for <model>__<task>__<decoder>.json/.jsonl")
    e.add_argument("--overwrite", action="store_true", help="replace results that exist (and start afresh a task that "
                   "an earlier run left part-way, which the same command otherwise continues)")
    add_runtime_flags(e)
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_decoder_flags(e)
    e.set_defaults(func=cmd_eval)

    rp = sub.add_parser("report", help="markdown table and accuracy-vs-speed plot from eval results")
    rp.add_argument("paths", nargs="+", help="result directories or summary .json files")
    rp.add_argument("--out", help="write the markdown here too")
    rp.add_argument("--plot", help="write the accuracy-vs-TPS plot here (PNG; a directory: DIR/accuracy_vs_tps.png; "
                                   "needs matplotlib)")
    rp.add_argument("--curves-plot", help="write the accuracy-against-training-steps plot here (PNG; a directory: "
                                          "DIR/accuracy_vs_steps.png; needs matplotlib and results labelled NAME@STEP, "
                                          "e.g. eval --label run@4000)")
    rp.set_defaults(func=cmd_report)


def cmd_eval(args: argparse.Namespace) -> None:
    from refusion.model.checkpoint import load_config
    from refusion.decoding import make_params
    from refusion.evaluation.evaluate import EvalConfig
    from refusion.evaluation.records import EvalInterrupted
    from refusion.evaluation.run import eval_tasks, run_eval
    from refusion.runtime import resolve_device

    # every name, the split, the parameters and the output files are checked before anything runs
    tasks = eval_tasks(args.task, args.split)
    model_dir = resolve_model_dir(args)
    device = resolve_device(args.device)
    config = load_config(model_dir)
    cfgs = []
    for setting in _settings(args):
        decoder, params = choose_decoder(setting, config, model_dir)
        make_params(decoder, config, **params)
        cfgs.append(EvalConfig(decoder=decoder, params=params, n=args.n, split=args.split, batch_size=args.batch_size,
                               seed=args.seed, system=args.system, tag=setting.tag).validate())
    try:
        run_eval(model_dir, tasks, cfgs, args.out, label=args.label, overwrite=args.overwrite, dtype=args.dtype,
                 device=device, compile=args.compile, threads=args.threads, progress=not args.no_progress,
                 on_summary=_print_summary)
    except EvalInterrupted as e:  # what was kept and how to go on; the exit status stays Ctrl-C's
        print(f"refusion: {e}", file=sys.stderr)
        raise


class _SettingParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise ValueError(message)  # named with its --setting by _settings, then the command's one-line error


def _settings(args: argparse.Namespace) -> list[argparse.Namespace]:
    """The decoder settings to evaluate, each a namespace of --decoder, --tag and the parameter flags:
    the command line's own, or one per --setting over it (the flags a setting gives win)."""
    if not args.setting:
        return [args]
    if args.decoder is not None or args.tag is not None:
        raise ValueError("--setting names its decoder (and --tag) itself: give --decoder and --tag inside it")
    p = _SettingParser(prog="--setting", add_help=False)
    p.add_argument("decoder", choices=registry.names())
    p.add_argument("--tag", type=utf8_text)
    add_parameter_flags(p)
    add_removed_flags(p)
    settings = []
    for text in args.setting:
        try:
            own = p.parse_args(shlex.split(text))
        except ValueError as e:  # (shlex's too: an unclosed quote)
            raise ValueError(f"--setting {text!r}: {e}") from None
        merged = argparse.Namespace(**vars(args))
        for k, v in vars(own).items():
            if v is not None:
                setattr(merged, k, v)
        settings.append(merged)
    return settings


def _print_summary(summary: dict, path: Path) -> None:
    lo, hi = summary["ci95"]
    print(f"{summary['model']} {summary['task']} {summary['decoder']}: accuracy {100 * summary['accuracy']:.1f}% "
          f"[{100 * lo:.1f}, {100 * hi:.1f}] over {summary['n']}, {summary['tps']:.1f} tokens/s, "
          f"TPF {summary['tpf']:.2f} -> {path}")
    if "compile" in summary:
        from refusion.model.compiled import CompileStats

        print(f"[compile] {CompileStats(**summary['compile']).summary()}")


def cmd_report(args: argparse.Namespace) -> None:
    from refusion.evaluation.report import report

    print(report(args.paths, out=args.out, plot=args.plot, curves_plot=args.curves_plot))
