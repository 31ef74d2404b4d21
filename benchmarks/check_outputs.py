"""Speed work must not change a single output token: record every decoder's outputs, or compare with a record.

    python benchmarks/check_outputs.py --check                                         # the bundled model
    python benchmarks/check_outputs.py --model tests/fixtures/refusion-words --check   # the words fixture
    python benchmarks/check_outputs.py --write        # re-record (only for a change meant to alter outputs)

The records are benchmarks/expected/outputs_<model directory name>.json (--check/--write PATH for
another file); --check decodes with the record's own --tasks, --n and --gen-length unless given.

Every decoder setting of benchmarks/decode.py plus sampled variants decodes held-out prompts of the
bundled model's task families, alone and in batches of 8; tokens, positions, steps, forwards and
tokens fed are recorded per prompt. --check exits 1 on any difference and names the first ones.
Not a unit test (it takes a few minutes); run it after any change to the model or a decoder.

--compile decodes through the compiled forward (refusion.model.compiled), which is not bit-identical to
eager: --check then counts, per setting, the prompts whose output differs from the (eager) record.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from refusion.model.checkpoint import load_model
from refusion.model.compiled import enable_compile
from refusion.bundled import BUNDLED
from refusion.decoding import decode
from refusion.tasks import get_task
from refusion.model.tokenizer import Tokenizer

EXPECTED = Path(__file__).resolve().parent / "expected"  # the recorded outputs --check compares with


def settings(L: int) -> list[tuple[str, str, dict]]:
    rf = dict(gen_length=L, slot_size=8, serial_blocks=1, slot_threshold=0.9, token_threshold=0.4)
    return [
        ("ar", "ar", dict(max_new_tokens=L)),
        ("ar sampled", "ar", dict(max_new_tokens=L, temperature=0.8, top_p=0.9)),
        # adaptive widths (the record's): the default cost policy's steps follow timings, so only the
        # tests check its tokens (AR's)
        ("speculative", "speculative", dict(gen_length=L, widths="adaptive")),
        ("speculative fixed 16", "speculative", dict(gen_length=L, draft_length=16, widths="fixed")),
        ("speculative accept-prob 0.3", "speculative", dict(gen_length=L, accept_prob=0.3, widths="adaptive")),
        ("speculative sampled", "speculative", dict(gen_length=L, temperature=0.8, top_k=20, widths="adaptive")),
        ("refusion s8 0.9/0.4", "refusion", rf),
        ("refusion s4 B2 0.7/0.2", "refusion", dict(rf, slot_size=4, serial_blocks=2, slot_threshold=0.7,
                                                     token_threshold=0.2)),
        ("refusion recompute", "refusion", dict(rf, recompute_kv=True)),
        ("refusion sampled", "refusion", dict(rf, temperature=0.7)),
        ("refusion-l2r s8 0.9/0.4", "refusion-l2r", rf),
        ("mdm", "mdm", dict(gen_length=L, block_length=32, steps=L // 2)),
        ("mdm-threshold 0.9", "mdm-threshold", dict(gen_length=L, block_length=32, threshold=0.9, prefix_cache=True)),
    ]


def record(model, prompts: list[list[int]], L: int) -> dict:
    out = {}
    for name, decoder, params in settings(L):
        for bs in (1, 8):
            rows = []
            for i in range(0, len(prompts), bs):
                for r in decode(model, prompts[i: i + bs], decoder, seed=0, **params):
                    rows.append(dict(tokens=r.tokens, positions=r.positions, steps=r.steps, forwards=r.forwards,
                                     tokens_fed=r.tokens_fed))
            out[f"{name} | batch {bs}"] = rows
            print(f"{name:<30} batch {bs}: {sum(len(r['tokens']) for r in rows)} tokens", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(BUNDLED))
    ap.add_argument("--tasks", help="task families (default: the record's; writing: sort,add,repeat,code, "
                                    "the bundled model's)")
    ap.add_argument("--n", type=int, help="prompts per task (default: the record's; writing: 4)")
    ap.add_argument("--gen-length", type=int, help="default: the record's; writing: 96")
    ap.add_argument("--compile", action="store_true", help="decode through the compiled forward")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", nargs="?", const="", metavar="RECORD",
                   help="record the outputs to this JSON file (default: benchmarks/expected/outputs_<model>.json)")
    g.add_argument("--check", nargs="?", const="", metavar="RECORD",
                   help="compare the outputs with this JSON record (default: benchmarks/expected/outputs_<model>.json)")
    args = ap.parse_args()
    default_record = str(EXPECTED / f"outputs_{Path(args.model).resolve().name}.json")
    if args.write == "":
        args.write = default_record
    if args.check == "":
        args.check = default_record
    recorded = json.loads(Path(args.check).read_text()) if args.check else None
    for key, default in (("tasks", "sort,add,repeat,code"), ("n", 4), ("gen_length", 96)):
        if getattr(args, key) is None:
            setattr(args, key, recorded["args"][key] if recorded else default)
    torch.set_num_threads(1)
    model, tok = load_model(args.model), Tokenizer.from_dir(args.model)
    stats = enable_compile(model).stats if args.compile else None
    prompts = [tok.chat_prompt_ids(ex.prompt) for name in args.tasks.split(",")
               for ex in get_task(name).load("test", n=args.n, seed=1)]
    got = record(model, prompts, args.gen_length)
    if stats is not None:
        print(f"compiled: {stats.summary()}")
    if args.write:
        Path(args.write).parent.mkdir(parents=True, exist_ok=True)
        Path(args.write).write_text(json.dumps(dict(args=vars(args), outputs=got)))
        print(f"wrote {args.write}")
        return
    want = recorded["outputs"]
    bad = [(k, i, field) for k in want for i, (a, b) in enumerate(zip(want[k], got.get(k, [])))
           for field in a if a[field] != b[field]]
    missing = [k for k in want if k not in got or len(got[k]) != len(want[k])]
    if args.compile:
        for k in want:
            rows = {i for k2, i, _ in bad if k2 == k}
            print(f"{k:<40} {len(want[k]) - len(rows)}/{len(want[k])} identical")
    if bad or missing:
        for k, i, field in bad[:10]:
            print(f"DIFFERENT: {k}, prompt {i}, {field}")
        for k in missing:
            print(f"MISSING: {k}")
        sys.exit(1)
    print(f"identical: {len(want)} settings x prompts, tokens, positions, steps, forwards and tokens fed")


if __name__ == "__main__":
    main()
