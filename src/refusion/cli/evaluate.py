"""`refusion eval` (tasks through a decoder: accuracy and speed) and `refusion report` (tables, plots)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from refusion.cli.args import add_runtime_flags, positive_int, resolve_model_dir
from refusion.cli.decoder_flags import add_decoder_flags, choose_decoder, decoder_params


def add_parsers(sub: argparse._SubParsersAction) -> None:
    from refusion.tasks import all_tasks

    e = sub.add_parser("eval", help="evaluate a model on tasks with a decoder (accuracy and speed)")
    e.add_argument("--model", help="model directory (default: the bundled refusion-tiny)")
    e.add_argument("--task", required=True, help="task name(s), comma-separated: " + ", ".join(all_tasks()))
    e.add_argument("--n", type=positive_int, help="number of samples, drawn with --seed (default: the whole split)")
    e.add_argument("--split", default="test", help="train or test (benchmarks have only test)")
    e.add_argument("--batch-size", type=positive_int, default=1, help="prompts decoded together")
    e.add_argument("--system", help="system message for the chat template")
    e.add_argument("--label", help="model name in the results (default: the run directory's name)")
    e.add_argument("--tag", help="suffix for the decoder name, to tell parameter settings apart")
    e.add_argument("--out", default="results", help="directory for <model>__<task>__<decoder>.json/.jsonl")
    e.add_argument("--overwrite", action="store_true", help="replace results that exist")
    add_runtime_flags(e)
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_decoder_flags(e)
    e.set_defaults(func=cmd_eval)

    rp = sub.add_parser("report", help="markdown table and accuracy-vs-speed plot from eval results")
    rp.add_argument("paths", nargs="+", help="result directories or summary .json files")
    rp.add_argument("--out", help="write the markdown here too")
    rp.add_argument("--plot", help="write the accuracy-vs-TPS plot here (PNG; needs matplotlib)")
    rp.set_defaults(func=cmd_report)


def cmd_eval(args: argparse.Namespace) -> None:
    from refusion.model.checkpoint import load_config, load_model
    from refusion.decoding import make_params
    from refusion.evaluation.evaluate import EvalConfig, evaluate, model_label, result_stem
    from refusion.runtime import count_parameters, resolve_device, set_threads
    from refusion.tasks import get_task
    from refusion.model.tokenizer import Tokenizer

    # every name, the split, the parameters and the output files are checked before anything runs
    names = [t.strip() for t in args.task.split(",")]
    if "" in names or len(set(names)) != len(names):
        raise ValueError(f"--task takes distinct comma-separated task names, got {args.task!r}")
    tasks = [get_task(n) for n in names]
    for t in tasks:
        if args.split not in t.splits:
            raise ValueError(f"task {t.name!r} has no split {args.split!r} (splits: {', '.join(t.splits)})")
    model_dir = resolve_model_dir(args)
    device = resolve_device(args.device)
    config = load_config(model_dir)
    decoder = choose_decoder(args, config)
    params = decoder_params(args, decoder)
    make_params(decoder, **params)
    cfg = EvalConfig(decoder=decoder, params=params, n=args.n, split=args.split, batch_size=args.batch_size,
                     seed=args.seed, system=args.system, tag=args.tag).validate()
    name = args.label or model_label(model_dir)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a directory")
    stems = [result_stem(name, t.name, cfg.label) for t in tasks]
    if not args.overwrite:
        taken = [out / f"{s}.json" for s in stems if (out / f"{s}.json").exists()]
        if taken:
            raise ValueError(f"{taken[0]} exists (an earlier eval); pass --overwrite to replace it, or --label / "
                             "--tag to keep both")
    examples = [t.load(cfg.split, n=cfg.n, seed=cfg.seed) for t in tasks]  # a missing download fails here
    model = load_model(model_dir, dtype=args.dtype, device=device, compile=args.compile)
    set_threads(args.threads, count_parameters(model))
    tok = Tokenizer.from_dir(model_dir)
    for task, stem, exs in zip(tasks, stems, examples):
        summary = evaluate(model, tok, task, cfg, model_name=name, records_path=out / f"{stem}.jsonl",
                           progress=not args.no_progress, examples=exs)
        summary["model_path"] = str(model_dir)
        if model.compiled is not None:  # compiling is inside the decode seconds: its share, separately
            summary["compile"] = model.compiled.stats.as_dict()
        (out / f"{stem}.json").write_text(json.dumps(summary, indent=2))
        lo, hi = summary["ci95"]
        print(f"{name} {task.name} {summary['decoder']}: accuracy {100 * summary['accuracy']:.1f}% "
              f"[{100 * lo:.1f}, {100 * hi:.1f}] over {summary['n']}, {summary['tps']:.1f} tokens/s, "
              f"TPF {summary['tpf']:.2f} -> {out / stem}.json")
        if model.compiled is not None:
            print(f"[compile] {model.compiled.stats.summary()}")


def cmd_report(args: argparse.Namespace) -> None:
    from refusion.evaluation.report import report

    print(report(args.paths, out=args.out, plot=args.plot))
