"""Per-sequence controls of the causal distribution: a grammar, a logit bias, presence and frequency
penalties, and the log-probabilities to report.

At every position `ar` and `speculative` verify, a row's logits l (the causal prediction of that
position) become, in this order (OpenAI's and vLLM's semantics):

    l[t] += logit_bias[t]
    l[t] -= presence_penalty * (c[t] > 0) + frequency_penalty * c[t]
    l[t] = -inf where the grammar does not allow t next

where c[t] counts t among the response tokens before that position (the committed ones and, in a
speculative step, the draft tokens before it; the prompt is not counted, as in vLLM). Temperature,
top-k and top-p then apply as without controls. Since the verify pass sees exactly the logits AR
decoding sees at each position, a controlled `speculative` gives controlled `ar`'s tokens (greedy:
the same tokens; sampled: the same draws), whatever its drafts.

Log-probabilities: of the distribution each token was chosen from, after the bias, the penalties
and the grammar: greedy, log_softmax of those logits; sampling, the log of the probabilities it drew
from (temperature applied, top-k / top-p cut). The top alternatives are the most likely tokens
of that distribution that it can give at all (those the grammar or a cut leaves out are not listed,
so a list may be shorter than asked). `ar` and `speculative` report the same numbers for the same
tokens, to float rounding (their forwards differ in width).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from refusion.decoding.grammar import Grammar

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs
MAX_BIAS = 100.0  # OpenAI's bound on a logit_bias value
MAX_PENALTY = 2.0  # OpenAI's bound on presence_penalty and frequency_penalty


@dataclass(frozen=True)
class Controls:
    """What applies to one sequence's causal distribution (module docstring).

    grammar: the response must match it (grammar.json_schema, ...), ending exactly where it is
    complete; logit_bias: {token id: added to its logit}, each in [-100, 100] (-100 bans a token in
    practice, 100 all but forces it); presence_penalty / frequency_penalty in [-2, 2]; logprobs: None
    reports none, 0 each token's log-probability, k in 1..20 also the k most likely tokens'."""

    grammar: Grammar | None = None
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise ValueError(f"grammar must be a Grammar (refusion.decoding.grammar.json_schema, regex, ...), got "
                             f"{type(self.grammar).__name__}")
        if not isinstance(self.logit_bias, Mapping):
            raise ValueError(f"logit_bias must map token ids to numbers, got {type(self.logit_bias).__name__}")
        bias = {}
        for t, b in self.logit_bias.items():
            tid = int(t) if isinstance(t, str) and t.strip().lstrip("-").isdigit() else t
            if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {t!r}")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not -MAX_BIAS <= b <= MAX_BIAS:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {tid}")
            bias[tid] = float(b)
        object.__setattr__(self, "logit_bias", bias)
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and -MAX_PENALTY <= v
                                                                                <= MAX_PENALTY):
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"logprobs must be None, or an integer in [0, {MAX_TOP_LOGPROBS}] (the number of top "
                             f"alternatives), got {self.logprobs!r}")

    def check_vocab(self, vocab_size: int) -> None:
        """Every biased id within the model's vocabulary; the grammar's tokenizer no larger than it."""
        bad = [t for t in self.logit_bias if t >= vocab_size]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        if self.grammar is not None and self.grammar.vocab_size > vocab_size:
            raise ValueError(f"the grammar was built for a tokenizer of {self.grammar.vocab_size} tokens, more than the "
                             f"model's vocabulary ({vocab_size}): build it with this model's tokenizer")

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def shapes_logits(self) -> bool:
        """Whether anything changes the logits (else only logprobs are asked for)."""
        return self.grammar is not None or bool(self.logit_bias) or self.penalised

    @property
    def active(self) -> bool:
        return self.shapes_logits or self.logprobs is not None


@dataclass
class Logprobs:
    """Log-probabilities of some tokens, aligned with them: chosen[i] of the i-th token; top[i] the k
    most likely tokens there, as (id, logprob), most likely first (k = Controls.logprobs; [] when 0;
    fewer where fewer are possible, as under a grammar)."""

    chosen: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)

    def extend(self, other: Logprobs) -> None:
        self.chosen += other.chosen
        self.top += other.top

    def to_dict(self) -> dict:
        return {"chosen": self.chosen, "top": [[list(p) for p in t] for t in self.top]}


def as_list(controls: Controls | list[Controls] | None, n: int) -> list[Controls | None]:
    """One Controls (or None) per prompt: one for all, or a list of n."""
    if controls is None or isinstance(controls, Controls):
        return [controls] * n
    if not isinstance(controls, (list, tuple)) or not all(c is None or isinstance(c, Controls) for c in controls):
        raise ValueError("controls must be a Controls, a list of them (one per prompt) or None")
    if len(controls) != n:
        raise ValueError(f"{len(controls)} controls for {n} prompts: give one per prompt, or one for all")
    return list(controls)
