"""Accuracy and speed of every decoder on the same model and held-out prompts, per task family.

    python benchmarks/decode.py --model src/refusion/assets/refusion-tiny --tasks sort,add,repeat,code
    python benchmarks/decode.py --model tests/fixtures/refusion-words --tasks sort,add,repeat
    python benchmarks/decode.py --model tests/fixtures/refusion-words --tasks sort,add,repeat \
        --only speculative,"speculative adaptive","speculative fixed 16" --temperatures 0   # a subset

For each torch thread count and batch size, every decoder setting decodes the same held-out (test
split) prompts of each task family, the settings taking turns batch by batch (this machine's speed
drifts by up to 2x within minutes; interleaved, a slow spell falls on every setting alike);
outputs are scored by the task. --repeats N does it all N times and reports each ratio's median. The speculative width policies
(the default `cost`, the same with `--lookup` drafts, `adaptive`, fixed widths 4 to 32) and `ar` also run sampled at each
--temperatures value above 0 (seed 0: the same tokens as `ar` at that temperature). Writes JSON (one
row per threads x batch x setting x task, with the outputs' token counts, forwards, tokens fed,
seconds, correct) and prints a markdown table. TPF = committed tokens / forward passes (every pass
counted); TPS = generated tokens (up to and including EOS) / wall seconds of decoding (scoring
excluded), so a batch of 8 reports the batch's throughput. TPS / AR compares with `ar` at the same
threads, batch and temperature. The cost policy measures the forward's cost at its first use (the
warm-up decodes, untimed) and learns the model's acceptance from every speculative decode before it,
as a long-running process does. Nothing else should run on the machine while this does.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from refusion.model.checkpoint import load_model
from refusion.decoding import decode, widths
from refusion.tasks import get_task
from refusion.model.tokenizer import Tokenizer


FIXED_WIDTHS = (4, 8, 16, 32)


def width_policies(L: int, **sampling) -> list[tuple[str, str, dict]]:
    """ar and the speculative width policies: the default (cost), with prompt-lookup drafts too,
    adaptive, fixed widths."""
    return [("ar", "ar", dict(max_new_tokens=L, **sampling)),
            ("speculative", "speculative", dict(gen_length=L, **sampling)),
            ("speculative lookup", "speculative", dict(gen_length=L, lookup=True, **sampling)),
            ("speculative adaptive", "speculative", dict(gen_length=L, widths="adaptive", **sampling))] + [
        (f"speculative fixed {w}", "speculative", dict(gen_length=L, draft_length=w, widths="fixed", **sampling))
        for w in FIXED_WIDTHS]


def settings(gen_length: int, temperatures: tuple[float, ...] = (0.0,)) -> list[tuple[str, str, dict]]:
    """(name, decoder, params): the decoders of the study, each at its usual settings, greedy; the
    width policies and ar sampled too at each temperature > 0 (named "... T=<t>")."""
    L = gen_length
    rf = dict(gen_length=L, slot_size=8, serial_blocks=1, slot_threshold=0.9, token_threshold=0.4)
    sampled = [(f"{name} T={t:g}", decoder, params) for t in temperatures if t > 0
               for name, decoder, params in width_policies(L, temperature=t)]
    return width_policies(L) + [
        # greedy: a token with probability >= 0.5 is the argmax already, so only values below 0.5 are lossy
        ("speculative accept-prob 0.3", "speculative", dict(gen_length=L, accept_prob=0.3)),
        ("speculative accept-prob 0.1", "speculative", dict(gen_length=L, accept_prob=0.1)),
        # a rejection drops the rest of the draft (the default for a mask adapter only)
        ("speculative fixed 16 fresh-after-miss", "speculative", dict(gen_length=L, draft_length=16, widths="fixed",
                                                                      fresh_after_miss=True)),
        ("refusion s8 0.9/0.4", "refusion", rf),
        ("refusion s8 0.7/0.2", "refusion", dict(rf, slot_threshold=0.7, token_threshold=0.2)),
        ("refusion-l2r s8 0.9/0.4", "refusion-l2r", rf),
        ("mdm-threshold 0.9", "mdm-threshold", dict(gen_length=L, block_length=32, threshold=0.9,
                                                    prefix_cache=True)),
    ] + sampled


def baseline(params: dict) -> str:
    """The `ar` setting a setting's TPS is compared with: ar at its temperature."""
    t = params.get("temperature", 0.0)
    return f"ar T={t:g}" if t > 0 else "ar"


PRIORS: dict = {}  # (model, setting) -> the pooled acceptance its decodes keep (widths.PRIORS)


