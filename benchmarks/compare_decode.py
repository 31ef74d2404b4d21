"""Two runs of benchmarks/decode.py side by side: TPS after / before per setting, and whether the
decoders' TPF and accuracy are the same (they must be, for a change that only moves code).

    python benchmarks/compare_decode.py BEFORE.json AFTER.json [--out TABLE.md]

Take the two runs back to back on a quiet machine (decode.py's own advice); a change is "no slower"
when the ratios scatter around 1 as much as two runs of the same code do.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def rows(path: str) -> dict[tuple, dict]:
    return {(r["threads"], r["batch_size"], r["name"]): r for r in json.loads(Path(path).read_text())["summary"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--out", help="also write the markdown table here")
    args = ap.parse_args()
    before, after = rows(args.before), rows(args.after)
    missing = sorted(set(before) ^ set(after))
    if missing:
        raise SystemExit(f"the runs differ in their settings: {missing}")
    lines = ["| threads | batch | setting | TPS before | TPS after | after / before | TPF same | accuracy same |",
             "|---|---|---|---|---|---|---|---|"]
    ratios, same = [], True
    for key in sorted(before, key=lambda k: (k[0], k[1])):
        b, a = before[key], after[key]
        ratio = a["tps"] / b["tps"]
        ratios.append(ratio)
        tpf, acc = a["tpf"] == b["tpf"], a["accuracy"] == b["accuracy"]
        same &= tpf and acc
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {b['tps']:.0f} | {a['tps']:.0f} | {ratio:.3f} | "
                     f"{'yes' if tpf else '**no**'} | {'yes' if acc else '**no**'} |")
    lines.append(f"\nmedian after / before {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}); "
                 f"TPF and accuracy {'identical in every setting' if same else 'DIFFER'}")
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
