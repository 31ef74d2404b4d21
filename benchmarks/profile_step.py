"""Where a decode step's time goes, for every decoder: model forward vs decoder bookkeeping, and by operator.

    python benchmarks/profile_step.py                                  # the bundled model
    python benchmarks/profile_step.py --model PATH --tasks arith,code --batch-sizes 1

For each decoder and batch size the same held-out prompts are decoded twice (after a warm-up):
once plainly, timed, with hooks that record every forward's width, tokens computed and time; once
under torch.profiler for the operator table; the plain run gives the step table:

  fed / forward       batch x width of the feeds (padding included)
  computed / forward  tokens the forwards computed (a ragged batch computes only its real tokens)
  ms / step     decode seconds / forwards: a step is one forward plus everything the decoder does
                around it (feeds, masks, the host transfer, its state machines)
  in forward    the share of that spent inside model.forward
  plain ms      what the same forwards cost as bare causal forwards of the model (KVCache, no mask,
                batch 1, a 64-token cache), measured per width: the floor a decoder step can reach
                without changing the model's arithmetic
  step / plain  ms / step over plain ms: the decoder's overhead factor
  / 1-token     ms / step over a single-token plain forward: what a step costs in AR forwards
  TPS / batch 1 the batch's aggregate tokens / s over the same decoder's at batch 1

--compile runs the model through torch.compile'd graphs (refusion.model.compiled); each batch size is
decoded once more before it is timed, so that compiling stays out of the clock (graphs compiled
during a timed run would be printed).

Operator tables list self CPU time per aten operator over all forwards and the decoder's own tensor
work, with calls per step. Writes JSON (benchmarks/results/profile_<model>.json) and prints markdown.
Time only on a quiet machine (see benchmarks/decode.py); threads default to 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from refusion.model.checkpoint import load_model
from refusion.model.compiled import enable_compile
from refusion.bundled import BUNDLED
from refusion.decoding import decode
from refusion.tasks import get_task
from refusion.model.tokenizer import Tokenizer


def settings(L: int) -> list[tuple[str, str, dict]]:
    rf = dict(gen_length=L, slot_size=8, serial_blocks=1, slot_threshold=0.9, token_threshold=0.4)
    return [
        ("ar", "ar", dict(max_new_tokens=L)),
        ("speculative", "speculative", dict(gen_length=L)),
        ("refusion", "refusion", rf),
        ("refusion-l2r", "refusion-l2r", rf),
        ("mdm-threshold", "mdm-threshold", dict(gen_length=L, block_length=32, threshold=0.9, prefix_cache=True)),
    ]


class ForwardClock:
    """Hooks recording (batch, width, tokens computed, seconds) of every model forward. Tokens
    computed are counted at the embedding: a ragged batch computes only its real tokens."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.events: list[tuple[int, int, int, float]] = []
        self._t, self._computed = 0.0, 0
        self._hooks = [model.register_forward_pre_hook(self._pre), model.register_forward_hook(self._post),
                       model.embed_tokens.register_forward_pre_hook(self._embed)]

    def _pre(self, module, args):
        self._t = time.perf_counter()

    def _embed(self, module, args):
        self._computed = args[0].numel()

    def _post(self, module, args, out):
        B, T = args[0].shape
        self.events.append((B, T, self._computed, time.perf_counter() - self._t))

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


@torch.inference_mode()
def plain_forward_ms(model, width: int, reps: int = 15, cached: int = 64) -> float:
    """Median ms of a bare causal forward of `width` tokens on top of a `cached`-token KVCache."""
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(width)
    prefix = torch.randint(0, V, (1, cached), generator=g)
    ids = torch.randint(0, V, (1, width), generator=g)
    pos = torch.arange(cached, cached + width)[None]
    cache = model.new_cache()
    model(prefix, torch.arange(cached)[None], cache=cache)
    times = []
    for _ in range(reps + 2):
        t = time.perf_counter()
        model(ids, pos, cache=cache)
        times.append(time.perf_counter() - t)
        cache.crop(cached)
    return 1000 * statistics.median(times[2:])


