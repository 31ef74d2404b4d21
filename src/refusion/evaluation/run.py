"""`refusion eval`'s work: tasks checked, result files claimed, the model loaded once, every task
evaluated and its summary written as OUT/<model>__<task>__<decoder>.json (records beside it, .jsonl).

    tasks = eval_tasks("sort,add", split="test")
    summaries = run_eval("runs/words/model", tasks, EvalConfig("ar", {"gen_length": 80}), out="results")

Everything that can be refused (a task name, a split, an existing result) is refused before any
task runs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from refusion.evaluation.evaluate import EvalConfig, evaluate, model_label, result_stem
from refusion.model.checkpoint import load_model
from refusion.model.tokenizer import Tokenizer
from refusion.runtime import count_parameters, resolve_device, set_threads
from refusion.tasks import Task, get_task


def eval_tasks(names: str, split: str) -> list[Task]:
    """The tasks of a comma-separated list of names, each checked to have `split`."""
    listed = [t.strip() for t in names.split(",")]
    if "" in listed or len(set(listed)) != len(listed):
        raise ValueError(f"--task takes distinct comma-separated task names, got {names!r}")
    tasks = [get_task(n) for n in listed]
    for t in tasks:
        if split not in t.splits:
            raise ValueError(f"task {t.name!r} has no split {split!r} (splits: {', '.join(t.splits)})")
    return tasks


def run_eval(model_dir: str | Path, tasks: list[Task], cfg: EvalConfig, out: str | Path = "results", *,
             label: str | None = None, overwrite: bool = False, dtype: str = "float32",
             device: str | torch.device = "cpu", compile: bool = False, threads: int | None = None,
             progress: bool = True, on_summary: Callable[[dict, Path], None] | None = None) -> list[dict]:
    """Evaluate the model in `model_dir` on every task with cfg's decoder; write each task's records
    and summary under `out`, call `on_summary(summary, path)` as each is written, return them all.

    `label` names the model in results (default: model_label); results that exist are replaced only
    with `overwrite`."""
    cfg.validate()
    name = label or model_label(model_dir)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a directory")
    stems = [result_stem(name, t.name, cfg.label) for t in tasks]
    if not overwrite:
        taken = [out / f"{s}.json" for s in stems if (out / f"{s}.json").exists()]
        if taken:
            raise ValueError(f"{taken[0]} exists (an earlier eval); pass --overwrite to replace it, or --label / "
                             "--tag to keep both")
    examples = [t.load(cfg.split, n=cfg.n, seed=cfg.seed) for t in tasks]  # a missing download fails here
    model = load_model(model_dir, dtype=dtype, device=resolve_device(device), compile=compile)
    set_threads(threads, count_parameters(model))
    tok = Tokenizer.from_dir(model_dir)
    summaries = []
    for task, stem, exs in zip(tasks, stems, examples):
        summary = evaluate(model, tok, task, cfg, model_name=name, records_path=out / f"{stem}.jsonl",
                           progress=progress, examples=exs)
        summary["model_path"] = str(model_dir)
        if model.compiled is not None:  # compiling is inside the decode seconds: its share, separately
            summary["compile"] = model.compiled.stats.as_dict()
        path = out / f"{stem}.json"
        path.write_text(json.dumps(summary, indent=2))
        summaries.append(summary)
        if on_summary is not None:
            on_summary(summary, path)
    return summaries
