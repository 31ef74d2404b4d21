"""Training a mask sampler (model/mask_sampler.py) for a model whose masks already draft.

The model is frozen, so what the sampler learns from can be computed once: for each example, at
`cuts` random points of its response, a block of `block` masks behind that prefix (the block
`speculative` feeds), and for masks 1 .. block-1 their final normed state, their `candidates` most
likely tokens, the true token and the true token before it. Those features go to OUT/features.pt
(written again every SAVE_EVERY examples, so a cut run resumes where it stopped). The sampler then
trains on them in seconds to minutes: cross-entropy over each mask's candidates (masks whose token
is not among them teach nothing), given the true previous token, which is what the chain sees
wherever its draft still holds. A tenth of the examples is held out; the sampler kept is the one
whose held-out chain, the masks' drafts accepted in a row, was longest at a check (every
`check_every` steps): the state inputs make it easy to fit the training answers too closely.
"""

from __future__ import annotations

import io
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from refusion.files import write_bytes
from refusion.model.cache import KVCache
from refusion.model.mask_sampler import MaskSampler
from refusion.model.transformer import Transformer
from refusion.runtime import malloc_trim
from refusion.training.data import Example

SAVE_EVERY = 100  # examples between saves of the features while they are computed
CUTS_PER_FORWARD = 64  # blocks of masks one forward computes


@dataclass
class SamplerTraining:
    cuts: int = 16  # prefixes per example whose masks are kept
    block: int = 9  # masks per block: the first sits at the verified token, the rest are chained
    candidates: int = 16
    width: int = 256
    dropout: float = 0.5
    steps: int = 3000
    batch_size: int = 1024
    lr: float = 1e-3
    check_every: int = 250
    held_out: float = 0.1  # share of examples whose chains pick the sampler kept
    seed: int = 0


@torch.inference_mode()
def example_features(model: Transformer, ex: Example, cuts: list[int], block: int, candidates: int
                     ) -> dict[str, Tensor]:
    """One example's features at the given cuts (response indices: the masks see the prompt and
    response[:cut]); offsets 1 .. block-1 of each block."""
    prompt, answer = ex.prompt, ex.response
    P = len(prompt)
    ids = torch.tensor([prompt + answer])
    T = ids.shape[1]
    cache = KVCache(model.config.num_layers)
    model(ids, torch.arange(T)[None], cache=cache, num_logits=1)
    mask_id = model.config.mask_token_id
    j = torch.arange(block)
    states, cand = [], []
    for lo in range(0, len(cuts), CUTS_PER_FORWARD):
        c = torch.tensor(cuts[lo:lo + CUTS_PER_FORWARD])
        n = len(c)
        blk, jj = c.repeat_interleave(block), j.repeat(n)
        seen = torch.arange(T)[None, :] < (P + blk)[:, None]
        own = (blk[:, None] == blk[None, :]) & (jj[None, :] <= jj[:, None])
        logits, h = model(torch.full((1, n * block), mask_id), (P + blk + jj)[None], torch.cat([seen, own], 1)[None, None],
                          cache=cache, states=True)
        cache.length = T  # the masks' entries go: the next chunk sees the example alone
        states.append(h[0].view(n, block, -1)[:, 1:].to(torch.bfloat16))
        cand.append(logits[0].topk(candidates, -1).indices.view(n, block, -1)[:, 1:])
    at = torch.tensor(cuts)[:, None] + torch.arange(1, block)[None, :]  # response index each mask predicts
    full = torch.tensor(prompt + answer + [-1] * block)
    return dict(states=torch.cat(states), candidates=torch.cat(cand), truth=full[P + at], prev=full[P + at - 1])


def sampler_features(model: Transformer, examples: list[Example], cfg: SamplerTraining, path: Path,
                     progress: bool = True) -> dict[str, Tensor]:
    """Every example's features (stacked, with `example`: which one each row is from), computed where
    `path` does not hold them already and saved there as they grow."""
    done: dict = torch.load(path, weights_only=True) if path.is_file() else {}
    if done and (done.get("config") != _feature_key(cfg, len(examples))):
        raise ValueError(f"{path} holds features of another setting ({done.get('config')}); delete it to start "
                         "afresh")
    parts = done.get("parts", [])
    rng = random.Random(cfg.seed)
    cut_lists = [sorted(rng.sample(range(len(e.response) - 1), min(cfg.cuts, len(e.response) - 1)))
                 if len(e.response) > 2 else [] for e in examples]
    # every example's forward allocates buffers of its own length; the allocator's heap, fragmented by
    # them, grew by megabytes an example until its freed memory went back after each one
    trim = malloc_trim()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(examples), initial=len(parts), desc="sampler features", unit="example", file=sys.stderr)
    for i in range(len(parts), len(examples)):
        parts.append(example_features(model, examples[i], cut_lists[i], cfg.block, cfg.candidates)
                     if cut_lists[i] else None)
        if trim is not None:
            trim(0)
        if bar is not None:
            bar.update(1)
        if (i + 1) % SAVE_EVERY == 0 or i + 1 == len(examples):
            _save(path, {"config": _feature_key(cfg, len(examples)), "parts": parts})
    if bar is not None:
        bar.close()
    keep = [(i, p) for i, p in enumerate(parts) if p is not None]
    if not keep:
        raise ValueError("no example has a response of 3 tokens or more: nothing to train a sampler on")
    out = {k: torch.cat([p[k] for _, p in keep]) for k in keep[0][1]}
    out["example"] = torch.cat([torch.full((len(p["truth"]),), i) for i, p in keep])
    return out