def run_interleaved(model, tok, task, examples, prompts, chosen, batch_size, seed) -> list[dict]:
    """Every setting on the task's prompts, batch by batch in turn (the order rotating from one batch
    to the next), so that a slow spell of the machine falls on all of them alike: one row per setting."""
    eos = model.config.eos_ids
    acc = [dict(tokens=0, forwards=0, tokens_fed=0, seconds=0.0, outputs=[]) for _ in chosen]
    for n, i in enumerate(range(0, len(prompts), batch_size)):
        for k in np.roll(np.arange(len(chosen)), -n).tolist():
            _, decoder, params = chosen[k]
            # each setting learns its drafts' acceptance from its own decodes only, as it would alone
            widths.PRIORS[model] = PRIORS.setdefault((id(model), k), widths.Acceptance())
            t = time.perf_counter()
            res = decode(model, prompts[i: i + batch_size], decoder, eos_ids=eos, seed=seed, **params)
            a = acc[k]
            a["seconds"] += time.perf_counter() - t
            a["tokens"] += sum(len(r.tokens) for r in res)
            a["forwards"] += sum(r.forwards for r in res)
            a["tokens_fed"] += sum(r.tokens_fed for r in res)
            a["outputs"] += [tok.decode([t for t in r.tokens if t not in eos]) for r in res]
    rows = []
    for a in acc:
        outputs = a.pop("outputs")
        scores = task.score_many(examples, outputs) if task.score_many else [task.score(e, o) for e, o in
                                                                              zip(examples, outputs)]
        rows.append(dict(a, n=len(prompts), correct=sum(s.correct for s in scores),
                         outputs_sha1=hashlib.sha1(json.dumps(outputs).encode()).hexdigest()))
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    """One line per threads x batch x setting: accuracy (mean over tasks), TPF, TPS, TPS / AR (against
    ar at the setting's temperature), and TPS / AR per task family. With rounds (--repeats), each
    round is summarised on its own and the rounds are merged: the median TPS and the median of each
    round's ratio to AR (this machine's speed drifts by up to 2x from one minute to the next; a
    round's settings run within a minute or two, so its ratios are taken under one speed), the mean
    TPF and tokens fed (the cost policy's follow the timings)."""
    rounds = sorted({r.get("round", 0) for r in rows})
    per_round = [summarise_round([r for r in rows if r.get("round", 0) == n]) for n in rounds]
    out = []
    for lines in zip(*per_round):
        first = lines[0]
        if any(line["outputs"] != first["outputs"] for line in lines):
            raise SystemExit(f"{first['name']}: rounds gave different outputs (a decoder that is not deterministic?)")
        med = lambda key: statistics.median(line[key] for line in lines)  # noqa: E731
        mean = lambda key: statistics.fmean(line[key] for line in lines)  # noqa: E731
        out.append(dict(first, rounds=len(lines), tps=med("tps"), tps_vs_ar=med("tps_vs_ar"), tpf=mean("tpf"),
                        fed_per_forward=mean("fed_per_forward"),
                        tps_vs_ar_by_task={t: statistics.median(line["tps_vs_ar_by_task"][t] for line in lines)
                                           for t in first["tps_vs_ar_by_task"]}))
    for line in out:
        del line["outputs"]
    return out


def summarise_round(rows: list[dict]) -> list[dict]:
    """summarise() for the rows of one round."""
    keys = sorted({(r["threads"], r["batch_size"]) for r in rows})
    names = list(dict.fromkeys(r["name"] for r in rows))
    out = []
    for th, bs in keys:
        sel = {(r["name"], r["task"]): r for r in rows if (r["threads"], r["batch_size"]) == (th, bs)}
        tasks = list(dict.fromkeys(t for _, t in sel))
        for name in names:
            rs = [sel[(name, t)] for t in tasks if (name, t) in sel]
            base = rs[0].get("baseline", "ar")  # (rows written before the field: greedy, against ar)
            ar = {t: sel[(base, t)] for t in tasks}
            ar_tps = sum(r["tokens"] for r in ar.values()) / sum(r["seconds"] for r in ar.values())
            tps = sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs)
            per_task = {r["task"]: (r["tokens"] / r["seconds"]) / (ar[r["task"]]["tokens"] / ar[r["task"]]["seconds"])
                        for r in rs}
            out.append(dict(threads=th, batch_size=bs, name=name, temperature=rs[0].get("temperature", 0.0),
                            accuracy=sum(r["correct"] / r["n"] for r in rs) / len(rs),
                            accuracy_by_task={r["task"]: r["correct"] / r["n"] for r in rs},
                            tpf=sum(r["tokens"] for r in rs) / sum(r["forwards"] for r in rs), tps=tps,
                            tps_vs_ar=tps / ar_tps, tps_vs_ar_by_task=per_task,
                            # (rows written before outputs were hashed: None)
                            same_outputs_as_ar=all(r.get("outputs_sha1") == ar[r["task"]].get("outputs_sha1")
                                                   for r in rs) if "outputs_sha1" in rs[0] else None,
                            fed_per_forward=sum(r["tokens_fed"] for r in rs) / sum(r["forwards"] for r in rs),
                            outputs=[r.get("outputs_sha1") for r in rs]))
    return out


