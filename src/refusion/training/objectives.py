"""Training objectives as pure tensor operations: ReFusion (hybrid AR + slot diffusion), AR, MDM.

Each objective has a layout builder (Batch -> TrainInputs) and a loss (logits, TrainInputs -> loss).
Nothing here touches a model; the trainer feeds `input_ids`, `position_ids` and `attn_mask` to the
model and hands its logits back to the loss. Layouts are built for the whole batch at once with
sort / gather / where, so they cost a negligible share of a training step (spec, section 3).

Every output column c carries its own label: the loss is plain per-column cross-entropy
CE(logits[b, c], labels[b, c]); any shift (next-token prediction) is already baked into `labels`.

Randomness comes only from the `gen` argument. Draws are made on `gen.device` and then moved to the
batch's device, so a CPU generator gives the same layout whatever device the batch is on.

ReFusion draw order (all batched; R = response_ids.shape[1], S = ceil(R / min(slot_sizes))):
  1. size_idx = torch.randint(len(slot_sizes), (B,), generator=gen)  -> s = slot_sizes[size_idx]
  2. t        = torch.rand(B, generator=gen)                          -> p = (1 - eps) * t + eps
  3. u        = torch.rand(B, S, generator=gen)   slot j of example b is masked iff u[b, j] < p[b]
  4. keys     = torch.rand(B, S, generator=gen)   clean slots are fed in ascending key order
                                                  (ties, which have probability ~0, by slot index)
MDM draw order: t = torch.rand(B), then u = torch.rand(B, R); response token i is masked iff u[b, i] < p[b].
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor

from refusion.model.config import OBJECTIVES

IGNORE = -100


@dataclass
class Batch:
    """prompt_ids [B, P] and response_ids [B, R] right-padded with pad_id; the response includes its EOS."""

    prompt_ids: Tensor
    prompt_len: Tensor
    response_ids: Tensor
    response_len: Tensor
    pad_id: int = 0

    def to(self, device) -> "Batch":
        return Batch(self.prompt_ids.to(device), self.prompt_len.to(device), self.response_ids.to(device),
                     self.response_len.to(device), self.pad_id)


@dataclass
class TrainInputs:
    """What the model is fed and what the loss needs. All [B, T] unless noted.

    attention: None = causal in feed order (plus key padding), "bidirectional" = full over non-pad tokens.
    attn_mask: bool [B, 1, T, T], True = may attend; exactly what the model should get. The diagonal is
    always True so no row (not even a padding row) is all-False, which would make SDPA return NaN.
    mask_rate: [B] float, the mask probability p of each example (1.0 for AR); or [B, T], a p per column,
    where one row holds masks drawn at two rates (joint_layouts.joint_hybrid_inputs).
    slot_size: [B] long for ReFusion (for logging), None otherwise.
    """

    input_ids: Tensor
    position_ids: Tensor
    labels: Tensor
    is_masked: Tensor
    mask_rate: Tensor
    attention: str | None
    attn_mask: Tensor
    pad: Tensor
    slot_size: Tensor | None = None

    def to(self, device) -> "TrainInputs":
        return TrainInputs(**{f.name: (v.to(device) if isinstance(v := getattr(self, f.name), Tensor) else v)
                              for f in fields(self)})


def make_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> Batch:
    """Collate token lists (each response already ending in EOS, or empty) into a right-padded Batch."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    B = len(prompts)
    P = max((len(p) for p in prompts), default=0)
    R = max((len(r) for r in responses), default=0)
    prompt_ids = torch.full((B, P), pad_id, dtype=torch.long)
    response_ids = torch.full((B, R), pad_id, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        prompt_ids[b, :len(p)] = torch.tensor(p, dtype=torch.long)
        response_ids[b, :len(r)] = torch.tensor(r, dtype=torch.long)
    return Batch(prompt_ids, torch.tensor([len(p) for p in prompts], dtype=torch.long),
                 response_ids, torch.tensor([len(r) for r in responses], dtype=torch.long), pad_id)


# ----------------------------------------------------------------------------------------------
# layout helpers


def pad_responses(batch: Batch, eos_id: int, length: int) -> Batch:
    """LLaDA's SFT recipe for MDMs: extend every response to at least `length` tokens with EOS, which
    then count as response tokens (masked, predicted, in the loss). Without it an MDM learns the answer's
    length from the number of masks it is given, which a decoder with a fixed gen_length never gives it."""
    B, R = batch.response_ids.shape
    R2 = max(R, length)
    new_len = batch.response_len.clamp(min=length)
    i = torch.arange(R2, device=batch.response_ids.device)[None, :]
    resp = torch.cat([batch.response_ids, batch.response_ids.new_full((B, R2 - R), batch.pad_id)], 1)
    resp = torch.where((i >= batch.response_len[:, None]) & (i < new_len[:, None]), eos_id, resp)
    return Batch(batch.prompt_ids, batch.prompt_len, resp, new_len, batch.pad_id)


def _pack(batch: Batch, resp_tok: Tensor, resp_pos: Tensor, resp_lab: Tensor, resp_msk: Tensor
          ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Place the prompt, then the response fields [B, R] (already in feed order), then padding.

    Returns input_ids, position_ids, labels, is_masked, pad, all [B, T] with T = max(Lp + Lr).
    Prompt labels are IGNORE; padding continues the positions past Lp + Lr.
    """
    B, P = batch.prompt_ids.shape
    R = batch.response_ids.shape[1]
    dev = batch.prompt_ids.device
    pl, rl = batch.prompt_len[:, None], batch.response_len[:, None]
    T = int((batch.prompt_len + batch.response_len).max()) if B else 0  # the one host sync: T sets shapes
    c = torch.arange(T, device=dev)[None, :]
    in_prompt, end = c < pl, pl + rl
    in_resp, pad = ~in_prompt & (c < end), c >= end

    # one extra pad column on each side so the clamped gather index is valid even when P or R is 0
    def ext(x: Tensor, fill) -> Tensor:
        return torch.cat([x, x.new_full((B, 1), fill)], 1)

    pi = c.clamp(max=P).expand(B, T)
    ri = (c - pl).clamp(0, R)
    p_tok = ext(batch.prompt_ids, batch.pad_id).gather(1, pi)
    input_ids = torch.where(in_prompt, p_tok, torch.where(in_resp, ext(resp_tok, batch.pad_id).gather(1, ri),
                                                          batch.pad_id))
    position_ids = torch.where(in_resp, ext(resp_pos, 0).gather(1, ri), c)  # prompt: c; padding: c >= Lp+Lr
    labels = torch.where(in_resp, ext(resp_lab, IGNORE).gather(1, ri), IGNORE)
    is_masked = in_resp & ext(resp_msk, False).gather(1, ri)
    return input_ids, position_ids, labels, is_masked, pad


def label_prompt_end(labels: Tensor, batch: Batch) -> Tensor:
    """labels with the prompt's last column labelled with the first response token (where both exist)."""
    B = labels.shape[0]
    col = (batch.prompt_len - 1).clamp(min=0)[:, None]
    first = batch.response_ids[:, :1] if batch.response_ids.shape[1] else labels.new_full((B, 1), IGNORE)
    ok = ((batch.prompt_len > 0) & (batch.response_len > 0))[:, None]
    return labels.scatter(1, col, torch.where(ok, first, labels.gather(1, col)))


def causal_attn_mask(pad: Tensor) -> Tensor:
    """[B, 1, T, T]: causal in feed order, padded keys excluded, diagonal always allowed."""
    k = torch.arange(pad.shape[1], device=pad.device)
    m = (k[None, :] <= k[:, None]) & ~pad[:, None, :]  # one [B, T, T] op: this mask is most of the layout's cost
    m.diagonal(dim1=1, dim2=2).fill_(True)
    return m[:, None]


def bidirectional_attn_mask(pad: Tensor) -> Tensor:
    """[B, 1, T, T]: every non-pad key visible to every query, diagonal always allowed."""
    T = pad.shape[1]
    eye = torch.eye(T, dtype=torch.bool, device=pad.device)
    return (~pad[:, None, :] | eye)[:, None]


def _mask_rate(B: int, eps: float, gen: torch.Generator, device) -> Tensor:
    t = torch.rand(B, generator=gen, device=gen.device).to(device)
    return (1 - eps) * t + eps


def _check_eps(eps: float) -> None:
    if not 0.0 <= eps <= 1.0:
        raise ValueError(f"eps must be in [0, 1], got {eps}")


# ----------------------------------------------------------------------------------------------
# layouts


def refusion_inputs(batch: Batch, mask_id: int, gen: torch.Generator, slot_sizes: tuple[int, ...] = (4, 8, 16, 32),
                    eps: float = 1e-3, boundary: bool = False, ar_share: float = 0.0) -> TrainInputs:
    """ReFusion layout (spec, section 3): prompt, clean slots in random order, masked slots in order, padding.

    Draw order: see the module docstring. Every token keeps its original position id.
    boundary: also label a token with the next position's true token wherever that token is not
    visible earlier in feed order (spec section 8): the prompt's last token always; a clean slot's
    last token when the next slot is masked or fed after it.
    ar_share: each example is, with this probability, laid out with no masked slot and its slots in
    order (with boundary labels: plain next-token training). Drawn last, as ar = rand(B) < ar_share,
    so the paper's draws are unchanged.
    """
    slot_sizes = tuple(slot_sizes)
    if not slot_sizes:
        raise ValueError("slot_sizes must not be empty")
    if any(int(s) != s or s <= 0 for s in slot_sizes):
        raise ValueError(f"slot sizes must be positive integers, got {slot_sizes}")
    _check_eps(eps)
    resp = batch.response_ids
    B, R = resp.shape
    dev = resp.device
    S = -(-R // min(slot_sizes))  # most slots any example can have

    size_idx = torch.randint(len(slot_sizes), (B,), generator=gen, device=gen.device).to(dev)
    p = _mask_rate(B, eps, gen, dev)
    u = torch.rand(B, S, generator=gen, device=gen.device).to(dev)
    keys = torch.rand(B, S, generator=gen, device=gen.device).to(dev)
    if ar_share > 0:
        if not boundary:
            raise ValueError("ar_share needs boundary labels: without them an in-order example misses every "
                             "slot's first token")
        as_ar = (torch.rand(B, generator=gen, device=gen.device) < ar_share).to(dev)[:, None]
        u = torch.where(as_ar, 1.0, u)  # u < p never holds: no slot masked
        keys = torch.where(as_ar, torch.arange(S, device=dev, dtype=keys.dtype) / S, keys)  # slots in order

    s = torch.tensor(slot_sizes, dtype=torch.long, device=dev)[size_idx][:, None]  # [B, 1]
    rl = batch.response_len[:, None]
    i = torch.arange(R, device=dev)[None, :]
    valid = i < rl
    slot = i // s  # [B, R], always < S
    slot_masked = u < p[:, None]  # [B, S]
    order = keys.argsort(dim=1, stable=True)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(S, device=dev).expand(B, S))
    tok_masked = slot_masked.gather(1, slot) & valid

    # feed order inside the response as one int64 sort key: clean tokens by (slot rank, index) first,
    # then masked tokens by index, then the response padding
    clean_key = rank.gather(1, slot) * R + i  # slot ranks are distinct, so ranges [r*R, r*R+R) never overlap
    key = torch.where(tok_masked, S * R + i, clean_key)
    key = torch.where(valid, key, (S + 1) * R + i)
    feed = key.argsort(dim=1, stable=True)

    # labels in original order: a clean token predicts the next token of its own slot; a mask its own token
    nxt = torch.cat([resp[:, 1:], resp.new_full((B, 1), IGNORE)], 1)
    same_slot = (i + 1 < rl) & ((i + 1) // s == slot)
    if boundary:  # a clean slot's last token -> the next slot's first, unless that slot was fed before it
        nxt_slot = (slot + 1).clamp(max=S - 1)
        later = slot_masked.gather(1, nxt_slot) | (rank.gather(1, nxt_slot) > rank.gather(1, slot))
        same_slot = same_slot | ((i + 1 < rl) & ~tok_masked & later)
    lab = torch.where(tok_masked, resp, torch.where(same_slot, nxt, IGNORE))
    lab = torch.where(valid, lab, IGNORE)
    tok = torch.where(tok_masked, mask_id, resp)
    pos = batch.prompt_len[:, None] + i

    input_ids, position_ids, labels, is_masked, pad = _pack(
        batch, tok.gather(1, feed), pos.expand(B, R).gather(1, feed), lab.gather(1, feed), tok_masked.gather(1, feed))
    if boundary:  # the prompt's last token -> the first response token (never visible before it)
        labels = label_prompt_end(labels, batch)
    return TrainInputs(input_ids, position_ids, labels, is_masked, p, None, causal_attn_mask(pad), pad,
                       slot_size=s[:, 0])


def ar_inputs(batch: Batch) -> TrainInputs:
    """Plain next-token prediction on the response; the last prompt token predicts the first response token."""
    B, R = batch.response_ids.shape
    dev = batch.response_ids.device
    pos = batch.prompt_len[:, None] + torch.arange(R, device=dev)[None, :]
    no = torch.zeros(B, R, dtype=torch.bool, device=dev)
    input_ids, position_ids, _, _, pad = _pack(batch, batch.response_ids, pos, batch.response_ids, no)
    # column c carries the token at c + 1 when that is a response token
    c = torch.arange(input_ids.shape[1], device=dev)[None, :]
    pl, end = batch.prompt_len[:, None], (batch.prompt_len + batch.response_len)[:, None]
    nxt = torch.cat([input_ids[:, 1:], input_ids.new_full((B, 1), IGNORE)], 1)
    labels = torch.where((c + 1 >= pl) & (c + 1 < end), nxt, IGNORE)
    return TrainInputs(input_ids, position_ids, labels, torch.zeros_like(pad), torch.ones(B, device=dev),
                       None, causal_attn_mask(pad), pad)


def mdm_inputs(batch: Batch, mask_id: int, gen: torch.Generator, eps: float = 1e-3) -> TrainInputs:
    """LLaDA-style masked diffusion: each response token masked with prob p, bidirectional attention."""
    _check_eps(eps)
    resp = batch.response_ids
    B, R = resp.shape
    dev = resp.device
    p = _mask_rate(B, eps, gen, dev)
    u = torch.rand(B, R, generator=gen, device=gen.device).to(dev)
    i = torch.arange(R, device=dev)[None, :]
    masked = (u < p[:, None]) & (i < batch.response_len[:, None])
    tok = torch.where(masked, mask_id, resp)
    lab = torch.where(masked, resp, IGNORE)
    input_ids, position_ids, labels, is_masked, pad = _pack(batch, tok, batch.prompt_len[:, None] + i, lab, masked)
    return TrainInputs(input_ids, position_ids, labels, is_masked, p, "bidirectional",
                       bidirectional_attn_mask(pad), pad)


# ----------------------------------------------------------------------------------------------
# losses. Stats are detached 0-dim tensors (no host sync); call .item() when logging.


def token_ce(logits: Tensor, labels: Tensor) -> Tensor:
    """Per-column cross-entropy [B, T] in float32, exactly 0 where the label is IGNORE."""
    B, T, V = logits.shape
    ce = F.cross_entropy(logits.float().reshape(B * T, V), labels.reshape(B * T), ignore_index=IGNORE,
                         reduction="none")
    return ce.view(B, T)


def soft_ce(logits: Tensor, target: Tensor, valid: Tensor) -> Tensor:
    """Per-column cross-entropy [B, M] in float32 against target distributions [B, M, V] (the base's:
    equal to the KL divergence from them up to their entropy, which no parameter changes); 0 where not
    valid."""
    ce = -(target * logits.float().log_softmax(-1)).sum(-1)
    return torch.where(valid, ce, 0.0)


def ar_term(ce: Tensor, inputs: TrainInputs, n_total: Tensor | None = None) -> tuple[Tensor, Tensor]:
    sel = (inputs.labels != IGNORE) & ~inputs.is_masked
    n = sel.sum()
    # a mean over nothing is 0, not NaN (the reference's all-masked-batch defect)
    return torch.where(sel, ce, 0.0).sum() / (n if n_total is None else n_total).clamp(min=1), n


def mdm_term(ce: Tensor, inputs: TrainInputs, response_len: Tensor, b_total: int | None = None
              ) -> tuple[Tensor, Tensor]:
    sel = inputs.is_masked & (inputs.labels != IGNORE)
    rate = inputs.mask_rate.float()
    if rate.dim() == 1:  # one p per example
        per_example = torch.where(sel, ce, 0.0).sum(1) / rate
    else:  # a p per column (joint_layouts.joint_hybrid_inputs: two kinds of masks in one row)
        per_example = torch.where(sel, ce / rate, 0.0).sum(1)
    # examples with an empty response have no masked tokens: clamp only avoids 0 / 0
    per_example = per_example / response_len.to(ce.device).clamp(min=1)
    return per_example.sum() / (b_total or ce.shape[0]), sel.sum()


def refusion_loss(logits: Tensor, inputs: TrainInputs, response_len: Tensor, n_ar_total: Tensor | None = None,
                  b_total: int | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """AR + MDM. AR: mean CE over clean labelled tokens of the batch (0 if none).
    MDM: (sum over masked tokens of CE / p / Lr) / B.

    n_ar_total / b_total: the AR token count and example count of the whole (global) batch, when this
    is one micro-batch of it, so that summing the micro-batch losses gives the global batch's loss."""
    return loss_from_ce("refusion", token_ce(logits, inputs.labels), inputs, response_len, n_ar_total, b_total)


def ar_loss(logits: Tensor, inputs: TrainInputs, n_ar_total: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Mean next-token CE over labelled tokens (0 if none)."""
    return loss_from_ce("ar", token_ce(logits, inputs.labels), inputs, None, n_ar_total)


def mdm_loss(logits: Tensor, inputs: TrainInputs, response_len: Tensor, b_total: int | None = None
             ) -> tuple[Tensor, dict[str, Tensor]]:
    """LLaDA loss: mean over examples of (sum over masked tokens of CE / p) / Lr (0 if nothing masked)."""
    return loss_from_ce("mdm", token_ce(logits, inputs.labels), inputs, response_len, None, b_total)


def loss_from_ce(name: str, ce: Tensor, inputs: TrainInputs, response_len: Tensor | None,
                 n_ar_total: Tensor | None = None, b_total: int | None = None, mask_weight: float = 1.0
                 ) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss of objective `name` from the per-column cross-entropy ce [B, T] (token_ce) of `inputs`'s
    columns: what packed rows hand back once their columns are back in their examples' own rows
    (training/packing.py), so a packed batch's loss is taken exactly as an unpacked one's.
    mask_weight (refusion only): loss = AR + mask_weight * MDM; the logged mdm_loss is unweighted."""
    _check_name(name)
    if name == "ar":
        loss, n = ar_term(ce, inputs, n_ar_total)
        return loss, dict(loss=loss.detach(), ar_loss=loss.detach(), n_ar_tokens=n)
    if name == "mdm":
        loss, n = mdm_term(ce, inputs, response_len, b_total)
        return loss, dict(loss=loss.detach(), mdm_loss=loss.detach(), n_masked_tokens=n)
    ar, n_ar = ar_term(ce, inputs, n_ar_total)
    mdm, n_m = mdm_term(ce, inputs, response_len, b_total)
    loss = ar + mask_weight * mdm if mask_weight != 1.0 else ar + mdm
    return loss, dict(loss=loss.detach(), ar_loss=ar.detach(), mdm_loss=mdm.detach(), n_ar_tokens=n_ar,
                      n_masked_tokens=n_m)


# ----------------------------------------------------------------------------------------------
# dispatch by name, for the trainer



def _check_name(name: str) -> None:
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; choose one of {', '.join(OBJECTIVES)}")


def build_inputs(name: str, batch: Batch, mask_id: int, gen: torch.Generator, **kw) -> TrainInputs:
    """Layout for objective `name`; kw go to the builder (slot_sizes, eps). AR ignores mask_id and gen."""
    _check_name(name)
    if name == "refusion":
        return refusion_inputs(batch, mask_id, gen, **kw)
    if name == "mdm":
        return mdm_inputs(batch, mask_id, gen, **kw)
    if kw:
        raise ValueError(f"objective 'ar' takes no options, got {sorted(kw)}")
    return ar_inputs(batch)


def ar_token_count(inputs: TrainInputs) -> Tensor:
    """Number of tokens the AR term averages over (clean, labelled): the global normaliser of a batch."""
    return ((inputs.labels != IGNORE) & ~inputs.is_masked).sum()


def compute_loss(name: str, logits: Tensor, inputs: TrainInputs, batch: Batch, n_ar_total: Tensor | None = None,
                 b_total: int | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Loss and detached stats for objective `name` (normalisers: see refusion_loss)."""
    _check_name(name)
    return loss_from_ce(name, token_ce(logits, inputs.labels), inputs, batch.response_len, n_ar_total, b_total)