def run(model, prompts, decoder, params, bs) -> tuple[float, int]:
    """Decode every prompt in batches of bs; (seconds, tokens generated)."""
    secs, tokens = 0.0, 0
    for i in range(0, len(prompts), bs):
        t = time.perf_counter()
        res = decode(model, prompts[i: i + bs], decoder, **params)
        secs += time.perf_counter() - t
        tokens += sum(len(r.tokens) for r in res)
    return secs, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(BUNDLED))
    ap.add_argument("--tasks", default="sort,add,repeat,code")  # the bundled model's families
    ap.add_argument("--n", type=int, default=2, help="prompts per task")
    ap.add_argument("--gen-length", type=int, default=96)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", help="comma-separated decoder names (default: all)")
    ap.add_argument("--top", type=int, default=12, help="operators listed per decoder")
    ap.add_argument("--compile", action="store_true", help="the model through torch.compile'd graphs (refusion.model.compiled)")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model)
    model, tok = load_model(model_dir), Tokenizer.from_dir(model_dir)
    prompts = [tok.chat_prompt_ids(ex.prompt) for name in args.tasks.split(",")
               for ex in get_task(name).load("test", n=args.n, seed=1)]
    chosen = [s for s in settings(args.gen_length) if not args.only or s[0] in args.only.split(",")]
    plain: dict[int, float] = {}
    steps, ops = [], {}
    stats = enable_compile(model).stats if args.compile else None
    for name, decoder, params in chosen:
        decode(model, prompts[:2], decoder, **params)  # warm-up
        for bs in [int(b) for b in args.batch_sizes.split(",")]:
            if stats is not None:  # every shape class the timed run meets is compiled before it
                run(model, prompts, decoder, params, bs)
                graphs = stats.graphs
            clock = ForwardClock(model)
            secs, tokens = run(model, prompts, decoder, params, bs)
            clock.remove()
            ev = clock.events
            n = len(ev)
            fwd_secs = sum(e[3] for e in ev)
            if bs == 1:
                for _, w, _, _ in ev:
                    if w not in plain:
                        plain[w] = plain_forward_ms(model, w)
                plain_ms = sum(plain[w] for _, w, _, _ in ev) / n
            else:
                plain_ms = float("nan")
            if stats is not None and stats.graphs != graphs:
                print(f"  ({stats.graphs - graphs} graphs compiled during the timed run)")
            if 1 not in plain:
                plain[1] = plain_forward_ms(model, 1)
            one = plain[1]
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                run(model, prompts, decoder, params, bs)
            table = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
            total = sum(e.self_cpu_time_total for e in table)
            ops[f"{name} | batch {bs}"] = [dict(op=e.key, share=e.self_cpu_time_total / total,
                                                us_per_call=e.self_cpu_time_total / e.count, calls_per_step=e.count / n)
                                           for e in table[: args.top]]
            steps.append(dict(decoder=name, batch_size=bs, tokens=tokens, forwards=n, seconds=secs,
                              fed_per_forward=sum(e[0] * e[1] for e in ev) / n,
                              computed_per_forward=sum(e[2] for e in ev) / n, ms_per_step=1000 * secs / n,
                              in_forward=fwd_secs / secs, plain_ms=plain_ms, tps=tokens / secs,
                              step_vs_plain=1000 * secs / n / plain_ms, step_vs_one_token=1000 * secs / n / one))
            s = steps[-1]
            print(f"{name:<14} batch {bs}: {n} forwards, {s['ms_per_step']:.2f} ms/step, "
                  f"{100 * s['in_forward']:.0f}% in forward, TPS {s['tps']:.0f}", flush=True)

    tps1 = {s["decoder"]: s["tps"] for s in steps if s["batch_size"] == 1}
    for s in steps:
        s["tps_vs_batch_1"] = s["tps"] / tps1[s["decoder"]] if s["decoder"] in tps1 else float("nan")
    print("\n| decoder | batch | forwards | fed / forward | computed / forward | ms / step | in forward | plain ms "
          "| step / plain | / 1-token | TPS | TPS / batch 1 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in steps:
        print(f"| {s['decoder']} | {s['batch_size']} | {s['forwards']} | {s['fed_per_forward']:.1f} | "
              f"{s['computed_per_forward']:.1f} | {s['ms_per_step']:.2f} | {100 * s['in_forward']:.0f}% | "
              f"{s['plain_ms']:.2f} | {s['step_vs_plain']:.2f}x | {s['step_vs_one_token']:.1f}x | {s['tps']:.0f} | "
              f"{s['tps_vs_batch_1']:.2f}x |")
    print(f"\nsingle-token plain forward: {plain[1]:.3f} ms")
    if stats is not None:
        print(f"compile: {stats.summary()}")
    for key, rows in ops.items():
        print(f"\n{key}\n\n| operator | self CPU | us / call | calls / step |\n|---|---|---|---|")
        for r in rows:
            print(f"| {r['op']} | {100 * r['share']:.1f}% | {r['us_per_call']:.1f} | {r['calls_per_step']:.1f} |")
    out = Path(args.out or f"benchmarks/results/profile_{model_dir.name}{'_compiled' if args.compile else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(model=str(model_dir), args=vars(args), torch=torch.__version__,
                                   plain_forward_ms=plain, steps=steps, operators=ops,
                                   compile=stats.as_dict() if stats is not None else None), indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
