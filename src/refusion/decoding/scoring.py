"""A prompt's own token log-probabilities: what OpenAI's `echo` with `logprobs` returns, and what
lm-eval's API models sum to score a continuation.

Token i's log-probability is read from the causal forward at position i - 1, log_softmax of the
model's logits as they are (no bias, penalty or grammar: those shape an answer, not a given text),
as vLLM's prompt logprobs are. The first token has none. This is the causal factorisation the
`ar` decoder decodes from; on a model with a mask token, `ar` reads an answer's first token from a
<|mask|> instead, which a prompt scored as a whole has no place for (see
evaluation/lm_eval.py `score`, which knows where the continuation starts).
"""

from __future__ import annotations

import torch

from refusion.decoding.controls import Logprobs
from refusion.model.transformer import Transformer


@torch.inference_mode()
def prompt_logprobs(model: Transformer, ids: list[int], top: int = 0) -> Logprobs:
    """Logprobs of ids[1:], each given the ids before it, with the `top` most likely tokens at each
    of those positions (most likely first). One causal forward over the prompt."""
    if len(ids) < 2:
        return Logprobs()
    device = model.embed_tokens.weight.device
    x = torch.tensor([ids], device=device)
    logits = model(x, torch.arange(len(ids), device=device)[None])
    logp = logits[0, :-1].float().log_softmax(-1)  # position i - 1 predicts token i
    chosen = logp.gather(-1, x[0, 1:, None])[:, 0]
    if top:
        values, idx = logp.topk(top, dim=-1)
        pairs = [list(zip(i, v, strict=True)) for i, v in zip(idx.tolist(), values.tolist(), strict=True)]
    else:
        pairs = [[] for _ in range(len(ids) - 1)]
    return Logprobs(chosen=chosen.tolist(), top=pairs)
