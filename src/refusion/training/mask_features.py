"""Training a mask path on features computed once: the mask-only variant's `feature_cache`.

With the adapters on the top blocks only (`mask_adapter.layers`) and the mask embedding frozen,
nothing below the first adapted block depends on what training changes. Every clean token's keys
and values are the base's in every block (the adapters act on mask rows alone), and a mask's state
entering the first adapted block is what the base computes for the frozen mask embedding, given the
clean prefix it sees and the masks of its block before it. So each example runs once, before the
first step:

- its clean tokens (prompt, response) through every block, keeping the adapted blocks' keys and
  values;
- its response as masks, in blocks of S = max(slot_sizes) at `feature_phases` phases (cut points
  at phase, phase + S, phase + 2S, ... of the response), through the blocks below the adapted
  ones, keeping each mask's state.

A step then runs the adapted blocks and the LM head only, on draws of (example, phase): on
SmolLM2 with 4 of 30 blocks adapted, a small share of the full mask-only pass, which also runs the
clean tokens and back-propagates through every block. Mask i of a block sees the prompt, the
response before its block, and its block's masks up to itself, as in the draft layout
(joint_layouts.draft_masks) with L = S. Attention inside a block is causal, so a block's first j
masks compute exactly what a j-mask block computes: S-blocks train every draft width up to S.

The features of a run are kept in OUT/features (safetensors shards, bfloat16: written once,
atomically, and reused by a resumed run).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from refusion.files import atomic
from refusion.model.mask_adapter import adapted_from
from refusion.model.transformer import Transformer, linear, rms_norm
from refusion.training.data import Example
from refusion.training.objectives import IGNORE

SHARD = 64  # examples per features file
FEATURE_DTYPE = torch.bfloat16  # halves the files and the memory; the steps compute in the model's dtype


class PrefixCache:
    """A Cache over fixed keys and values per layer ([B, kv_heads, keys, head_dim]): a forward attends
    to them and to its own tokens, and stores nothing (every draw reuses the same prefix)."""

    def __init__(self, k: dict[int, Tensor], v: dict[int, Tensor]) -> None:
        self.k, self.v = k, v

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return torch.cat([self.k[layer].to(k.dtype), k], 2), torch.cat([self.v[layer].to(v.dtype), v], 2)

    def default_mask(self, T: int, device: torch.device) -> None:
        raise ValueError("a PrefixCache forward needs its attention mask")

    def graph_write(self, B: int, T: int) -> None:
        return None

    def advance(self, T: int) -> None:
        pass


@dataclass
class ExampleFeatures:
    """One example's features: kv [adapted blocks, 2, kv_heads, T, head_dim] of its clean tokens,
    states [phases, R, hidden] of its masks entering the first adapted block, phases [phases] (the
    block phase of each row of states), labels [R] (the response), prompt_len."""

    kv: Tensor
    states: Tensor
    phases: Tensor
    labels: Tensor
    prompt_len: int


def block_starts(R: int, phases: Tensor, S: int) -> Tensor:
    """[P, R]: the response index where each mask's block starts, for blocks of S at each phase
    (phase p: the first block holds S - p masks, the next start at S - p, 2S - p, ...)."""
    i = torch.arange(R, device=phases.device)[None, :]
    p = phases[:, None]
    return ((i + p) // S * S - p).clamp(min=0)


def mask_attention(prompt_len: Tensor, block: Tensor, valid: Tensor, keys: int) -> Tensor:
    """[B, 1, R, keys + R] bool: mask i sees the cached columns before prompt_len + block[i] (the prompt
    and the response before its block) and, among the masks, those of its own block up to itself."""
    B, R = block.shape
    k = torch.arange(keys, device=block.device)
    clean = k[None, None, :] < (prompt_len[:, None] + block)[:, :, None]
    i = torch.arange(R, device=block.device)
    own = (block[:, :, None] == block[:, None, :]) & (i[None, None, :] <= i[None, :, None]) & valid[:, None, :]
    own = own | torch.eye(R, dtype=torch.bool, device=block.device)
    return torch.cat([clean, own], 2)[:, None]


@torch.no_grad()
def example_features(model: Transformer, ex: Example, phases: Tensor, S: int,
                     dtype: torch.dtype = FEATURE_DTYPE) -> ExampleFeatures:
    """The features of one example (module docstring), its phases batched in one forward, kept in dtype."""
    first = adapted_from(model.config)
    ids = torch.tensor(list(ex.prompt) + list(ex.response))
    P, pl, R, T = len(phases), len(ex.prompt), len(ex.response), len(ex.prompt) + len(ex.response)
    pos = torch.arange(T)
    cache = model.new_cache()
    x = model.embed_tokens(ids)
    model.run_blocks(x, pos, None, cache, (1, T))
    keep = range(first, model.config.num_layers)
    kv = torch.stack([torch.stack([cache.k[i][0, :, :T], cache.v[i][0, :, :T]]) for i in keep]) if keep else None
    block = block_starts(R, phases, S)
    valid = torch.ones(P, R, dtype=torch.bool)
    attn = mask_attention(torch.full((P,), pl), block, valid, T)
    lower = PrefixCache({i: cache.k[i][:, :, :T].expand(P, -1, -1, -1) for i in range(first)},
                        {i: cache.v[i][:, :, :T].expand(P, -1, -1, -1) for i in range(first)})
    states = model.mask_embedding.detach().expand(P * R, -1)
    states = model.run_blocks(states, (pl + torch.arange(R)).repeat(P), attn, lower, (P, R), stop=first)
    kv = kv if kv is not None else torch.zeros(0, 2, model.config.num_kv_heads, T, model.config.head_dim)
    return ExampleFeatures(kv.to(dtype), states.reshape(P, R, -1).to(dtype), phases.clone(), ids[pl:].clone(), pl)


def feature_phases(n_examples: int, P: int, S: int, seed: int) -> Tensor:
    """[n_examples, P]: each example's block phases, P evenly spaced ones from a seeded offset, so that
    its cut points spread over every S / P-th response index."""
    gen = torch.Generator().manual_seed(seed)
    step = max(S // P, 1)
    offset = torch.randint(step, (n_examples, 1), generator=gen)
    return (offset + torch.arange(P)[None, :] * step) % S


def prepare_features(model: Transformer, examples: list[Example], out: Path, P: int, S: int, seed: int,
                     progress: bool = True, log=print) -> list[ExampleFeatures]:
    """Every example's features, computed where OUT/features lacks them (shard by shard, each written
    atomically) and read back; a features directory made for another run is refused."""
    from safetensors.torch import load_file, save_file

    d = out / "features"
    d.mkdir(parents=True, exist_ok=True)
    meta = {"examples": len(examples), "phases": P, "block": S, "seed": seed,
            "adapted_from": adapted_from(model.config), "tokens": sum(len(e) for e in examples)}
    mf = d / "features.json"
    if mf.exists() and json.loads(mf.read_text()) != meta:
        raise ValueError(f"{d} holds features of another run ({mf.read_text().strip()}, this run: {json.dumps(meta)}): "
                         "remove it, or choose another out_dir")
    mf.write_text(json.dumps(meta))
    phases = feature_phases(len(examples), P, S, seed)
    shards = range(0, len(examples), SHARD)
    todo = [lo for lo in shards if not (d / f"{lo:06d}.safetensors").exists()]
    if todo:
        log(f"computing the mask features of {len(examples)} examples ({len(todo)} of {len(shards)} shards) -> {d}")
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=sum(min(SHARD, len(examples) - lo) for lo in todo), desc="features", unit="example",
                       dynamic_ncols=True)
        t0 = time.perf_counter()
        was_training = model.training
        model.eval()
        for lo in todo:
            tensors = {}
            for e in range(lo, min(lo + SHARD, len(examples))):
                f = example_features(model, examples[e], phases[e], S)
                tensors.update({f"{e}.kv": f.kv, f"{e}.states": f.states, f"{e}.phases": f.phases,
                                f"{e}.labels": f.labels, f"{e}.prompt_len": torch.tensor(f.prompt_len)})
                if bar is not None:
                    bar.update(1)
            with atomic(d / f"{lo:06d}.safetensors") as tmp:
                save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
        model.train(was_training)
        if bar is not None:
            bar.close()
        log(f"mask features computed in {time.perf_counter() - t0:.0f} s")
    feats = []
    for lo in shards:
        t = load_file(str(d / f"{lo:06d}.safetensors"))
        for e in range(lo, min(lo + SHARD, len(examples))):
            feats.append(ExampleFeatures(t[f"{e}.kv"], t[f"{e}.states"], t[f"{e}.phases"], t[f"{e}.labels"],
                                         int(t[f"{e}.prompt_len"])))
    return feats


@dataclass
class FeatureBatch:
    """Draws of (example, phase) padded into one batch: states [B, R, hidden], labels [B, R] (IGNORE
    past a response), positions [B, R], block [B, R], valid [B, R], prompt_len [B], kv per adapted
    block as (k, v) [B, kv_heads, T, head_dim] (zeros past an example's tokens)."""

    states: Tensor
    labels: Tensor
    positions: Tensor
    block: Tensor
    valid: Tensor
    prompt_len: Tensor
    k: dict[int, Tensor]
    v: dict[int, Tensor]

    def to(self, device: torch.device) -> "FeatureBatch":
        t = [getattr(self, n).to(device) for n in ("states", "labels", "positions", "block", "valid", "prompt_len")]
        return FeatureBatch(*t, {i: x.to(device) for i, x in self.k.items()},
                            {i: x.to(device) for i, x in self.v.items()})


def feature_batch(feats: list[ExampleFeatures], draws: list[tuple[int, int]], S: int, first: int,
                  dtype: torch.dtype) -> FeatureBatch:
    """The batch of `draws` ((example, phase row) pairs)."""
    chosen = [(feats[e], p) for e, p in draws]
    B = len(chosen)
    R = max(len(f.labels) for f, _ in chosen)
    T = max(f.kv.shape[3] for f, _ in chosen)
    H = chosen[0][0].states.shape[-1]
    n, _, kvh, _, d = chosen[0][0].kv.shape
    states = torch.zeros(B, R, H, dtype=dtype)
    labels = torch.full((B, R), IGNORE, dtype=torch.long)
    kv = torch.zeros(n, 2, B, kvh, T, d, dtype=dtype)
    phase = torch.zeros(B, dtype=torch.long)
    for b, (f, p) in enumerate(chosen):
        r, t = len(f.labels), f.kv.shape[3]
        states[b, :r] = f.states[p]
        labels[b, :r] = f.labels
        kv[:, :, b, :, :t] = f.kv
        phase[b] = f.phases[p]
    valid = labels != IGNORE
    pl = torch.tensor([f.prompt_len for f, _ in chosen])
    block = torch.where(valid, block_starts(R, phase, S), -1)
    positions = pl[:, None] + torch.arange(R)[None, :]
    return FeatureBatch(states, labels, positions, block, valid, pl, {first + i: kv[i, 0] for i in range(n)},
                        {first + i: kv[i, 1] for i in range(n)})


def feature_loss(model: Transformer, fb: FeatureBatch, B: int) -> tuple[Tensor, dict[str, Tensor]]:
    """The masks' loss on a feature batch (its part of a global batch of B examples: each example's mean
    mask cross-entropy, summed, over B), through the adapted blocks and the LM head only; and
    statistics: the loss, the number of masks, and how many masks at each block offset 0-3 (and
    beyond) predicted their token (greedy), for acceptance at a glance."""
    first = adapted_from(model.config)
    Bm, R = fb.labels.shape
    real = fb.valid.reshape(-1).nonzero().squeeze(1)
    x = fb.states.reshape(Bm * R, -1)[real]
    keys = next(iter(fb.k.values())).shape[2] if fb.k else 0
    attn = mask_attention(fb.prompt_len, fb.block, fb.valid, keys)
    x = model.run_blocks(x, fb.positions.reshape(-1)[real], attn, PrefixCache(fb.k, fb.v), (Bm, R), real=real,
                         mask_rows=torch.arange(len(real)), start=first)
    logits = linear(model.lm_head, rms_norm(x, model.norm.weight, model.norm.eps))
    target = fb.labels.reshape(-1)[real]
    ce = F.cross_entropy(logits.float(), target, reduction="none")
    row = real // R
    per_example = torch.zeros(Bm, dtype=ce.dtype).index_add_(0, row, ce) / fb.valid.sum(1).clamp(min=1)
    loss = per_example.sum() / B
    stats = {"loss": loss.detach(), "mdm_loss": loss.detach(), "n_masked_tokens": torch.tensor(len(real))}
    stats.update(offset_hits(logits.detach().argmax(-1), target, real % R - fb.block.reshape(-1)[real]))
    return loss, stats


OFFSETS = 5  # mask accuracy is logged at block offsets 0..3 and 4 or more


def offset_hits(predicted: Tensor, target: Tensor, offset: Tensor) -> dict[str, Tensor]:
    """How many masks at each block offset (0-3, then 4 and beyond) predict their token greedily, and
    how many there are: predicted (the logits' argmax), target and offset [N], one mask each."""
    hit = predicted == target
    offset = offset.clamp(max=OFFSETS - 1)
    out = {}
    for o in range(OFFSETS):
        at = offset == o
        out[f"mask_hits_{o}"], out[f"masks_{o}"] = hit[at].sum(), at.sum()
    return out


def offset_accuracy(totals: dict[str, Tensor]) -> dict[str, float]:
    """Pop offset_hits' counts (summed over micro-batches) from totals: mask_acc_0 .. mask_acc_4, the
    share of masks at each block offset that predicted their token."""
    return {f"mask_acc_{o}": float(totals.pop(f"mask_hits_{o}")) / max(float(totals.pop(f"masks_{o}")), 1)
            for o in range(OFFSETS)}
