"""Print one example laid out by each variant of the ReFusion objective: feed order, positions, labels,
and who attends to whom (docs/training.md, "The ReFusion objective and its variants").

    python scripts/show_layouts.py                 # every variant, docs/training.md's example
    python scripts/show_layouts.py hybrid --seed 3

The example: prompt p0 p1, response a b c d e f (slots of 2; draft blocks of 2). Tokens are letters, a
mask is `_`; a label column shows what the row is trained to predict (`.` none); in the attention
grid row q, column k is `#` where q may attend to k.
"""

from __future__ import annotations

import argparse

import torch

from refusion.training.joint_layouts import draft_inputs, hybrid_inputs, joint_hybrid_inputs
from refusion.training.objectives import IGNORE, make_batch, refusion_inputs
from refusion.training.variants import VARIANTS, parse_variant

NAMES = {1: "p0", 2: "p1", 10: "a", 11: "b", 12: "c", 13: "d", 14: "e", 15: "f", 99: "_"}
MASK = 99


def layout(variant: str, seed: int):
    batch = make_batch([[1, 2]], [[10, 11, 12, 13, 14, 15]], 0)
    g = torch.Generator().manual_seed(seed)
    v = parse_variant(variant)
    if v.drafts:
        return draft_inputs(batch, MASK, g, slot_sizes=(2,))
    if v.name == "hybrid":
        return hybrid_inputs(batch, MASK, g, slot_sizes=(2,), eps=0.5)
    if v.name == "joint-hybrid":
        return joint_hybrid_inputs(batch, MASK, g, slot_sizes=(2,), eps=0.5)
    return refusion_inputs(batch, MASK, g, slot_sizes=(2,), eps=0.5, boundary=v.boundary, ar_share=v.ar_share)


def show(variant: str, seed: int) -> str:
    x = layout(variant, seed)
    ids, pos, lab = x.input_ids[0].tolist(), x.position_ids[0].tolist(), x.labels[0].tolist()
    attn = x.attn_mask[0, 0]
    w = 3
    cell = lambda s: f"{s:>{w}}"  # noqa: E731
    lines = [f"{variant} (seed {seed})",
             "feed      " + "".join(cell(NAMES[t]) for t in ids),
             "position  " + "".join(cell(p) for p in pos),
             "label     " + "".join(cell("." if t == IGNORE else NAMES[t]) for t in lab),
             "attends to:"]
    for q, t in enumerate(ids):
        lines.append(f"  {NAMES[t]:>3} @{pos[q]:<3} " + "".join(cell("#" if attn[q, k] else ".") for k in range(len(ids))))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variants", nargs="*", default=["paper", "boundary", "joint", "hybrid"],
                    help=f"of {', '.join(VARIANTS)} (ar-share as ar-share:F); decoupled and mask-only lay out as joint")
    ap.add_argument("--seed", type=int, default=115)
    a = ap.parse_args()
    print("\n\n".join(show(v, a.seed) for v in a.variants))


if __name__ == "__main__":
    main()
