"""Run a task with a decoder: per-sample records (JSONL) and a summary (JSON) with accuracy and speed.

    refusion eval --model runs/refusion/model --task arith --decoder refusion --n 200 --out results/

Speed is measured the way the paper reports it: TPS = generated tokens (up to and including EOS) /
wall seconds of the decode calls, TPF = generated tokens / model forward passes. With a batch size
above 1 the wall time of a batch is shared by its sequences, so TPS is the throughput of the batch.

With a batch size above 1, `ar` and `speculative` run a continuous batch as `refusion serve` does: at
most that many sequences at once, a finished one's row going to the next example, every example with
its own seed (seed + its index), so each record is the one batch size 1 gives (the timings aside) and a
record's latency ("seconds") is its own time in the batch. Other decoders decode fixed batches with
seed + the batch's first index, every record's latency the whole batch's.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from refusion.decoding import decode, make_params, model_settings
from refusion.decoding.params import MAX_SEED, check_prompts, check_seed
from refusion.decoding.registry import get as get_decoder
from refusion.evaluation.records import EvalInterrupted, RecordsFile
from refusion.model.transformer import Transformer
from refusion.tasks import Example, Score, Task
from refusion.model.tokenizer import Tokenizer

WAVE = 8  # a continuous batch's examples per decode() call, in batches: their records are kept when it returns


@dataclass
class EvalConfig:
    decoder: str = "refusion"
    params: dict = field(default_factory=dict)  # the decoder's parameters (gen_length, slot_size, ...)
    n: int | None = None  # samples (after a seeded shuffle); None: the whole split
    split: str = "test"
    batch_size: int = 1
    seed: int = 0
    system: str | None = None  # system message for the chat template
    tag: str | None = None  # appended to the decoder's name in results, to tell parameter settings apart

    @property
    def label(self) -> str:
        return f"{self.decoder}-{self.tag}" if self.tag else self.decoder

    def validate(self) -> "EvalConfig":
        for name in ("n", "batch_size"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        check_seed(self.seed)
        return self


def model_label(path: str | Path) -> str:
    """A model's name in results: its directory's name, or for the generic names a training run
    gives (`model`, `checkpoint-N`) the run directory's, so that runs/a/model and runs/b/model
    do not write over each other's results."""
    path = Path(path).resolve()
    if path.name == "model":
        return path.parent.name
    if path.name.startswith("checkpoint-"):
        return f"{path.parent.name}-{path.name}"
    return path.name


