"""Controlled AR decoding the simple way, for the tests of decoding/controls.py: one sequence, a full
causal forward per token (no cache, no batch), the controls applied to that token's logits with
dense tensors as the docstring of decoding/controls.py states them, the grammar's allowed tokens
unpacked with numpy. `ar` and `speculative` with the same controls must give its tokens."""

from __future__ import annotations

import numpy as np
import torch

from refusion.decoding.controls import Controls
from refusion.decoding.sampling import draw, position_uniforms, sampling_probs
from refusion.model.transformer import Transformer


def controlled_logits(logits: torch.Tensor, controls: Controls, response: list[int], matcher, eos: list[int]
                      ) -> torch.Tensor:
    """logits [V] of the next response token -> with bias, penalties (counts over `response`) and the
    grammar (matcher at `response`) applied."""
    V = logits.shape[-1]
    x = logits.float().clone()
    for t, b in controls.logit_bias.items():
        x[t] += b
    counts = torch.bincount(torch.tensor(response, dtype=torch.long), minlength=V).float()
    x -= controls.presence_penalty * (counts > 0).float() + controls.frequency_penalty * counts
    if matcher is not None:
        words = np.zeros((V + 31) // 32, dtype=np.int32)
        matcher.fill(words, np.array(eos, dtype=np.int64))
        allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[:V].astype(bool)
        x[torch.from_numpy(~allowed)] = float("-inf")
    return x


def next_distribution(model: Transformer, prompt: list[int], response: list[int], controls: Controls, matcher,
                      eos: list[int], first_from_mask: bool, temperature: float = 0.0, top_k: int | None = None,
                      top_p: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(controlled logits [V], the distribution a token is chosen from [V]: the sampler's
    probabilities, or softmax when greedy)."""
    if not response and first_from_mask:
        ids = prompt + [model.config.mask_token_id]  # the first token from a mask at its position
    else:
        ids = prompt + response
    with torch.inference_mode():
        logits = model(torch.tensor([ids]), torch.arange(len(ids))[None])[0, -1]
    x = controlled_logits(logits, controls, response, matcher, eos)
    if temperature > 0:
        probs = sampling_probs(x[None, None], torch.tensor([float(temperature)]), torch.tensor([top_k or 0]),
                               torch.tensor([float(top_p or 1.0)]), top_k is not None or top_p is not None)[0, 0]
    else:
        probs = x.softmax(-1)
    return x, probs


def reference(model: Transformer, prompt: list[int], controls: Controls, gen_length: int, eos: list[int],
              temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int = 0,
              first_from_mask: bool | None = None) -> tuple[list[int], list[float], list[list[tuple[int, float]]]]:
    """(tokens up to and including the first EOS, each one's logprob, each one's top `controls.logprobs`
    among the tokens it could be)."""
    cfg = model.config
    if first_from_mask is None:
        first_from_mask = cfg.mask_token_id is not None and not cfg.causal_first_token
    matcher = controls.grammar.matcher() if controls.grammar is not None else None
    out, lps, tops = [], [], []
    k = controls.logprobs or 0
    for t in range(gen_length):
        x, probs = next_distribution(model, prompt, out, controls, matcher, eos, first_from_mask, temperature,
                                     top_k, top_p)
        if temperature > 0:
            tok = int(draw(probs[None], position_uniforms(torch.tensor([seed]), torch.tensor([t])))[0])
            logp = probs.log()
        else:
            tok = int(x.argmax())
            logp = x.log_softmax(-1)
        out.append(tok)
        lps.append(float(logp[tok]))
        v, i = logp.topk(k) if k else (logp[:0], logp[:0].long())
        tops.append([(t, x) for t, x in zip(i.tolist(), v.tolist(), strict=True) if x > float("-inf")])
        if tok in eos:
            break
        if matcher is not None:
            assert matcher.accept(tok)
    return out, lps, tops