def _feature_key(cfg: SamplerTraining, n: int) -> dict:
    return dict(cuts=cfg.cuts, block=cfg.block, candidates=cfg.candidates, seed=cfg.seed, examples=n)


def _save(path: Path, obj: dict) -> None:
    buf = io.BytesIO()  # (torch.save to a file reports a full disk as a RuntimeError without its cause)
    torch.save(obj, buf)
    write_bytes(path, buf.getvalue())


def chain_lengths(sampler: MaskSampler | None, model: Transformer, f: dict[str, Tensor]) -> Tensor:
    """Per block, how many masks in a row draft their true token, each chosen given the true token
    before it (the sampler's choice, or with None the mask's argmax)."""
    with torch.no_grad():
        N, J, K = f["candidates"].shape
        cand = f["candidates"]
        if sampler is None:
            pick = cand[:, :, 0]
        else:
            sampler.eval()
            h = f["states"].reshape(N * J, -1).float()
            scores = sampler(h, model.embed_tokens.weight[f["prev"].clamp(min=0).reshape(-1)],
                             model.lm_head.weight[cand.reshape(N * J, K)])
            pick = cand.reshape(N * J, K).gather(1, scores.argmax(1, keepdim=True)).view(N, J)
        ok = (pick == f["truth"]) & (f["truth"] >= 0)
        return ok.long().cumprod(1).sum(1)


def train_sampler(model: Transformer, f: dict[str, Tensor], cfg: SamplerTraining, progress: bool = True
                  ) -> tuple[MaskSampler, dict]:
    """The sampler trained on features f (sampler_features), the one with the longest held-out chains
    at a check; and a record of the run (mean held-out chain of the argmax and at each check)."""
    torch.manual_seed(cfg.seed)
    examples = f["example"].unique()
    if len(examples) < 2:
        raise ValueError("a sampler needs at least 2 examples with answers of 3 tokens or more (one is held out)")
    held = examples[torch.randperm(len(examples), generator=torch.Generator().manual_seed(cfg.seed))[
        :max(1, round(cfg.held_out * len(examples)))]]
    is_held = torch.isin(f["example"], held)
    train = {k: v[~is_held] for k, v in f.items()}
    val = {k: v[is_held] for k, v in f.items()}
    N, J, K = train["candidates"].shape
    h = train["states"].reshape(N * J, -1)
    cand, truth, prev = train["candidates"].reshape(N * J, K), train["truth"].reshape(-1), train["prev"].reshape(-1)
    hit = cand == truth[:, None]
    rows = (hit.any(1) & (truth >= 0)).nonzero().squeeze(1)
    target = hit.float().argmax(1)
    sampler = MaskSampler(model.config.hidden_size, cfg.width, cfg.candidates, cfg.dropout)
    opt = torch.optim.AdamW(sampler.parameters(), lr=cfg.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed)
    emb, head = model.embed_tokens.weight.detach(), model.lm_head.weight.detach()
    argmax_chain = float(chain_lengths(None, model, val).float().mean())
    best = (argmax_chain, 0, {k: v.clone() for k, v in sampler.state_dict().items()})
    checks = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, desc="sampler", unit="step", file=sys.stderr)
    start = time.perf_counter()
    # (no mask of the training examples has its token among its candidates: nothing to learn, and the
    # sampler stays the argmax; the record says so)
    for step in range(1, cfg.steps + 1 if len(rows) else 1):
        sampler.train()
        idx = rows[torch.randint(len(rows), (cfg.batch_size,), generator=gen)]
        scores = sampler(h[idx].float(), emb[prev[idx].clamp(min=0)], head[cand[idx]])
        loss = F.cross_entropy(scores, target[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % cfg.check_every == 0 or step == cfg.steps:
            chain = float(chain_lengths(sampler, model, val).float().mean())
            checks.append(dict(step=step, loss=loss.item(), held_out_chain=chain))
            if chain > best[0]:
                best = (chain, step, {k: v.clone() for k, v in sampler.state_dict().items()})
            if bar is not None:
                bar.set_postfix(loss=f"{loss.item():.3f}", chain=f"{chain:.3f}", best=f"{best[0]:.3f}")
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    sampler.load_state_dict(best[2])
    record = dict(config=asdict(cfg), train_rows=int(len(rows)), held_out_blocks=int(len(val["truth"])),
                  argmax_chain=argmax_chain, best_chain=best[0], best_step=best[1], checks=checks,
                  seconds=time.perf_counter() - start)
    return sampler.eval(), record
