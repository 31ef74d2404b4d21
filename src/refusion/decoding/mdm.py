"""Masked-diffusion baselines on the same model and interface (spec section 5).

LLaDA-style: the generation region starts all <|mask|>; it is decoded in semi-autoregressive
blocks; each step predicts every mask and commits a fixed number of the most confident ones in the
current block (low-confidence remasking). Fast-dLLM-style threshold: each step commits every mask
of the block whose confidence exceeds a threshold, at least one.

There is no exact KV cache for the masked region. With `prefix_cache`, the keys and values of the
prompt and the finished blocks are reused (exact for a causal model, approximate for a
bidirectional one, as in Fast-dLLM): at a block's first step only the previous block onwards is
fed, after that only the current block onwards. By default it is on where it is exact (a causal
model: the same tokens for fewer tokens fed) and off otherwise. Attention is bidirectional when the
model was trained with the MDM objective (config `bidirectional`), causal otherwise.

Ties in confidence (common where the softmax saturates at 1) go to the leftmost position: torch's
topk breaks them differently on different CPUs, which made the output depend on the machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from refusion.decoding.common import DecodeResult, left_pad
from refusion.decoding.params import MDMParams, check_prompts
from refusion.decoding.sampling import generator, gumbel_argmax
from refusion.model.transformer import Transformer


def _per_step_counts(n: int, steps: int) -> list[int]:
    """Spread n commits over `steps` steps as evenly as possible, the remainder first (as LLaDA)."""
    base, rem = divmod(n, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


@torch.inference_mode()
def generate_mdm(model: Transformer, prompts: list[list[int]], params: MDMParams | None = None, *,
                 eos_ids: list[int] | None = None, seed: int | None = None,
                 on_commit: Callable[[int, list[int], list[int]], None] | None = None) -> list[DecodeResult]:
    """Masked diffusion for a batch of prompts: fixed-count steps, or the threshold mode when
    params.threshold is set. Sampled rows share one generator seeded with `seed` (0 when None)."""
    p = params or MDMParams()
    cfg = model.config
    if cfg.mask_token_id is None:
        raise ValueError("masked-diffusion decoding needs a model with mask_token_id in its config")
    check_prompts(cfg, prompts, p.gen_length)
    device = model.embed_tokens.weight.device
    eos = sorted(set(eos_ids if eos_ids is not None else cfg.eos_ids))
    eos_t = torch.tensor(eos or [-1], device=device)
    gen = generator(seed if seed is not None else 0, device)
    start = time.perf_counter()
    B, L = len(prompts), p.gen_length
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    ids, pos, valid = left_pad(prompts, pad, device)
    P = ids.shape[1]
    lens = torch.tensor([len(q) for q in prompts], device=device)
    x = torch.cat([ids, torch.full((B, L), cfg.mask_token_id, device=device)], 1)
    positions = torch.cat([pos, lens[:, None] + torch.arange(L, device=device)], 1)
    key_valid = torch.cat([valid, torch.ones(B, L, dtype=torch.bool, device=device)], 1)
    T = P + L
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    attn = key_valid[:, None, None, :] if cfg.bidirectional else key_valid[:, None, None, :] & causal
    attn = attn | torch.eye(T, dtype=torch.bool, device=device)  # [B, 1, T, T]; no empty rows (pads)
    step_of = torch.full((B, L), -1, dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    forwards = torch.zeros(B, dtype=torch.long, device=device)  # counters stay on the device: no sync
    fed = torch.zeros(B, dtype=torch.long, device=device)
    n_blocks = L // p.block_length
    steps_per_block = (p.steps or L) // n_blocks
    prefix_cache = p.prefix_cache if p.prefix_cache is not None else not cfg.bidirectional
    cache = model.new_cache() if prefix_cache else None
    for blk in range(n_blocks):
        lo, hi = P + blk * p.block_length, P + (blk + 1) * p.block_length
        counts = _per_step_counts(p.block_length, steps_per_block)
        i = 0
        while True:
            if p.threshold is None and i >= len(counts):
                break
            masked = (x[:, lo:hi] == cfg.mask_token_id) & ~done[:, None]
            active = masked.any(1)
            if not bool(active.any()):  # the one host sync of a step
                break
            # feed everything, or (prefix cache) only what the cache does not hold: from the previous
            # block on at a block's first step (that block has just been finished), the block on after
            first = 0 if cache is None else len(cache)
            # on a CPU, rows with nothing left to decode in this block (and prompt padding) skip the
            # per-token work (model.forward's `real`): their logits are never read, and the keys and
            # values they would write are either padding (masked) or cropped off below
            real = None
            if device.type == "cpu":
                live = key_valid[:, first:] & active[:, None]
                real = None if bool(live.all()) else live.reshape(-1).nonzero().squeeze(1)
            logits = model(x[:, first:], positions[:, first:], attn_mask=attn[:, :, first:], cache=cache, real=real)
            if cache is not None:
                cache.crop(lo)  # keep the prompt and the finished blocks only
            logits = logits[:, lo - first: hi - first].float()
            logits[..., cfg.mask_token_id] = float("-inf")  # committing <|mask|> would never end
            fed += (T - first) * active
            forwards += active
            if p.temperature > 0:
                x0 = gumbel_argmax(logits, p.temperature, gen)
            else:
                x0 = logits.argmax(-1)
            conf = logits.softmax(-1).gather(-1, x0[..., None]).squeeze(-1)
            conf = conf.masked_fill(~masked, -1.0)
            if p.threshold is None:
                k = counts[i]
                top = conf.sort(dim=1, descending=True, stable=True).indices[:, :k]  # ties: leftmost
                pick = torch.zeros_like(masked).scatter(1, top, True) & masked
            else:
                best = torch.zeros_like(masked).scatter(1, conf.argmax(1, keepdim=True), True)
                pick = ((conf > p.threshold) | best) & masked
            x[:, lo:hi] = torch.where(pick, x0, x[:, lo:hi])
            # a token's step is its own sequence's forward count, so it does not depend on the batch
            own_step = (forwards - 1)[:, None].expand_as(pick)
            step_of[:, lo - P: hi - P][pick] = own_step[pick]
            if on_commit is not None:
                for r in range(B):
                    cols = pick[r].nonzero().squeeze(-1) + (lo - P)
                    if cols.numel():
                        on_commit(r, (lens[r] + cols).tolist(), x[r, P + cols].tolist())
            i += 1
        # a finished block that holds an EOS ends that sequence (everything after is padding)
        block_eos = torch.isin(x[:, lo:hi], eos_t).any(1)
        done |= block_eos
        if bool(done.all()):
            break
    out, steps_h, forwards_h, fed_h = x[:, P:].tolist(), step_of.tolist(), forwards.tolist(), fed.tolist()
    seconds = time.perf_counter() - start  # after the transfer, which waits for the device
    results = []
    for r, q in enumerate(prompts):
        toks = out[r]
        cut = next((j + 1 for j, t in enumerate(toks) if t in eos), None)
        n = cut if cut is not None else len([t for t in toks if t != cfg.mask_token_id])
        res = DecodeResult(prompt=list(q), tokens=toks[:n], positions=[len(q) + j for j in range(n)],
                           steps=steps_h[r][:n], forwards=forwards_h[r], tokens_fed=fed_h[r],
                           seconds=seconds, finished=cut is not None)
        results.append(res)
    return results
