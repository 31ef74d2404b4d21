"""What one request may cost, checked before it is admitted to the engine.

A request's memory is its rows of KV cache and what one step feeds. Counted in tokens per row:

    prompt + gen_length + the extra columns one step writes past the answer

The extra columns are `max_width + 1` for a job in the continuous batch (the SpeculativeBatch
reserves them for x, the draft, the masks and any branches the model's settings feed), and none for the
other decoders, whose caches hold prompt + gen_length columns and whose steps feed only tokens
within them. A request with n choices holds n rows.

Two refusals, each a 400 naming the field and the limit: a step that feeds more tokens than the
model has positions (draft_length), and a request whose tokens exceed the server's
`max_request_tokens`. Its default, twice the model's context, admits every request that fits the
context with a step at most as wide as the context, so a server started without the flag refuses
nothing it answered before; with the flag, an operator trades the widest requests for memory.
In the continuous batch every row is as long as the longest prompt + gen_length plus the widest
step, so the engine admits a job there only while that stays within the limit too (engine.py).
"""

from __future__ import annotations

from refusion.serve.params import DecoderChoice
from refusion.serve.schemas import RequestError


def step_width(choice: DecoderChoice) -> int:
    """The most tokens one step feeds the row beyond the answer's columns (0: within them)."""
    return choice.spec.max_width if choice.spec is not None else 0


def request_tokens(prompt_len: int, choice: DecoderChoice) -> int:
    """Cache columns the request's row may hold: prompt + gen_length + one step's extra columns."""
    width = step_width(choice)
    return prompt_len + choice.gen_length + (width + 1 if width else 0)


def check(prompt_len: int, choice: DecoderChoice, context: int, limit: int, n: int = 1) -> None:
    """Refuse a request whose step is wider than the context or whose tokens (n rows) exceed `limit`."""
    width = step_width(choice)
    if width > context:
        param = "draft_length"  # (the request field that sizes a step: its masks and branches follow)
        raise RequestError(400, f"{_width_terms(choice)} = {width} tokens fed per step exceeds the model's context "
                                f"of {context} tokens; lower {param}", param, code="step_too_wide")
    need = request_tokens(prompt_len, choice)
    if n > 1 and n * need > limit:
        raise RequestError(400, f"this request needs {n} x {need} tokens (n = {n} choices of {need}); this server "
                                f"admits at most {limit} tokens per request: lower n or max_tokens", "n",
                           code="request_too_large")
    if need > limit:
        L = choice.gen_length
        parts = f"prompt {prompt_len} + max_tokens {L}" if L == choice.cut else (
            f"prompt {prompt_len} + max_tokens {choice.cut} rounded up to whole blocks, {L}")
        if choice.spec is not None and (choice.spec.draft_length or choice.spec.mask_length):
            parts += f" + {width + 1} for one step's drafts and masks ({_width_terms(choice)} + 1)"
        elif width:  # greedy ar in the continuous batch: the newest token and the next column
            parts += f" + {width + 1} for one step"
        param = "draft_length" if width > L else "max_tokens"
        raise RequestError(400, f"this request needs {need} tokens ({parts}); this server admits at most {limit} "
                                f"tokens per request", param, code="request_too_large")


def _width_terms(choice: DecoderChoice) -> str:
    p = choice.spec
    masks = p.mask_length if p.mask_length is not None else p.draft_length + 1
    extra = p.max_width - (1 + p.draft_length + masks)  # (redraft blocks, branches)
    return f"1 + draft_length {p.draft_length} + {masks} masks" + (f" + {extra} for redraft blocks or branches"
                                                                     if extra else "")

