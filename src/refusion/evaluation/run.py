"""`refusion eval`'s work: tasks checked, result files claimed, the model loaded once, every task
evaluated with every decoder setting and each summary written as OUT/<model>__<task>__<decoder>.json
(records beside it, .jsonl).

    tasks = eval_tasks("sort,add", split="test")
    summaries = run_eval("runs/words/model", tasks, EvalConfig("ar", {"gen_length": 80}), out="results")
    summaries = run_eval("runs/words/model", tasks, [EvalConfig("ar", {"gen_length": 80}),
                                                     EvalConfig("speculative", {"gen_length": 80})])

Everything that can be refused (a task name, a split, an existing result) is refused before any
task runs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from refusion.evaluation.evaluate import EvalConfig, evaluate, model_label, result_stem
from refusion.files import write_text
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


def run_eval(model_dir: str | Path, tasks: list[Task], cfg: EvalConfig | Sequence[EvalConfig],
             out: str | Path = "results", *, label: str | None = None, overwrite: bool = False,
             dtype: str = "float32", device: str | torch.device = "cpu", compile: bool = False,
             threads: int | None = None, progress: bool = True,
             on_summary: Callable[[dict, Path], None] | None = None) -> list[dict]:
    """Evaluate the model in `model_dir` on every task with cfg's decoder (with each config's, one
    after the other, when cfg is a list of them: the model loaded once); write each task's records
    and summary under `out`, call `on_summary(summary, path)` as each is written, return them all.

    `label` names the model in results (default: model_label); results that exist are replaced only
    with `overwrite`. A task stopped part-way (Ctrl-C: EvalInterrupted; a kill; a full disk) goes on
    from its kept records when run again (evaluation/records.py), unless `overwrite`."""
    cfgs = [cfg] if isinstance(cfg, EvalConfig) else list(cfg)
    if not cfgs:
        raise ValueError("run_eval needs at least one EvalConfig")
    for c in cfgs:
        c.validate()
    name = label or model_label(model_dir)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a directory")
    labels = [c.label for c in cfgs]
    twice = sorted({x for x in labels if labels.count(x) > 1})
    if twice:
        raise ValueError(f"two decoder settings would write the same results ({twice[0]}); tell them apart with --tag")
    stems = [[result_stem(name, t.name, c.label) for t in tasks] for c in cfgs]
    if not overwrite:
        taken = [out / f"{s}.json" for row in stems for s in row if (out / f"{s}.json").exists()]
        if taken:
            raise ValueError(f"{taken[0]} exists (an earlier eval); pass --overwrite to replace it, or --label / "
                             "--tag to keep both")
    examples: dict[tuple, list] = {}  # one sample per task and (split, n, seed), shared by the settings
    for c in cfgs:
        for t in tasks:  # a missing download fails here
            key = (t.name, c.split, c.n, c.seed)
            if key not in examples:
                examples[key] = t.load(c.split, n=c.n, seed=c.seed)
    model = load_model(model_dir, dtype=dtype, device=resolve_device(device), compile=compile)
    set_threads(threads, count_parameters(model))
    tok = Tokenizer.from_dir(model_dir)
    summaries = []
    for c, row in zip(cfgs, stems):
        for task, stem in zip(tasks, row):
            summary = evaluate(model, tok, task, c, model_name=name, records_path=out / f"{stem}.jsonl",
                               progress=progress, examples=examples[task.name, c.split, c.n, c.seed],
                               overwrite=overwrite)
            summary["model_path"] = str(model_dir)
            if model.compiled is not None:  # compiling is inside the decode seconds: its share, separately
                summary["compile"] = model.compiled.stats.as_dict()
            path = out / f"{stem}.json"
            write_text(path, json.dumps(summary, indent=2))
            summaries.append(summary)
            if on_summary is not None:
                on_summary(summary, path)
    return summaries
