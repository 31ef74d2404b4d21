"""An adapter made by `refusion adapt`, per domain, on held-out prompts: how much faster than its base's AR,
and is every output the base's?

    python benchmarks/adapt.py --model runs/adapt-smollm2/adapter            # full: 4 domains x 50 prompts,
                                                                             # batch 1 and 8, 1 and 2 threads
    python benchmarks/adapt.py --model runs/adapt-smollm2/adapter --quick    # a correctness pass in minutes
    python benchmarks/adapt.py --model runs/x/adapter --against smollm2-refusion   # a new adapter against the
                                                                             # shipped one, in the same run

Held-out sets (refusion.training.adapt.measure: never training prompts): the project's chat requests, GSM8K
test, HumanEval, MBPP test, each asked as `refusion eval` asks it, chat template applied; the first --n of
each set's seeded order (`refusion adapt` chose the adapter's settings on its last 16). Per thread count and
batch size, the base's greedy AR decoding and the adapted model's own settings (its decoding.json: what
`refusion generate --model DIR` runs) decode every prompt; batch size N is N sequences at once, a finished
one's row taken by the next prompt, as `refusion serve` runs N requests. Reported per row: identical (outputs
token for token equal to the base's AR output at the smallest batch size and the first thread count), TPF
(tokens / forward passes, every pass counted for each sequence), TPS (generated tokens / seconds of decoding)
and TPS / AR (against the base's AR at the same threads and batch), and the targets
(batch 1, one thread: TPF >= 2.5 on chat, >= 3.2 on GSM8K and code, >= 2.0x AR everywhere; at batch 8
never slower than AR) met or not. The adapter's size and the peak memory of a process that loads each
model and decodes one prompt are measured too. `--against` adds another adapter of the same base
(rows named "against", with its own decoding.json), timed beside the first on the same prompts: timings
taken in different runs on a shared machine differ by more than two adapters do. JSON is written after
every row; the same command again runs only the rows it lacks. Nothing else should run on the machine
while it times.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from refusion.bundled import ADAPTER_CONFIG, ASSETS, adapter_base, adapter_names, resolve_model
from refusion.decoding import decode
from refusion.model.checkpoint import load_model
from refusion.model.tokenizer import Tokenizer
from refusion.training.adapt.measure import HELD_OUT, decode_all, held_out_examples, summarize

sys.path.insert(0, str(Path(__file__).parent))
from smollm2_speculative import adapter_costs, peak_memory  # noqa: E402  (the same measures of an adapter's cost)

TARGET_TPF = {"chat": 2.5, "gsm8k": 3.2, "humaneval": 3.2, "mbpp": 3.2}
TARGET_SPEED_B1, TARGET_SPEED_B8 = 2.0, 1.0


def run(model, prompts: list[list[int]], decoder: str | None, batch_size: int, max_tokens: int, eos: list[int],
        label: str) -> dict:
    with tqdm(total=len(prompts), desc=label, unit="prompt", leave=False, mininterval=10, file=sys.stderr) as bar:
        return decode_all(model, prompts, decoder, batch_size, max_tokens, eos, done=bar.update)


def targets(summary: list[dict]) -> list[str]:
    """The targets, each with its figure and whether it holds."""
    lines = []
    for s in summary:
        if s["name"] != "adapted":
            continue
        if s["batch_size"] == 1 and s["threads"] == 1:
            lines.append(f"{s['bench']}: TPF {s['tpf']:.2f} (target >= {TARGET_TPF[s['bench']]}) "
                         f"{'met' if s['tpf'] >= TARGET_TPF[s['bench']] else 'NOT met'}; {s['tps_vs_ar']:.2f}x AR "
                         f"(target >= {TARGET_SPEED_B1}x) {'met' if s['tps_vs_ar'] >= TARGET_SPEED_B1 else 'NOT met'}")
        if s["batch_size"] == 8:
            lines.append(f"{s['bench']} batch 8, {s['threads']} thread(s): {s['tps_vs_ar']:.2f}x AR (target >= "
                         f"{TARGET_SPEED_B8}x) {'met' if s['tps_vs_ar'] >= TARGET_SPEED_B8 else 'NOT met'}")
    return lines


def table(summary: list[dict]) -> str:
    lines = ["| threads | batch | model | domain | identical to the base | TPF | TPS | TPS / AR |", "|" + "---|" * 8]
    for s in summary:
        vs = f"{s['tps_vs_ar']:.2f}x" if s["tps_vs_ar"] else ""
        lines.append(f"| {s['threads']} | {s['batch_size']} | {s['name']} | {s['bench']} | {s['identical']}/{s['n']} "
                     f"| {s['tpf']:.2f} | {s['tps']:.1f} | {vs} |")
    return "\n".join(lines)


def adapter_directory(ap: argparse.ArgumentParser, flag: str, value: str) -> tuple[Path, Path]:
    """The adapter directory `value` names (a directory or a bundled name such as smollm2-refusion) and
    its base model's directory."""
    path = Path(value)
    if not path.exists() and value in adapter_names():
        path = ASSETS / value
    if not (path / ADAPTER_CONFIG).is_file():
        ap.error(f"{flag} {value}: not a mask adapter directory (refusion adapt's DIR/adapter) or a bundled adapter")
    named = json.loads((path / ADAPTER_CONFIG).read_text()).get("base")
    try:
        return path, adapter_base(path, named)
    except (TypeError, ValueError) as e:
        ap.error(f"{flag} {value}: its base model {named!r} cannot be found ({e})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the adapter directory (refusion adapt's DIR/adapter) or name")
    ap.add_argument("--domains", default=",".join(HELD_OUT), help=f"comma-separated: {', '.join(HELD_OUT)}")
    ap.add_argument("--n", type=int, default=50, help="prompts per domain (a seeded sample)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    ap.add_argument("--seed", type=int, default=0, help="of the sample of prompts")
    ap.add_argument("--quick", action="store_true", help="a correctness pass: chat only, 2 prompts, 16 tokens, "
                    "batch 1 and 2, one thread (unless given)")
    ap.add_argument("--against", help="another adapter directory or name of the same base, timed in the same run")
    ap.add_argument("--out", default="benchmarks/results/adapt.json")
    args = ap.parse_args()
    if args.quick:
        given = {a.split("=")[0] for a in sys.argv[1:]}
        for flag, value in (("--domains", "chat"), ("--n", 2), ("--max-tokens", 16), ("--batch-sizes", "1,2"),
                            ("--threads", "1")):
            if flag not in given:
                setattr(args, flag[2:].replace("-", "_"), value)
    domains = args.domains.split(",")
    if set(domains) - set(HELD_OUT):
        ap.error(f"unknown domains {sorted(set(domains) - set(HELD_OUT))}; domains: {', '.join(HELD_OUT)}")
    adapter_dir, base_dir = adapter_directory(ap, "--model", args.model)
    adapted_dir = resolve_model(str(adapter_dir))
    against_dir = None
    if args.against:
        other, other_base = adapter_directory(ap, "--against", args.against)
        if other_base.resolve() != base_dir.resolve():
            ap.error(f"--against {args.against}: an adapter of another base than --model's ({base_dir})")
        against_dir = resolve_model(str(other))
    out = Path(args.out)
    state = json.loads(out.read_text()) if out.exists() else {}
    same = ("model", "against", "n", "max_tokens", "seed")
    differ = [k for k in same if state and state["args"].get(k) != getattr(args, k)]
    if differ:
        sys.exit(f"{out} holds a run with other {', '.join(differ)}: choose another --out (or remove it)")
    base, adapted, tok = load_model(base_dir), load_model(adapted_dir), Tokenizer.from_dir(base_dir)
    eos = tok.stop_ids(base.config.eos_ids)
    prompts = {d: [tok.chat_prompt_ids(e.prompt) for e in held_out_examples(d, args.n, args.seed)] for d in domains}
    rows = state.get("rows", [])
    done = {(r["threads"], r["batch_size"], r["name"], r["bench"]) for r in rows}
    thread_counts = [int(t) for t in args.threads.split(",")]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    models = {"base ar": (base, "ar"), "adapted": (adapted, None)}  # None: the adapter's decoding.json
    if against_dir is not None:
        models["against"] = (load_model(against_dir), None)
    for threads in thread_counts:
        torch.set_num_threads(threads)
        for name, (model, decoder) in models.items():  # first calls allocate and pick kernels
            decode(model, prompts[domains[0]][:1], decoder, gen_length=8)
        for bs in batch_sizes:
            for d in domains:  # AR first: a domain's rows timed together
                for name, (model, decoder) in models.items():
                    if (threads, bs, name, d) in done:
                        continue
                    r = run(model, prompts[d], decoder, bs, args.max_tokens, eos, f"threads {threads} batch {bs} {name} {d}")
                    rows.append(dict(threads=threads, batch_size=bs, name=name, bench=d, **r))
                    tokens = sum(map(len, r["outputs"]))
                    print(f"threads {threads} batch {bs:>2} {name:<8} {d:<9} TPF {tokens / max(r['forwards'], 1):5.2f} "
                          f"TPS {tokens / r['seconds']:8.1f}", flush=True)
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_text(json.dumps(dict(args=vars(args), torch=torch.__version__, rows=rows)))
    summary = summarize(rows, reference=(thread_counts[0], min(batch_sizes)))
    costs = state.get("costs")
    if costs is None:
        costs = adapter_costs(base, adapted, adapter_dir)
        probe = prompts[domains[0]][0]
        costs["peak_rss_bytes"] = {"base ar": peak_memory(base_dir, probe, args.max_tokens),
                                   "speculative": peak_memory(adapted_dir, probe, args.max_tokens)}
    settings = (adapter_dir / "decoding.json").read_text() if (adapter_dir / "decoding.json").is_file() else None
    out.write_text(json.dumps(dict(args=vars(args), torch=torch.__version__, rows=rows, summary=summary, costs=costs,
                                   decoding=json.loads(settings) if settings else None, targets=targets(summary))))
    print()
    print(table(summary))
    print("\n" + "\n".join(targets(summary)))
    mib, rss = 1024 * 1024, costs["peak_rss_bytes"]
    print(f"\nadapter: {costs['extra_parameters']:,} parameters on a base of {costs['base_parameters']:,}, files "
          f"{(costs['adapter_file_bytes'] or 0) / mib:.1f} MiB; peak RSS (load + decode one prompt): base "
          f"{rss['base ar'] / mib:.0f} MiB, adapted {rss['speculative'] / mib:.0f} MiB")
    print(f"wrote {out}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
