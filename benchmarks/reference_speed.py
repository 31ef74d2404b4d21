"""This project's plan-and-infill against the reference algorithm as the official code runs it, same weights.

    python benchmarks/reference_speed.py                                   # the bundled model
    python benchmarks/reference_speed.py --model PATH --tasks sort,add,repeat

The reference is the literal batch-1 port of the spec's step list (tests/helpers/reference_refusion.py: one
sequence, a cache cropped / expanded / selected / merged row by row, a full softmax and a host
sync per token decision) driving transformers' own Qwen3ForCausalLM with transformers' own
DynamicCache, as the official implementation does. Ours is decode(..., "refusion") with the same
settings, batch 1. Every prompt is decoded `--repeats` times by each; a run's ratio is the
reference's median seconds over ours; the table gives the median ratio over prompts, both sides'
ms per forward, and whether the outputs and forward counts agree (they can differ only where
transformers' arithmetic flips a near-tie). `port on ours` is the same port driving this project's
model (eager): it separates what the decoder saves from what the model saves.

--compile: ours runs through compiled graphs (refusion.model.compiled; not bit-identical to eager). Every
prompt is decoded once before timing, so each shape bucket is compiled before the clock starts; the
compile time and graph count are reported separately, and so are any compilations during the timed
runs (there should be none).

Writes JSON (benchmarks/results/reference_speed_<model>.json) and prints markdown. Time only on a
quiet machine; one thread by default.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import transformers

from refusion.model.checkpoint import load_model
from refusion.model.compiled import enable_compile
from refusion.bundled import BUNDLED
from refusion.decoding import decode
from refusion.tasks import get_task
from refusion.model.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the tests package
from tests.helpers.reference_refusion import reference_refusion  # noqa: E402


class HFCache:
    """transformers' DynamicCache behind the row operations the reference port uses."""

    def __init__(self, config) -> None:
        self.dc = transformers.DynamicCache(config=config)

    @property
    def length(self) -> int:
        return self.dc.get_seq_length()

    @property
    def rows(self) -> int:
        return self.dc.layers[0].keys.shape[0]

    def crop(self, length: int) -> None:
        self.dc.crop(length - self.length)  # transformers takes the number of entries to drop, negated

    def expand(self, rows: int) -> None:
        self.dc.batch_repeat_interleave(rows)

    def select(self, rows: list[int]) -> None:
        self.dc.batch_select_indices(torch.tensor(rows))

    def merge_rows(self, prefix: int, lengths: list[int]) -> None:
        for layer in self.dc.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name)
                parts = [t[:1, :, :prefix]] + [t[r: r + 1, :, prefix: prefix + n] for r, n in enumerate(lengths)]
                setattr(layer, name, torch.cat(parts, dim=2))


