"""A sampler head for the masks' drafts: each mask's token chosen given the token drafted before it.

A block of masks is computed in one forward, every mask blind to what the others will draft, so each
one's argmax is its best guess on average over whatever precedes it: mask 2 may pick the token that
follows the likelier of mask 1's candidates while mask 1 picks the other. Chained, such drafts break
early. The sampler (the "sampler head" of arXiv 2507.11851) re-ranks each mask's top candidates
given the token chosen just before it, one mask after another, after the forward:

    h' = h + up(silu(down([norm(embed(prev)); h])))       (h: the mask's final normed state)
    score(c) = lm_head[c] . h'   for c among the mask's `candidates` most likely tokens

`up` starts at zero, so an untrained sampler drafts the argmax. It never touches the forward: clean
tokens and their logits are the model's, so whatever it drafts, `speculative` still returns the
model's own output; it only changes how far drafts are accepted. It costs a few products of one
row per mask after the forward (hidden x 2 hidden, candidates x hidden) and no forward.

The first mask of a block sits where the verified token goes (the causal head's), so the chain
starts from that token. It is kept beside a model as MASK_SAMPLER (safetensors, its sizes in the
metadata): `sampler_of(model)` finds it in the directory the model was loaded from, as the lookup
corpus is found (decoding/corpus.py). Trained by refusion.training.mask_sampler.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from refusion.files import atomic

MASK_SAMPLER = "mask_sampler.safetensors"


class MaskSampler(nn.Module):
    """The sampler's own weights; the embedding table and LM head are the model's (passed in)."""

    def __init__(self, hidden_size: int, width: int = 256, candidates: int = 16, dropout: float = 0.5) -> None:
        super().__init__()
        if width < 1 or candidates < 1:
            raise ValueError(f"a mask sampler needs width >= 1 and candidates >= 1, got {width} and {candidates}")
        self.hidden_size, self.width, self.candidates = hidden_size, width, candidates
        self.dropout = dropout  # on the mask's state, in training: the sampler must lean on the token too
        self.down = nn.Linear(2 * hidden_size, width)
        self.up = nn.Linear(width, hidden_size)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, h: Tensor, prev_embedding: Tensor, head: Tensor) -> Tensor:
        """Scores [N, K] of the candidates given h [N, hidden] (the masks' normed final states),
        prev_embedding [N, hidden] (the input embeddings of the tokens before them) and head [N, K,
        hidden] (the LM head's rows of the candidates)."""
        x = torch.cat([F.rms_norm(prev_embedding, (self.hidden_size,)), F.dropout(h, self.dropout, self.training)], -1)
        h = h + self.up(F.silu(self.down(x)))
        return torch.einsum("nkd,nd->nk", head, h)

    @torch.no_grad()
    def draft(self, model: nn.Module, states: Tensor, logits: Tensor, first: Tensor) -> Tensor:
        """The chained drafts [B, M] of blocks of M masks: states [B, M, hidden] and logits [B, M, V]
        of the masks, first [B] the token at the first mask's position (it is column 0 of the result).
        Mask i's token is chosen among its top candidates given mask i - 1's."""
        states = states.float()  # (the sampler's own weights are float32 whatever the model's dtype)
        B, M, _ = states.shape
        out = torch.empty(B, M, dtype=torch.long, device=states.device)
        out[:, 0] = first
        if M < 2:
            return out
        cand = logits[:, 1:].topk(min(self.candidates, logits.shape[-1]), -1).indices  # [B, M - 1, K]
        head = model.lm_head.weight[cand].float()  # [B, M - 1, K, hidden]
        prev = first
        for i in range(1, M):
            scores = self(states[:, i], model.embed_tokens.weight[prev].float(), head[:, i - 1])
            prev = cand[:, i - 1].gather(1, scores.argmax(1, keepdim=True)).squeeze(1)
            out[:, i] = prev
        return out


def save_sampler(sampler: MaskSampler, directory: str | Path) -> Path:
    """Write the sampler into `directory` as MASK_SAMPLER (atomically); its path."""
    from safetensors.torch import save_file

    path = Path(directory) / MASK_SAMPLER
    tensors = {k: v.detach().float().contiguous() for k, v in sampler.state_dict().items()}
    meta = {"hidden_size": str(sampler.hidden_size), "width": str(sampler.width),
            "candidates": str(sampler.candidates)}
    with atomic(path) as tmp:
        save_file(tensors, str(tmp), metadata=meta)
        tmp.chmod(0o644)  # (the file ships with a model: readable like its weights)
    return path


def read_sampler(path: str | Path, hidden_size: int | None = None) -> MaskSampler:
    """The sampler kept at `path` (eval mode); ValueError names a file that is not one, or one made
    for another hidden size."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        sampler = MaskSampler(int(meta["hidden_size"]), int(meta["width"]), int(meta["candidates"]))
        sampler.load_state_dict(tensors)
    except (KeyError, ValueError, RuntimeError, OSError, SafetensorError) as e:
        raise ValueError(f"{path} is not a mask sampler ({type(e).__name__}: {e}); train one with "
                         "`refusion train-sampler` or delete the file") from None
    if hidden_size is not None and sampler.hidden_size != hidden_size:
        raise ValueError(f"{path} is a mask sampler for hidden size {sampler.hidden_size}, but the model's is "
                         f"{hidden_size}: it belongs to another model")
    return sampler.eval()


_SAMPLERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its MaskSampler or None


def sampler_of(model: nn.Module) -> MaskSampler | None:
    """The sampler kept in the directory `model` was loaded from (load_model sets model.directory),
    on the model's device; None where there is none."""
    if model not in _SAMPLERS:
        d = getattr(model, "directory", None)
        path = Path(d) / MASK_SAMPLER if d is not None else None
        sampler = None
        if path is not None and path.is_file():
            sampler = read_sampler(path, model.config.hidden_size).to(model.embed_tokens.weight.device)
        _SAMPLERS[model] = sampler
    return _SAMPLERS[model]
