"""How far a mask-adapted model's drafts could carry `speculative` decoding: tokens per forward by drafter,
counted offline on the base's own greedy answers, with no timing.

    python benchmarks/draft_bounds.py --answers benchmarks/results/smollm2_speculative_b1.json --n-gsm8k 60 --n-humaneval 30

For every answer the base gave (greedy AR, read from a `smollm2_speculative.py` result file, whose
prompts this script rebuilds the same way), a few forwards compute what the masks would draft at
every point of the answer: after each committed prefix, a block of --block masks that sees that prefix (the
layout `speculative` feeds and the recipe trains). The copies of earlier text (lookup.py) and the
corpus' continuations (corpus.py) are computed at every point too. A decode is then replayed step by
step with drafts of a fixed width, each step committing the accepted prefix of the draft it verifies
and one more token, as `speculative` does:

- masks, rest after a miss: the masks' draft, fresh only after a step whose draft was accepted
  whole; after a rejection, the rest of the rejected draft (spec section 7; the masks' tokens the
  decoder puts after it were drafted beside a token that was not kept, and count as wrong here);
- masks, fresh after a miss: the same, but a rejection leaves no draft (`fresh_after_miss`, the
  default for a mask adapter): the next step feeds masks alone, and the one after it a fresh draft;
- masks, redraft: a fresh masks' draft at every step (what `--redraft` feeds, at width + 1 blocks of
  masks per step);
- copy / corpus: that drafter alone;
- one of three, best (fresh after a miss): each step verifies whichever of the masks', the copy's and the corpus' drafts
  is accepted furthest (an oracle's choice: the bound for any rule that picks one draft per step,
  and what verifying all three drafts in one forward, a tree of three branches, would commit);
- the same with redraft.

Tokens per forward here depend on the drafts and the width alone, not on the device: they are what
the decode commits per step. Whether a width pays is the device's business (benchmarks/forward_cost.py;
the cost policy, decoding/widths.py, chooses widths per step). Writes JSON and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from refusion.bundled import ASSETS, adapter_base, resolve_model
from refusion.decoding.corpus import corpus_of
from refusion.decoding.lookup import NgramIndex
from refusion.model.cache import KVCache
from refusion.model.checkpoint import load_model
from refusion.model.mask_adapter import ADAPTER_CONFIG
from refusion.model.tokenizer import Tokenizer

from smollm2_speculative import gsm8k_examples, humaneval_examples  # (the same prompts; this folder is on the path)

CUTS_PER_FORWARD = 64  # answer points whose mask blocks one forward computes (bounds its memory)
POLICIES = ("masks, rest after a miss", "masks, fresh after a miss", "masks, redraft", "copy", "corpus",
            "one of three, best", "one of three, best, redraft")


@torch.inference_mode()
def mask_drafts(model, prompt: list[int], answer: list[int], block: int) -> np.ndarray:
    """[len(answer), block]: the masks' argmax at offsets 0..block-1 after each answer prefix
    answer[:c] (offset 0 is the position of answer[c])."""
    P, C = len(prompt), len(answer)
    ids = torch.tensor([prompt + answer])
    cache = KVCache(model.config.num_layers)
    model(ids, torch.arange(ids.shape[1])[None], cache=cache, num_logits=1)
    T, mask_id = ids.shape[1], model.config.mask_token_id
    out = np.zeros((C, block), dtype=np.int64)
    j = torch.arange(block)
    for lo in range(0, C, CUTS_PER_FORWARD):
        cuts = torch.arange(lo, min(C, lo + CUTS_PER_FORWARD))
        n = len(cuts)
        blk = cuts.repeat_interleave(block)
        jj = j.repeat(n)
        seen = torch.arange(T)[None, :] < (P + blk)[:, None]  # the prompt and answer[:c]
        own = (blk[:, None] == blk[None, :]) & (jj[None, :] <= jj[:, None])  # its own block, causally
        attn = torch.cat([seen, own], 1)[None, None]
        pos = (P + blk + jj)[None]
        logits = model(torch.full((1, n * block), mask_id), pos, attn, cache=cache)
        cache.length = T  # the masks' entries are dropped: the next chunk attends to the answer alone
        out[lo:lo + n] = logits[0].argmax(-1).view(n, block).numpy()
    return out


def accepted(draft: list[int], answer: list[int], g: int) -> int:
    a = 0
    while a < len(draft) and g + a < len(answer) and draft[a] == answer[g + a]:
        a += 1
    return a


def replay(prompt: list[int], answer: list[int], masks: np.ndarray, corpus, width: int, policy: str) -> int:
    """Forwards a decode of `answer` takes with drafts of `width` under `policy` (the prefill included)."""
    use_masks = policy.startswith(("masks", "one of"))
    redraft = policy.endswith("redraft")
    index = NgramIndex(prompt)
    index.extend(answer[:1])  # the prefill commits the first token; the masks after the prompt draft
    g, fresh, forwards = 1, True, 1
    held: list[int] = []  # after a rejection: the rest of the draft, the guesses for the positions after it
    while g < len(answer):
        drafts = []
        if use_masks and (fresh or redraft):
            drafts.append(masks[g - 1, 1:1 + width].tolist())  # masks that saw answer[:g-1]; answer[g-1] is x
        elif use_masks and policy == "masks, rest after a miss":
            drafts.append(held[:width])
        if policy in ("copy", "one of three, best", "one of three, best, redraft"):
            drafts.append(index.propose(width)[0])
        if policy in ("corpus", "one of three, best", "one of three, best, redraft") and corpus is not None:
            drafts.append(corpus.propose(index.tokens, width)[0][:width])
        drafts = [d for d in drafts if d]
        if drafts:
            best = max(drafts, key=lambda d: accepted(d, answer, g))
            a = accepted(best, answer, g)
            fresh = a == len(best)  # the masks behind it saw only committed tokens
            held = best[a + 1:]
        else:
            a, fresh = 0, True  # masks alone: fresh at the next step
        n = min(a + 1, len(answer) - g)
        index.extend(answer[g:g + n])
        g += n
        forwards += 1
    return forwards


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--answers", default="benchmarks/results/smollm2_speculative_b1.json",
                    help="a smollm2_speculative.py result file: its batch-1 'base ar' outputs and its arguments")
    ap.add_argument("--model", help="the adapted model (default: the result file's)")
    ap.add_argument("--n-gsm8k", type=int, default=60)
    ap.add_argument("--n-humaneval", type=int, default=30)
    ap.add_argument("--widths", default="4,8,16", help="draft widths replayed")
    ap.add_argument("--block", type=int, default=17, help="masks per block: the widest draft + 1")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/draft_bounds.json")
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    if max(widths) >= args.block:
        ap.error(f"--block must exceed the widest draft ({max(widths)}): a block's first mask is the token x")
    src = json.loads(Path(args.answers).read_text())
    a = src["args"]
    model_name = args.model or a["model"]
    adapter_dir = next((p for p in (Path(model_name), ASSETS / model_name) if (p / ADAPTER_CONFIG).is_file()), None)
    base_dir = resolve_model(a["base"]) if a.get("base") else adapter_base(
        adapter_dir, json.loads((adapter_dir / ADAPTER_CONFIG).read_text())["base"])
    torch.set_num_threads(args.threads)
    model, tok = load_model(resolve_model(model_name)), Tokenizer.from_dir(base_dir)
    corpus = corpus_of(model)
    examples = {"gsm8k": gsm8k_examples(a["gsm8k"], a["n_gsm8k"], a["seed"]),
                "humaneval": humaneval_examples(a["humaneval"], a["n_humaneval"], a["seed"])}
    rows, start = [], time.perf_counter()
    for bench, n in (("gsm8k", args.n_gsm8k), ("humaneval", args.n_humaneval)):
        ar = next((r for r in src["rows"] if r["name"] == "base ar" and r["bench"] == bench
                   and str(r["batch_size"]) == "1"), None)
        if ar is None or n <= 0:
            continue
        n = min(n, len(ar["outputs"]))
        cases = []
        for i in range(n):
            prompt, answer = tok.chat_prompt_ids(examples[bench][i].prompt), ar["outputs"][i]
            if answer:
                cases.append((prompt, answer, mask_drafts(model, prompt, answer, args.block)))
            print(f"{bench} {i + 1}/{n}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
        tokens = sum(len(c[1]) for c in cases)
        for w in widths:
            for policy in POLICIES:
                forwards = sum(replay(p, ans, m, corpus, w, policy) for p, ans, m in cases)
                rows.append(dict(bench=bench, n=len(cases), width=w, policy=policy, tokens=tokens,
                                 forwards=forwards, tpf=tokens / forwards))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(args=vars(args), model=model_name, rows=rows), indent=1))
    print(table(rows))
    print(f"wrote {out}")


def table(rows: list[dict]) -> str:
    benches = sorted({r["bench"] for r in rows})
    widths = sorted({r["width"] for r in rows})
    head = "| drafts | " + " | ".join(f"{b} w={w}" for b in benches for w in widths) + " |"
    lines = [head, "|---|" + "---|" * (len(benches) * len(widths))]
    for policy in POLICIES:
        cells = [next((f"{r['tpf']:.2f}" for r in rows if r["bench"] == b and r["width"] == w
                       and r["policy"] == policy), "") for b in benches for w in widths]
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