class HFModel:
    """transformers' Qwen3ForCausalLM as the reference port calls a model: model(ids, pos, cache=...)."""

    def __init__(self, path: Path) -> None:
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.config = SimpleNamespace(mask_token_id=self.hf.config.mask_token_id)

    def new_cache(self) -> HFCache:
        return HFCache(self.hf.config)

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, cache: HFCache) -> torch.Tensor:
        return self.hf(input_ids=ids, position_ids=pos, past_key_values=cache.dc, use_cache=True).logits


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(BUNDLED))
    ap.add_argument("--tasks", default="sort,add,repeat,code")  # the bundled model's families
    ap.add_argument("--n", type=int, default=3, help="prompts per task")
    ap.add_argument("--repeats", type=int, default=3, help="runs per prompt and side (median)")
    ap.add_argument("--gen-length", type=int, default=96)
    ap.add_argument("--slot-size", type=int, default=8)
    ap.add_argument("--serial-blocks", type=int, default=1)
    ap.add_argument("--slot-threshold", type=float, default=0.9)
    ap.add_argument("--token-threshold", type=float, default=0.4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compile", action="store_true", help="ours through torch.compile'd graphs")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model)
    ours, tok, hf = load_model(model_dir), Tokenizer.from_dir(model_dir), HFModel(model_dir)
    eos = set(ours.config.eos_ids)
    prompts = [tok.chat_prompt_ids(ex.prompt) for name in args.tasks.split(",")
               for ex in get_task(name).load("test", n=args.n, seed=1)]
    p = dict(gen_length=args.gen_length, slot_size=args.slot_size, serial_blocks=args.serial_blocks,
             slot_threshold=args.slot_threshold, token_threshold=args.token_threshold)
    ref_args = (args.gen_length, args.slot_size, args.serial_blocks, args.slot_threshold, args.token_threshold, eos)

    def ref_hf(q):
        return reference_refusion(hf, q, *ref_args, cache=hf.new_cache())

    def ref_ours(q):
        compiled, ours.compiled = getattr(ours, "compiled", None), None  # the port on the eager model (none before the compiled path existed)
        try:
            return reference_refusion(ours, q, *ref_args)
        finally:
            ours.compiled = compiled

    def lib(q):
        return decode(ours, [q], "refusion", eos_ids=sorted(eos), **p)[0]

    stats = enable_compile(ours).stats if args.compile else None
    for fn in (ref_hf, ref_ours, lib):  # warm-up: first calls allocate and pick kernels
        fn(prompts[0])
    if stats is not None:  # every shape bucket the timed runs will meet
        for q in prompts:
            lib(q)
        warm = dict(graphs=stats.graphs, compile_seconds=stats.compile_seconds)
        print(f"compiled {stats.graphs} graphs in {stats.compile_seconds:.1f} s before timing", flush=True)
    load_before = os.getloadavg()
    rows = []
    for i, q in enumerate(prompts):
        t_hf, r_hf = timed(lambda: ref_hf(q), args.repeats)
        t_port, _ = timed(lambda: ref_ours(q), args.repeats)
        t_lib, r_lib = timed(lambda: lib(q), args.repeats)
        rows.append(dict(prompt=i, tokens=len(r_lib.tokens), forwards_ref=r_hf["forwards"], forwards=r_lib.forwards,
                         same_tokens=r_hf["tokens"] == r_lib.tokens, seconds_ref_hf=t_hf, seconds_port_ours=t_port,
                         seconds_ours=t_lib, ratio=t_hf / t_lib, ratio_port=t_port / t_lib))
        r = rows[-1]
        print(f"prompt {i:>2}: {r['tokens']:>3} tokens, {r['forwards']:>3} forwards, reference on transformers "
              f"{1000 * t_hf:7.1f} ms, port on ours {1000 * t_port:7.1f} ms, ours {1000 * t_lib:7.1f} ms, "
              f"ratio {r['ratio']:.2f}x{'' if r['same_tokens'] else ' (outputs differ)'}", flush=True)
    load_after = os.getloadavg()

    def med(key):
        return statistics.median(r[key] for r in rows)

    def ms_per_forward(key, fwd):
        return 1000 * sum(r[key] for r in rows) / sum(r[fwd] for r in rows)

    summary = dict(model=str(model_dir), prompts=len(rows), median_ratio=med("ratio"), median_ratio_port=med("ratio_port"),
                   min_ratio=min(r["ratio"] for r in rows), ms_per_forward_ref_hf=ms_per_forward("seconds_ref_hf", "forwards_ref"),
                   ms_per_forward_port_ours=ms_per_forward("seconds_port_ours", "forwards"),
                   ms_per_forward_ours=ms_per_forward("seconds_ours", "forwards"),
                   same_outputs=sum(r["same_tokens"] for r in rows), same_forwards=sum(r["forwards"] == r["forwards_ref"] for r in rows),
                   load_average_before=load_before, load_average_after=load_after, compile=args.compile)
    if stats is not None:
        summary.update(compile_before_timing=warm, graphs_during_timing=stats.graphs - warm["graphs"],
                       recompiles=stats.recompiles, eager_fallbacks=stats.eager_calls, compiled_calls=stats.compiled_calls)
    print("\n| model | prompts | reference on transformers ms / fwd | port on ours ms / fwd | ours ms / fwd | "
          "median ratio (min) | port on ours / ours | same outputs | same forwards |\n|---|---|---|---|---|---|---|---|---|")
    s = summary
    print(f"| {model_dir.name} | {s['prompts']} | {s['ms_per_forward_ref_hf']:.2f} | {s['ms_per_forward_port_ours']:.2f} | "
          f"{s['ms_per_forward_ours']:.2f} | {s['median_ratio']:.2f}x ({s['min_ratio']:.2f}x) | {s['median_ratio_port']:.2f}x | "
          f"{s['same_outputs']}/{s['prompts']} | {s['same_forwards']}/{s['prompts']} |")
    print(f"\nload average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    if stats is not None:
        print(f"compile: {warm['graphs']} graphs, {warm['compile_seconds']:.1f} s before timing; "
              f"{summary['graphs_during_timing']} compiled and {stats.recompiles} recompiled during timing; "
              f"{stats.compiled_calls} forwards compiled, {stats.eager_calls} eager")
    out = Path(args.out or f"benchmarks/results/reference_speed_{model_dir.name}{'_compiled' if args.compile else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(args=vars(args), torch=torch.__version__, transformers=transformers.__version__,
                                   summary=summary, rows=rows), indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
