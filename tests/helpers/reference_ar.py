"""The reference AR decoder: the simple, obviously correct loop (a KVCache, one token per forward,
batched with left padding) that `decode(..., "ar")` (the speculative batch with no drafts,
refusion.decoding.speculative.generate_ar) must equal token for token and counter for counter
(tests/decoding/test_ar_reference.py), and that the tests of the other decoders compare their
outputs with. It was refusion.decoding.ar until the two AR implementations became one."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from refusion.decoding.common import DecodeResult, left_pad
from refusion.decoding.params import ARParams, check_prompts, check_seed
from refusion.decoding.sampling import draw, position_uniforms, sampling_probs
from refusion.model.transformer import Transformer


@torch.inference_mode()
def generate_ar(model: Transformer, prompts: list[list[int]], params: ARParams | None = None, *,
                eos_ids: list[int] | None = None, seed: int | None = None,
                on_commit: Callable[[int, list[int], list[int]], None] | None = None) -> list[DecodeResult]:
    """Decode every prompt left to right, one token per forward pass, batched.

    first_from_mask: take the first response token from a <|mask|> fed at its position (the
    ReFusion objective never trains the prompt's last token to predict it; see the spec, section 5).
    Default: on when the model has a mask token, unless its config says the causal path was trained
    to predict the first token (causal_first_token). A sampled row's token at response position t
    is drawn with the uniform of (seed, t) (sampling.position_uniforms), so a row's output does
    not depend on the batch and equals `speculative`'s with the same seed; every row uses `seed`,
    or, when None, a seed of its own from torch's global generator. on_commit(row, [position],
    [token]) for every token (streaming).
    """
    p = params or ARParams()
    gen_length, temperature, top_k, top_p = p.gen_length, p.temperature, p.top_k, p.top_p
    first_from_mask = p.first_from_mask
    cfg = model.config
    check_prompts(cfg, prompts, gen_length)
    device = model.embed_tokens.weight.device
    eos = set(eos_ids if eos_ids is not None else cfg.eos_ids)
    mask_id = cfg.mask_token_id
    if first_from_mask is None:
        first_from_mask = mask_id is not None and not cfg.causal_first_token
    if first_from_mask and mask_id is None:
        raise ValueError("first_from_mask needs a model with mask_token_id in its config")
    check_seed(seed)
    start = time.perf_counter()
    B = len(prompts)
    if temperature > 0:
        seeds = (torch.full((B,), seed) if seed is not None else torch.randint(0, 2**63 - 1, (B,))).to(device)
        temp_t = torch.full((B,), float(temperature), device=device)
        top_k_t = torch.full((B,), top_k or 0, device=device)
        top_p_t = torch.full((B,), float(top_p or 1.0), device=device)
        filtered = top_k is not None or top_p is not None
        response_pos = torch.arange(gen_length, device=device)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    ids, pos, valid = left_pad(prompts, pad, device)
    lens = torch.tensor([len(p) for p in prompts], device=device)
    results = [DecodeResult(prompt=list(p)) for p in prompts]
    eos_t = torch.tensor(sorted(eos) or [-1], device=device)

    cache = model.new_cache()
    P = ids.shape[1]
    # Prefill: causal over the prompt, padded keys hidden (the diagonal stays visible so no row is empty).
    feed_ids, feed_pos, key_valid = ids, pos, valid
    if first_from_mask:
        feed_ids = torch.cat([ids, torch.full((B, 1), mask_id, device=device)], 1)
        feed_pos = torch.cat([pos, lens[:, None]], 1)
        key_valid = torch.cat([valid, torch.ones(B, 1, dtype=torch.bool, device=device)], 1)
    T = feed_ids.shape[1]
    mask = torch.ones(T, T, dtype=torch.bool, device=device).tril() & key_valid[:, None, None, :]
    mask |= torch.eye(T, dtype=torch.bool, device=device)
    # On a CPU, where a forward costs in proportion to the tokens it computes, padding and finished
    # rows are left out of the per-token work (model.forward's `real`); their outputs are never read.
    pack = device.type == "cpu"
    real = key_valid.reshape(-1).nonzero().squeeze(1) if pack and not bool(key_valid.all()) else None
    logits = model(feed_ids, feed_pos, attn_mask=mask, cache=cache, num_logits=1, real=real)[:, -1]
    if first_from_mask:
        cache.crop(P)  # the mask's keys and values are not part of the sequence
    fed = [len(p) + int(first_from_mask) for p in prompts]

    done = torch.zeros(B, dtype=torch.bool, device=device)
    out = torch.empty(B, gen_length, dtype=torch.long, device=device)
    keys_valid = torch.cat([valid, torch.ones(B, gen_length, dtype=torch.bool, device=device)], 1)
    n_steps = 0
    for step in range(gen_length):
        if temperature > 0:
            probs = sampling_probs(logits.float()[:, None], temp_t, top_k_t, top_p_t, filtered)[:, 0]
            tok = draw(probs, position_uniforms(seeds, response_pos[step].expand(B)))
        else:
            tok = logits.argmax(-1)
        tok = torch.where(done, torch.full_like(tok, pad), tok)
        out[:, step] = tok
        n_steps = step + 1
        if on_commit is not None:  # streaming only: one transfer for the whole batch
            for r, (t, d) in enumerate(zip(tok.tolist(), done.tolist(), strict=True)):
                if not d:
                    on_commit(r, [len(prompts[r]) + step], [t])
        done |= torch.isin(tok, eos_t)
        if step + 1 == gen_length or bool(done.all()):
            break
        real = (~done).nonzero().squeeze(1) if pack and bool(done.any()) else None
        logits = model(tok[:, None], (lens + step)[:, None], attn_mask=keys_valid[:, None, None, :P + step + 1],
                       cache=cache, real=real)[:, -1]

    # Host-side bookkeeping once at the end, not per step.
    out = out[:, :n_steps].tolist()
    seconds = time.perf_counter() - start  # after the transfer, which waits for the device
    for r, res in enumerate(results):
        toks = out[r]
        cut = next((i + 1 for i, t in enumerate(toks) if t in eos), len(toks))
        res.tokens = toks[:cut]
        res.finished = bool(res.tokens) and res.tokens[-1] in eos
        res.positions = [len(prompts[r]) + i for i in range(cut)]
        res.steps = list(range(cut))
        # prefill + one pass per token after the first, while this row was still running
        res.forwards = 1 + max(cut - 1, 0)
        res.tokens_fed = fed[r] + max(cut - 1, 0)
        res.seconds = seconds
    return results