def table(summary: list[dict]) -> str:
    tasks = list(summary[0]["accuracy_by_task"])
    head = ("| threads | batch | decoder | outputs = AR's | accuracy % | " + " | ".join(f"{t} acc" for t in tasks) +
            " | TPF | TPS | TPS / AR | " + " | ".join(f"{t} TPS / AR" for t in tasks) + " | fed / forward |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in summary:
        lines.append(
            f"| {s['threads']} | {s['batch_size']} | {s['name']} | "
            f"{ {True: 'yes', False: 'no', None: '?'}[s.get('same_outputs_as_ar')]} | {100 * s['accuracy']:.1f} | "
            + " | ".join(f"{100 * s['accuracy_by_task'][t]:.0f}" for t in tasks)
            + f" | {s['tpf']:.2f} | {s['tps']:.0f} | {s['tps_vs_ar']:.2f}x | "
            + " | ".join(f"{s['tps_vs_ar_by_task'][t]:.2f}x" for t in tasks)
            + f" | {s['fed_per_forward']:.1f} |")
    return "\n".join(lines)


def policy_table(summary: list[dict]) -> str:
    """The width policies side by side: TPS / AR (TPF) per threads x batch x temperature."""
    policies = ["speculative", "speculative adaptive"] + [f"speculative fixed {w}" for w in FIXED_WIDTHS]
    cells = {(s["threads"], s["batch_size"], s["temperature"], s["name"].split(" T=")[0]): s for s in summary}
    keys = sorted({k[:3] for k in cells})
    head = "| threads | batch | temperature | " + " | ".join(p.replace("speculative", "").strip() or "default (cost)"
                                                           for p in policies) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for th, bs, t in keys:
        row = [cells.get((th, bs, t, p)) for p in policies]
        lines.append(f"| {th} | {bs} | {t:g} | " + " | ".join(f"{c['tps_vs_ar']:.2f}x ({c['tpf']:.2f})" if c else "-"
                                                           for c in row) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tasks", required=True, help="comma-separated task names (their test split is used)")
    ap.add_argument("--n", type=int, default=16, help="prompts per task")
    ap.add_argument("--gen-length", type=int, default=160)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    ap.add_argument("--temperatures", default="0,0.7",
                    help="comma-separated: the width policies and ar also run sampled at each value > 0")
    ap.add_argument("--only", help="comma-separated setting names to run (default: all; the ar they are compared "
                                   "with is always run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds of every setting, in turn (so a slow spell of the machine falls on all of them); "
                         "TPS from each one's median round")
    ap.add_argument("--out", help="JSON path (default: benchmarks/results/decode_<model dir name>.json)")
    args = ap.parse_args()
    model_dir = Path(args.model)
    model, tok = load_model(model_dir), Tokenizer.from_dir(model_dir)
    tasks = {name: get_task(name) for name in args.tasks.split(",")}
    data = {}
    for name, task in tasks.items():
        exs = task.load("test", n=args.n, seed=args.seed)
        data[name] = (exs, [tok.chat_prompt_ids(ex.prompt) for ex in exs])
    chosen = settings(args.gen_length, tuple(float(t) for t in args.temperatures.split(",")))
    if args.only:
        keep = set(args.only.split(","))
        keep |= {baseline(params) for name, _, params in chosen if name in keep}
        chosen = [c for c in chosen if c[0] in keep]
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for _, decoder, params in chosen:  # warm-up: first calls allocate and pick kernels
            decode(model, data[next(iter(data))][1][:2], decoder, **params)
        for bs, round_ in itertools.product([int(b) for b in args.batch_sizes.split(",")], range(args.repeats)):
            for task_name, (exs, prompts) in data.items():
                got = run_interleaved(model, tok, tasks[task_name], exs, prompts, chosen, bs, args.seed)
                for (name, decoder, params), r in zip(chosen, got):
                    rows.append(dict(threads=threads, batch_size=bs, name=name, decoder=decoder, params=params,
                                     temperature=params.get("temperature", 0.0), baseline=baseline(params),
                                     task=task_name, round=round_, **r))
                    print(f"threads {threads} batch {bs:>2} round {round_} {name:<28} {task_name:<8} "
                          f"acc {r['correct']:>3}/{r['n']:<3} TPF {r['tokens'] / r['forwards']:5.2f} "
                          f"TPS {r['tokens'] / r['seconds']:8.1f}", flush=True)
    summary = summarise(rows)
    print()
    print(table(summary))
    print("\nwidth policies: TPS / AR (TPF)\n")
    print(policy_table(summary))
    out = Path(args.out or f"benchmarks/results/decode_{model_dir.name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(model=str(model_dir), args=vars(args), torch=torch.__version__,
                                   summary=summary, rows=rows), indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
