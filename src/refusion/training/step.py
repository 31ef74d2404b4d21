"""One optimizer step of a run, on one global batch (the same examples whatever the number of processes).

The objective's layout is built for the whole global batch from the run's one layout generator;
each process takes its rows and splits them into micro-batches (gradient accumulation). Losses are
normalised by the global batch's counts, so N processes x M micro-batches compute the same loss
and gradient as one process with the whole batch.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import Tensor

from refusion.model.cache import KVCache
from refusion.model.mask_adapter import adapted_from, is_adapter_name
from refusion.training.joint_layouts import (DraftMasks, base_distribution, draft_inputs, draft_masks,
                                            hybrid_inputs, joint_hybrid_inputs)
from refusion.training.mask_features import feature_batch, feature_loss, offset_accuracy, offset_hits
from refusion.training.objectives import (Batch, TrainInputs, ar_inputs, ar_term, ar_token_count, build_inputs,
                                         loss_from_ce, make_batch, pad_responses, soft_ce, token_ce)
from refusion.training.optimizer import lr_at
from refusion.training.packing import pack
from refusion.training.setup import Run
from refusion.training.variants import variant_of


def train_step(run: Run) -> dict[str, float]:
    """Take step `run.step` and return its metrics (losses, lr, grad_norm, tokens: the global batch's)."""
    cfg = run.cfg
    idx = run.order(run.step)
    for g in run.optimizer.param_groups:
        g["lr"] = lr_at(run.step, cfg)
    if run.features is not None:  # mask-only on cached features: the adapted blocks alone
        totals, tokens, acc = _feature_backward(run, idx)
        return _finish(run, totals, tokens, layout_s=0.0, split=False, extra=acc)
    batch = _global_batch(run, idx)
    variant = variant_of(cfg)
    mask_id = run.model.config.mask_token_id
    mask_id = mask_id if mask_id is not None else -1
    t0 = time.perf_counter()
    drafts = None  # decoupled: the mask pass's layout, beside the ARM's
    if cfg.objective == "refusion" and variant.name in ("decoupled", "mask-only"):
        inputs, drafts = ar_inputs(batch), draft_masks(batch, mask_id, run.layout_gen, tuple(cfg.slot_sizes))
    elif cfg.objective == "refusion" and variant.drafts:
        inputs = draft_inputs(batch, mask_id, run.layout_gen, tuple(cfg.slot_sizes))
    elif cfg.objective == "refusion" and variant.name == "hybrid":
        inputs = hybrid_inputs(batch, mask_id, run.layout_gen, tuple(cfg.slot_sizes), cfg.eps)
    elif cfg.objective == "refusion" and variant.name == "joint-hybrid":
        inputs = joint_hybrid_inputs(batch, mask_id, run.layout_gen, tuple(cfg.slot_sizes), cfg.eps)
    else:
        kw = {} if cfg.objective == "ar" else {"eps": cfg.eps}
        if cfg.objective == "refusion":
            kw.update(slot_sizes=tuple(cfg.slot_sizes))
            if variant.boundary:
                kw.update(boundary=True, ar_share=variant.ar_share)
        inputs = build_inputs(cfg.objective, batch, mask_id, run.layout_gen, **kw)
    layout_s = time.perf_counter() - t0
    n_ar, B = ar_token_count(inputs), len(idx)
    if variant.name == "mask-only":
        totals, tokens = _mask_only_backward(run, inputs, drafts, batch, n_ar, B)
        return _finish(run, totals, tokens, layout_s, split=False, extra=offset_accuracy(totals))
    totals, tokens = _backward(run, inputs, batch, n_ar, B, drafts)
    return _finish(run, totals, tokens, layout_s, split=drafts is not None)


def _finish(run: Run, totals: dict[str, Tensor], tokens: int, layout_s: float, split: bool,
            extra: dict[str, float] | None = None) -> dict[str, float]:
    """The optimizer step after the backward passes, and the step's record (the global batch's losses)."""
    cfg = run.cfg
    grad_norm = _optimizer_step(run, split=split)
    run.step += 1
    out = {k: v.float() for k, v in totals.items() if "loss" in k}
    if run.world > 1:  # the global batch's loss is the sum of the processes' parts
        vec = torch.stack([out[k] for k in sorted(out)] + [torch.tensor(float(tokens))]).to(run.device)
        dist.all_reduce(vec)
        out = dict(zip(sorted(out), vec[:-1]))
        tokens = int(vec[-1])
    rec = {k: float(v) for k, v in out.items()}
    rec.update(step=run.step, lr=lr_at(run.step - 1, cfg), grad_norm=float(grad_norm), tokens=tokens,
               layout_s=layout_s, **(extra or {}))
    return rec


def _feature_backward(run: Run, idx: list[int]) -> tuple[dict[str, Tensor], int, dict[str, float]]:
    """feature_cache: each example of the batch with one of its phases (drawn from the layout
    generator), in micro-batches through the adapted blocks; the summed statistics, the number of
    masks, and the share of masks at block offsets 0..3 and 4+ that predicted their token."""
    cfg, model = run.cfg, run.model
    first = adapted_from(model.config)
    rows = torch.randint(cfg.feature_phases, (len(idx),), generator=run.layout_gen).tolist()
    dtype = model.embed_tokens.weight.dtype
    totals: dict[str, Tensor] = {}
    for lo in range(0, len(idx), run.micro):
        draws = list(zip(idx[lo:lo + run.micro], rows[lo:lo + run.micro]))
        fb = feature_batch(run.features, draws, max(cfg.slot_sizes), first, dtype).to(run.device)
        loss, stats = feature_loss(model, fb, len(idx))
        loss.backward()
        for key, v in stats.items():
            totals[key] = totals.get(key, 0) + v
    return totals, int(totals["n_masked_tokens"]), offset_accuracy(totals)


def _global_batch(run: Run, idx: list[int]) -> Batch:
    pad_id = run.tokenizer.pad_id if run.tokenizer.pad_id is not None else 0
    batch = make_batch([run.examples[i].prompt for i in idx], [run.examples[i].response for i in idx], pad_id)
    if run.cfg.objective == "mdm" and run.cfg.mdm_eos_pad_to:
        batch = pad_responses(batch, run.model.config.eos_ids[0], run.cfg.mdm_eos_pad_to)
    return batch


def _backward(run: Run, inputs: TrainInputs, batch: Batch, n_ar: Tensor, B: int, drafts: DraftMasks | None = None
              ) -> tuple[dict[str, Tensor], int]:
    """Forward and backward of this process's rows, in micro-batches; the summed loss statistics and
    the number of real tokens. drafts (the decoupled variant): a second pass over this layout trains
    the mask path alone (_mask_pass)."""
    cfg, model = run.cfg, run.ddp or run.model
    per_rank = B // run.world
    starts = range(run.rank * per_rank, (run.rank + 1) * per_rank, run.micro)
    totals: dict[str, Tensor] = {}
    tokens = 0
    # FSDP's bf16 is its mixed precision policy (refusion.training.fsdp), not autocast
    autocast = (torch.autocast(run.device.type, dtype=torch.bfloat16) if cfg.dtype == "bfloat16" and not run.fsdp
                else nullcontext())
    for k, lo in enumerate(starts):
        sub = _rows(inputs, lo, lo + run.micro)
        # pack: the micro-batch's examples side by side in rows (training/packing.py), fed instead of sub
        packed = pack(sub, batch.pad_id).to(run.device) if cfg.pack else None
        sub = sub.to(run.device)
        fed = sub if packed is None else packed.inputs
        sub_batch = _batch_rows(batch, lo, lo + run.micro).to(run.device)
        tokens += int((~sub.pad).sum())
        last = k == len(starts) - 1
        # DDP reduces once, after the last micro-batch. FSDP reduce-scatters after every one:
        # its gradients then stay sharded between micro-batches instead of whole on every process
        sync = nullcontext() if (run.ddp is None or last) else run.ddp.no_sync()
        with sync:
            with autocast:
                # causal objectives: padding is at the end, so plain causal attention is exact there
                mask = None if fed.attention is None else fed.attn_mask
                logits = model(fed.input_ids, fed.position_ids, mask)
            ce = token_ce(logits, fed.labels)
            if packed is not None:  # the loss is taken on the examples' own rows, as unpacked
                ce = packed.unpack(ce)
            # the decoupled variant's first pass is exactly the ARM's step
            objective = "ar" if drafts is not None else cfg.objective
            loss, stats = loss_from_ce(objective, ce, sub, sub_batch.response_len, n_ar.to(run.device), B,
                                       cfg.mask_loss_weight)
            # DDP and FSDP average gradients over processes; the global loss is their sum
            (loss * run.world).backward()
            if drafts is not None:
                stats.update(_mask_pass(run, sub, drafts.rows(lo, lo + run.micro).to(run.device), sub_batch, B,
                                        autocast))
                stats["loss"] = stats["loss"] + stats["mdm_loss"]
        for key, v in stats.items():
            totals[key] = totals.get(key, 0) + v
    return totals, tokens


def _mask_only_backward(run: Run, inputs: TrainInputs, masks: DraftMasks, batch: Batch, n_ar: Tensor, B: int
                        ) -> tuple[dict[str, Tensor], int]:
    """The mask-only variant, per micro-batch: the in-order example runs on the frozen model without a
    graph, into a cache (with mask_target "distribution" its logits too, and their next-token loss, the
    base's, is logged as ar_loss); the masks run on top of it
    and their loss trains the mask path, the only parameters that require gradients. Each mask's
    target is its token, or with mask_target "distribution" the base's next-token distribution at its
    position, read from the in-order pass's logits (no forward added)."""
    cfg, model = run.cfg, run.model
    autocast = torch.autocast(run.device.type, dtype=torch.bfloat16) if cfg.dtype == "bfloat16" else nullcontext()
    totals: dict[str, Tensor] = {}
    tokens = 0
    for lo in range(0, B, run.micro):
        clean = _rows(inputs, lo, lo + run.micro).to(run.device)
        sub_masks = masks.rows(lo, lo + run.micro).to(run.device)
        sub_batch = _batch_rows(batch, lo, lo + run.micro).to(run.device)
        tokens += int((~clean.pad).sum()) + int(sub_masks.valid.sum())
        cache = KVCache(model.config.num_layers)
        base = None
        with torch.no_grad(), autocast:
            if cfg.mask_target == "distribution":
                logits = model(clean.input_ids, clean.position_ids, None, cache=cache)
                ar, n_ar_sub = ar_term(token_ce(logits, clean.labels), clean, n_ar.to(run.device))
                base = base_distribution(logits, sub_batch.prompt_len.to(run.device), sub_masks.valid)
                del logits
            else:  # only the cache is needed: the LM head on every clean row would cost about a tenth of the step
                model(clean.input_ids, clean.position_ids, None, cache=cache, num_logits=1)
        with autocast:
            logits = model(sub_masks.input_ids, sub_masks.position_ids, sub_masks.attn_mask(len(cache)), cache=cache)
        ce = token_ce(logits, sub_masks.labels) if base is None else soft_ce(logits, base, sub_masks.valid)
        mdm = (ce.sum(1) / sub_batch.response_len.to(ce.device).clamp(min=1)).sum() / B
        mdm.backward()
        stats = dict(loss=mdm.detach(), mdm_loss=mdm.detach(), n_masked_tokens=sub_masks.valid.sum())
        if base is not None:  # (the base's own next-token loss, logged where its logits were computed anyway)
            stats.update(ar_loss=ar, n_ar_tokens=n_ar_sub)
        valid = sub_masks.valid
        offset = torch.arange(valid.shape[1], device=valid.device)[None, :] - sub_masks.block
        # (the argmax before selecting rows: logits[valid] would copy every mask's vocabulary-wide row)
        stats.update(offset_hits(logits.detach().argmax(-1)[valid], sub_masks.labels[valid], offset[valid]))
        for key, v in stats.items():
            totals[key] = totals.get(key, 0) + v
    return totals, tokens


def _mask_pass(run: Run, clean: TrainInputs, masks: DraftMasks, batch: Batch, B: int, autocast) -> dict[str, Tensor]:
    """The decoupled variant's second pass, which trains the mask path alone: the clean tokens (the
    ARM's example) run once without a graph into a cache, the masks run on top of it, and their loss
    (the mean over examples of each one's mean mask CE) back-propagates into the mask path's
    parameters only (backward(inputs=...)): the shared weights, and the clean keys and values, act as
    constants, so the shared weights keep exactly the ARM's gradient."""
    cache = KVCache(run.model.config.num_layers)
    with torch.no_grad(), autocast:
        run.model(clean.input_ids, clean.position_ids, None, cache=cache)
    with autocast:
        logits = run.model(masks.input_ids, masks.position_ids, masks.attn_mask(len(cache)), cache=cache)
    ce = token_ce(logits, masks.labels)
    mdm = (ce.sum(1) / batch.response_len.to(ce.device).clamp(min=1)).sum() / B
    own = [p for name, p in run.model.named_parameters() if is_adapter_name(name)]
    mdm.backward(inputs=own)
    return {"mdm_loss": mdm.detach(), "n_masked_tokens": masks.valid.sum()}


def _optimizer_step(run: Run, split: bool = False) -> Tensor:
    """Clip, step, clear the gradients; the gradient norm before clipping (0 with clipping off).
    split (decoupled): the shared weights and the mask path are clipped each by its own norm, so the
    shared weights' update is the ARM's; the shared weights' norm is returned."""
    named = [(n, p) for n, p in run.model.named_parameters() if p.requires_grad]
    groups = ([[p for n, p in named if not is_adapter_name(n)], [p for n, p in named if is_adapter_name(n)]]
              if split else [[p for _, p in named]])
    if run.cfg.grad_clip <= 0:
        grad_norm = torch.tensor(0.0)
    elif run.fsdp:
        from refusion.training.fsdp import clip_grad_norm

        grad_norm = clip_grad_norm(groups[0], run.cfg.grad_clip)
    else:
        grad_norm = [torch.nn.utils.clip_grad_norm_(g, run.cfg.grad_clip) for g in groups if g][0]
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    return grad_norm


def _rows(inputs: TrainInputs, lo: int, hi: int) -> TrainInputs:
    """Rows lo:hi, with the columns cut to the longest of them (padding is always at the end)."""
    T = int((~inputs.pad[lo:hi]).sum(1).max())
    sub = {}
    for f in dataclasses.fields(inputs):
        v = getattr(inputs, f.name)
        if isinstance(v, Tensor) and v.ndim >= 2:
            v = v[lo:hi, ..., :T, :T] if f.name == "attn_mask" else v[lo:hi, :T]
        elif isinstance(v, Tensor):
            v = v[lo:hi]
        sub[f.name] = v
    return TrainInputs(**sub)


def _batch_rows(batch: Batch, lo: int, hi: int) -> Batch:
    return dataclasses.replace(batch, prompt_ids=batch.prompt_ids[lo:hi], prompt_len=batch.prompt_len[lo:hi],
                               response_ids=batch.response_ids[lo:hi], response_len=batch.response_len[lo:hi])