def wilson_interval(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion (sensible at 0% and 100%, unlike the normal one)."""
    if n == 0:
        return 0.0, 0.0
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _score_all(task: Task, examples: list[Example], outputs: list[str]) -> list[Score]:
    if task.score_many is not None:
        return task.score_many(examples, outputs)
    return [task.score(ex, out) for ex, out in zip(examples, outputs, strict=True)]


def evaluate(model: Transformer, tokenizer: Tokenizer, task: Task, cfg: EvalConfig, model_name: str = "model",
             records_path: str | Path | None = None, progress: bool = True,
             examples: list[Example] | None = None, overwrite: bool = False) -> dict:
    """Decode every example (`examples`, or the task's split as cfg says), score the outputs batch by
    batch, return the summary. With `records_path`, each batch's records are kept as it is scored
    and an evaluation stopped part-way goes on from them when run again (evaluation/records.py;
    `overwrite`: start afresh); Ctrl-C raises EvalInterrupted, whose message says what was kept."""
    cfg.validate()
    # what decode() will run (the model's decoding.json under cfg.params): bad parameters fail before
    # the first example, and prompts are checked against the gen_length it will use
    decoder, run = model_settings.resolve(model_settings.of_model(model), model.config, cfg.decoder, cfg.params)
    params = make_params(decoder, model.config, **run)
    if examples is None:
        examples = task.load(cfg.split, n=cfg.n, seed=cfg.seed)
    if not examples:
        raise ValueError(f"task {task.name!r} split {cfg.split!r} has no examples")
    if cfg.seed + len(examples) > MAX_SEED:  # seeds are seed + an example's index
        raise ValueError(f"seed {cfg.seed} is too large for {len(examples)} examples: seed + an example's index must "
                         f"stay below 2**63; use a seed up to {MAX_SEED - len(examples)}")
    eos = model.config.eos_ids or ([tokenizer.eos_id] if tokenizer.eos_id is not None else [])
    prompts = [tokenizer.chat_prompt_ids(ex.prompt, system=cfg.system) for ex in examples]
    for ex, p in zip(examples, prompts):  # a prompt too long for the model fails now, not half-way through
        try:
            check_prompts(model.config, [p], params.gen_length)
        except ValueError as e:
            raise ValueError(f"task {task.name!r} example {ex.id}: {e}") from None
    records: list[dict] = []
    store = None
    if records_path is not None:
        evaluation = {"model": model_name, "task": task.name, "split": cfg.split, "decoder": cfg.label,
                      "params": cfg.params, "n": len(examples), "seed": cfg.seed, "batch_size": cfg.batch_size,
                      "system": cfg.system}
        store = RecordsFile(records_path, evaluation, cfg.batch_size, overwrite=overwrite)
        records = store.kept
        if [r.get("id") for r in records] != [ex.id for ex in examples[:len(records)]]:
            store.close()
            raise ValueError(f"{store.partial} holds records of other examples; pass --overwrite to start afresh")
    # (records kept by a version without "wall_share" carry their batch's wall time in "seconds")
    wall = sum(r.get("wall_share", r["seconds"] / cfg.batch_size) for r in records)
    n_tok = sum(r["tokens"] for r in records)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(examples), initial=len(records), desc=f"{task.name} {cfg.decoder}", unit="sample",
                   dynamic_ncols=True)
    try:
        for batch, dt in _decode_calls(model, tokenizer, task, examples, prompts, cfg, decoder, eos, len(records)):
            if store is not None:
                store.add(batch)
            records += batch
            wall += dt
            n_tok += sum(r["tokens"] for r in batch)
            if bar is not None:
                bar.update(len(batch))
                bar.set_postfix(tps=f"{n_tok / wall:.0f}" if wall > 0 else "")
    except KeyboardInterrupt:
        if store is None:
            raise
        store.close()
        raise EvalInterrupted(f"interrupted: {store.written} of {len(examples)} records kept in {store.partial}; run "
                              "the same command again to continue") from None
    except BaseException:
        if store is not None:
            store.close()
        raise
    finally:
        if bar is not None:
            bar.close()
    if store is not None:
        store.finish(records)
    return _summary(records, model_name, task, cfg, wall)


def _decode_calls(model: Transformer, tokenizer: Tokenizer, task: Task, examples: list[Example],
                  prompts: list[list[int]], cfg: EvalConfig, decoder: str, eos: list[int], first: int):
    """(records, wall seconds) of each decode() call, from example `first` on, scored.

    A decoder that runs each sequence on its own (`ar`, `speculative`) takes the examples as a server
    takes requests, batch_size at a time with a finished one's row going to the next, and each example
    with a seed of its own, so its record is the same at any batch size; others decode fixed batches."""
    continuous = cfg.batch_size > 1 and get_decoder(decoder).batch is not None
    per_call = cfg.batch_size * (WAVE if continuous else 1)
    for start in range(first, len(prompts), per_call):
        chunk, exs = prompts[start:start + per_call], examples[start:start + per_call]
        seed = [cfg.seed + start + j for j in range(len(chunk))] if continuous else cfg.seed + start
        t0 = time.perf_counter()
        with torch.inference_mode():
            res = decode(model, chunk, cfg.decoder, eos_ids=eos, seed=seed,
                         batch_size=cfg.batch_size if continuous else None, **cfg.params)
        dt = time.perf_counter() - t0
        outputs = [tokenizer.decode([t for t in r.tokens if t not in eos]) for r in res]
        yield [{"id": ex.id, "task": task.name, "prompt": ex.prompt, "output": out, "extracted": sc.extracted,
                "answer": ex.answer if isinstance(ex.answer, (str, int, float)) else None,
                "correct": sc.correct, "tokens": len(r.tokens), "forwards": r.forwards,
                "seconds": r.seconds if continuous else dt, "wall_share": dt / len(chunk), "finished": r.finished}
               for ex, out, sc, r in zip(exs, outputs, _score_all(task, exs, outputs), res, strict=True)], dt


def _summary(records: list[dict], model_name: str, task: Task, cfg: EvalConfig, wall: float) -> dict:
    """Accuracy (with its 95% interval), speed and latency over one task's records."""
    n_tok = sum(r["tokens"] for r in records)
    correct = sum(r["correct"] for r in records)
    lo, hi = wilson_interval(correct, len(records))
    forwards = sum(r["forwards"] for r in records)
    latencies = sorted(r["seconds"] for r in records)
    return {
        "model": model_name, "task": task.name, "split": cfg.split, "decoder": cfg.label, "params": cfg.params,
        "n": len(records), "batch_size": cfg.batch_size, "seed": cfg.seed,
        "accuracy": correct / len(records), "ci95": [lo, hi],
        "tokens": n_tok, "forwards": forwards, "seconds": wall,
        "tps": n_tok / wall if wall > 0 else 0.0, "tpf": n_tok / max(forwards, 1),
        "latency_mean": sum(latencies) / len(latencies), "latency_p50": latencies[len(latencies) // 2],
        "latency_p90": latencies[min(int(0.9 * len(latencies)), len(latencies) - 1)],
        "finished": sum(r["finished"] for r in records) / len(records),
    }


def result_stem(model_name: str, task: str, decoder: str) -> str:
    return f"{model_name}__{task}__{decoder}".replace("/", "_")
