"""The built-in decoders: each one's parameters (a frozen dataclass that validates itself) and its
registry record, and the checks every decoder's validation shares.

Kept apart from the decoders' code, which imports torch, so that the CLI can build its flags (and
`refusion --help` answer) without loading it; each record names its function as "module:function".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from refusion.decoding.registry import Decoder, option, register

# ---- checks shared by the Params' validate() (and so by the CLI, the server and lm-eval) ---------

# Bounds that hold whatever the model, so that a huge value is refused before anything is allocated;
# the model's context bounds these widths further (check_prompts, SpeculativeParams.check_model).
MAX_GEN_LENGTH = 1 << 17  # the longest context of the model families refusion loads (Llama 3.1: 128K)
MAX_DRAFT = 256  # draft tokens (or masks) one speculative step feeds: far beyond any run of acceptances
MAX_SEED = 2**63 - 1  # torch's generators take seeds in [0, 2**63)


def check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def check_gen_length(value: int) -> None:
    check_positive("gen_length", value)
    if value > MAX_GEN_LENGTH:
        raise ValueError(f"gen_length {value} exceeds {MAX_GEN_LENGTH}, the most tokens a decoder generates in one "
                         "call; lower gen_length")


def check_seed(seed: int | None) -> None:
    """None (unseeded) or an integer in [0, 2**63 - 1]."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED):
        raise ValueError(f"seed must be an integer in [0, 2**63 - 1], got {seed!r}")


def row_seeds(seeds: list[int] | tuple[int, ...], n: int) -> list[int]:
    """A seed per prompt, each checked as check_seed does (None is not one)."""
    if len(seeds) != n:
        raise ValueError(f"{len(seeds)} seeds for {n} prompts: give one per prompt (or a single seed)")
    for s in seeds:
        if s is None:
            raise ValueError("a seed per prompt must be an integer, got None in the list")
        check_seed(s)
    return list(seeds)


def check_max_rows(rows: int | None) -> None:
    """None (every prompt at once) or a positive integer: decode()'s batch_size."""
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
        raise ValueError(f"batch_size must be a positive integer (sequences decoded at once), got {rows!r}")


def check_probability(name: str, value: float) -> None:
    # written so that NaN fails too (every comparison with NaN is false)
    if isinstance(value, bool) or not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
        raise ValueError(f"{name} must lie in [0, 1], got {value!r}")


def check_sampling(temperature: float, top_k: int | None = None, top_p: float | None = None) -> None:
    """temperature finite and >= 0 (0 = greedy); top_k >= 1; top_p in (0, 1]; and top_k / top_p only
    when sampling, since greedy decoding would ignore them without a word."""
    if isinstance(temperature, bool) or not (isinstance(temperature, (int, float)) and math.isfinite(temperature)
                                              and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None:
        check_positive("top_k", top_k)
    if top_p is not None and (isinstance(top_p, bool) or not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0)):
        # top_p = 0 would keep no token at all (every probability -inf, then NaN)
        raise ValueError(f"top_p must lie in (0, 1], got {top_p!r}")
    given = [name for name, v in (("top_k", top_k), ("top_p", top_p)) if v is not None]
    if temperature == 0 and given:
        raise ValueError(f"{' and '.join(given)} {'apply' if len(given) > 1 else 'applies'} only when sampling: "
                         "set temperature > 0 (0, the default, is greedy)")


def as_prompts(prompts) -> list[list[int]]:
    """`prompts` as lists of Python ints: a list (or tuple) of prompts, each a list, tuple, NumPy
    array or tensor of integer ids, or one 2-D array / tensor. A single prompt (a flat list of ids),
    text, bools, floats or negative shapes are refused with a ValueError saying what to pass."""
    if hasattr(prompts, "tolist") and hasattr(prompts, "dtype"):  # a NumPy array or a tensor: one batch
        if getattr(prompts, "ndim", None) != 2:
            raise ValueError(f"prompts as an array or tensor must be 2-D (prompts x tokens), got shape "
                             f"{tuple(prompts.shape)}; a single prompt is [ids]")
        prompts = list(prompts)
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a list of prompts, each a list of token ids, got {type(prompts).__name__}")
    if prompts and all(_is_id(t) for t in prompts):
        raise ValueError("prompts must be a list of prompts, each a list of token ids: wrap a single prompt in a "
                         "list, [ids]")
    return [_as_ids(p) for p in prompts]


def _is_id(t) -> bool:
    return isinstance(t, int) or (hasattr(t, "__index__") and not hasattr(t, "__len__"))


def _as_ids(p) -> list[int]:
    if isinstance(p, (str, bytes)):
        raise ValueError("a prompt is token ids, not text: encode it first (Tokenizer.chat_prompt_ids or .encode)")
    if hasattr(p, "tolist") and hasattr(p, "dtype"):  # an array or tensor of ids
        kind = str(p.dtype)
        if "int" not in kind or getattr(p, "ndim", 1) != 1:
            raise ValueError(f"a prompt array or tensor must be 1-D with an integer dtype, got {kind} of shape "
                             f"{tuple(p.shape)}")
        return [int(t) for t in p.tolist()]
    if not isinstance(p, (list, tuple)):
        raise ValueError(f"each prompt must be a list of token ids, got {type(p).__name__}")
    if all(type(t) is int for t in p):
        return list(p)
    out = []
    for t in p:
        if isinstance(t, bool) or "bool" in type(t).__name__:
            raise ValueError(f"token id {t!r} is a bool, not a token id")
        try:
            out.append(t.__index__())  # NumPy and torch integers
        except (AttributeError, TypeError, RuntimeError, ValueError):
            raise ValueError(f"token id {t!r} is not an integer") from None
    return out


def check_prompts(config, prompts: list[list[int]], gen_length: int) -> None:
    """Every prompt non-empty with ids in the vocabulary, and prompt + gen_length within the model's
    positions. Run before anything is allocated: a huge gen_length must fail here, not in malloc."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    V = config.vocab_size
    for p in prompts:
        bad = next((t for t in p if isinstance(t, bool) or not (isinstance(t, int) and 0 <= t < V)), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {V})")
    limit = config.max_position_embeddings
    if gen_length >= limit:
        raise ValueError(f"gen_length {gen_length} exceeds what the model can position "
                         f"(max_position_embeddings {limit}, prompt included)")
    longest = max(len(p) for p in prompts)
    if longest + gen_length > limit:
        raise ValueError(f"prompt ({longest} tokens) + gen_length ({gen_length}) = {longest + gen_length} exceeds "
                         f"the model's max_position_embeddings {limit}; shorten the prompt or lower gen_length")


# ---- the fields every decoder has ------------------------------------------------------------------

GEN_LENGTH = 128  # one default for every decoder and the CLI


def gen_length_option():
    return option(GEN_LENGTH, "tokens to generate (at most)")


def temperature_option():
    return option(0.0, "0 = greedy")


def top_k_option():
    return option(None, "sample from the k most likely tokens (needs --temperature > 0)")


def top_p_option():
    return option(None, "sample from the smallest set with this much probability (needs --temperature > 0)")


# ---- self-speculative ---------------------------------------------------------------------------


WIDTH_POLICIES = ("cost", "adaptive", "fixed")
COST_DRAFT_LENGTH = 32  # the cost policy's default bound: it picks narrower widths itself where they pay
DRAFT_LENGTH = 16  # the adaptive and fixed policies' default
# redraft feeds width + 1 blocks of width + 1 masks: the cost policy drafts at most this far with it
REDRAFT_COST_DRAFT = 8
MAX_BRANCHES = 3  # drafts a forking row may feed beside its first (fork)


@dataclass(frozen=True)
class SpeculativeParams:
    """self-speculative: greedy output identical to ar, several tokens per forward"""

    gen_length: int = gen_length_option()
    temperature: float = temperature_option()
    top_k: int | None = top_k_option()
    top_p: float | None = top_p_option()
    draft_length: int | None = option(None, f"the draft budget: most draft tokens verified per forward (default "
                                            f"{COST_DRAFT_LENGTH}; the cost policy drafts narrower where wider does "
                                            f"not pay; 0: plain AR)")
    accept_prob: float | None = option(None, "lossy: also accept a draft token whose probability is at least this "
                                             "(default: exact; greedy: only values < 0.5 matter)")
    # ---- the drafting policy: Python-only (decode(..., fork=True)); a model's decoding.json may set them
    widths: str | None = option(None, "how each step sizes the drafts: cost (default) = the widths that maximise "
                                      "expected tokens per second of measured forward cost, within draft_length; "
                                      "adaptive = +2 after a fully accepted draft, -1 after a rejection; "
                                      "fixed = always draft_length", hidden=True)
    mask_length: int | None = option(None, "masks fed per forward to draft ahead (default: draft width + 1)",
                                     hidden=True)
    width_price: float = option(1.0, "with widths cost: the share of a wider forward's measured extra cost the "
                                     "policy counts, in (0, 1]; below 1 it feeds wider drafts, more masks and "
                                     "branches, for more tokens per forward (a batch counts the lowest share its "
                                     "rows ask; exact either way)", hidden=True)
    lookup: bool | None = option(None, "also draft by prompt lookup: copy what followed the latest earlier occurrence "
                                        "of the last few tokens (prompt or answer); each step feeds whichever draft, "
                                        "lookup or masks, is expected to be accepted further (exact either way). "
                                        "Default: on for a model with a mask adapter (its masks draft from a frozen "
                                        "base, and copies go further), off otherwise", hidden=True)
    fork: bool = option(False, "also feed, beside the draft, the other drafts on offer (the masks', the copy's, the "
                               "corpus') and the copy's and the corpus' other ways on, each from the token where it "
                               "parts from the draft and seeing only its own branch: a step accepts whichever goes "
                               "furthest (the cost policy feeds each where it pays; exact either way)", hidden=True)
    sampler: bool = option(True, "chain each mask's draft on the token drafted before it with the model's mask "
                                 "sampler, where it has one (mask_sampler.safetensors beside its weights); off: "
                                 "each mask's argmax (exact either way)", hidden=True)
    fresh_after_miss: bool | None = option(None, "after a rejected draft token, drop the rest of the draft, so that "
                                                 "the next step's masks draft from the committed tokens alone (off: "
                                                 "the rest of the draft, then the masks' tokens drafted behind the "
                                                 "rejected one; exact either way). Default: on for a model with a "
                                                 "mask adapter, whose masks rarely guess past a token they did not "
                                                 "see, off otherwise", hidden=True)
    sampled_drafts: bool = option(False, "sampling: each mask drafts a draw from its distribution with the uniform "
                                         "its position's output is drawn with, not its argmax (exact either way; "
                                         "fewer tokens per forward on the models measured)", hidden=True)
    redraft: bool = option(False, "also feed, behind each draft token, masks that see the draft only up to it, so "
                                  "that after a partly accepted draft the next one is drafted from the accepted "
                                  "tokens (wider forwards, which the cost policy prices; exact either way)",
                           hidden=True)
    first_from_mask: bool | None = option(None, "read the first token from a <|mask|> at its position, not from "
                                                "the prompt's last token (default: on when the model has a mask "
                                                "token and no causal_first_token; a model without one runs only "
                                                "draft_length 0, plain AR)", hidden=True)

    def __post_init__(self) -> None:
        # draft_length defaults by the width policy; settled here, so every reader sees concrete values
        if self.widths is not None and self.widths not in WIDTH_POLICIES:
            raise ValueError(f"widths must be one of {', '.join(WIDTH_POLICIES)}, got {self.widths!r}")
        widths = self.widths or "cost"
        object.__setattr__(self, "widths", widths)
        if self.draft_length is None:
            object.__setattr__(self, "draft_length", COST_DRAFT_LENGTH if widths == "cost" else DRAFT_LENGTH)
        self.validate()

    def validate(self) -> None:
        check_gen_length(self.gen_length)
        if isinstance(self.draft_length, bool) or not (isinstance(self.draft_length, int) and self.draft_length >= 0):
            raise ValueError(f"draft_length must be an integer >= 0 (0: plain AR), got {self.draft_length!r}")
        if self.mask_length is not None and (isinstance(self.mask_length, bool) or
                                             not (isinstance(self.mask_length, int) and self.mask_length >= 0)):
            raise ValueError(f"mask_length must be an integer >= 0, got {self.mask_length!r}")
        # (a draft that long is never accepted whole: it would only cost memory and time)
        if self.draft_length > MAX_DRAFT:
            raise ValueError(f"draft_length {self.draft_length} exceeds {MAX_DRAFT}, the most draft tokens a step may "
                             f"verify; lower draft_length (default {COST_DRAFT_LENGTH} with widths cost, "
                             f"else {DRAFT_LENGTH})")
        if self.mask_length is not None and self.mask_length > MAX_DRAFT:
            raise ValueError(f"mask_length {self.mask_length} exceeds {MAX_DRAFT}, the most masks a step may feed; "
                             "lower mask_length (default: the draft width + 1)")
        check_sampling(self.temperature, self.top_k, self.top_p)
        if isinstance(self.width_price, bool) or not isinstance(self.width_price, (int, float)) \
                or not 0 < self.width_price <= 1:
            raise ValueError(f"width_price must be a number in (0, 1] (the share of width's measured cost the "
                             f"cost policy counts), got {self.width_price!r}")
        if self.width_price != 1 and self.widths != "cost":
            raise ValueError(f"width_price prices the cost policy's widths: it needs widths cost, not "
                             f"{self.widths!r}")
        for name in ("lookup", "fresh_after_miss", "first_from_mask"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"{name} must be true, false or unset (the model's default), got {v!r}")
        if self.accept_prob is not None:
            check_probability("accept_prob", self.accept_prob)
            if self.accept_prob == 0:
                raise ValueError("accept_prob must be > 0 (0 would accept every draft token)")
        if self.fork and self.redraft:
            raise ValueError("fork and redraft do not combine (a branch would need redraft blocks of its own): "
                             "choose one")

    def check_model(self, config) -> None:
        """The widths within the model's context: no step can draft past the positions it has."""
        limit = config.max_position_embeddings
        for name in ("draft_length", "mask_length"):
            v = getattr(self, name)
            if v is not None and v > limit:
                raise ValueError(f"{name} {v} exceeds the model's context (max_position_embeddings {limit}); "
                                 f"lower {name}")

    @property
    def max_width(self) -> int:
        """The most tokens one step can feed after the prefill: x, the draft, the masks (and the branches,
        with fork on)."""
        d = min(self.draft_length, REDRAFT_COST_DRAFT) if self.redraft and self.widths == "cost" else self.draft_length
        masks = self.mask_length if self.mask_length is not None else d + 1
        return 1 + d + masks * (1 + d if self.redraft else 1) + (MAX_BRANCHES * d if self.fork else 0)


register(Decoder("speculative", SpeculativeParams, "refusion.decoding.speculative:generate_speculative",
                 "self-speculative: the masks draft, causal predictions verify; greedy AR's exact output",
                 fits=("refusion",), batch=lambda p, config: p, controls=True))

# ---- plan-and-infill ------------------------------------------------------------------------------


GUARDS = ("join_check", "causal_infill", "recheck_rows")  # what ReFusionParams.checks turns on


@dataclass(frozen=True)
class ReFusionParams:
    """plan-and-infill"""

    gen_length: int = gen_length_option()
    slot_size: int = option(8, "tokens per slot")
    slot_threshold: float = option(0.9, "plan: draft confidence to take a slot")
    token_threshold: float = option(0.4, "verify: probability to accept a token")
    temperature: float = temperature_option()
    checks: bool = option(False, "greedy only: check where slots drafted in parallel meet the text before them, "
                                 "and re-plan the ones that do not follow it (join_check, causal_infill and "
                                 "recheck_rows together; more accurate on every model measured, docs/decoding.md)")
    left_to_right: bool = option(False, "always choose the leftmost undecoded slot (the refusion-l2r baseline)")
    # ---- Python-only (decode(..., join_check=True)); a model's decoding.json may set them
    serial_blocks: int = option(1, "blocks decoded one after another", hidden=True)
    recompute_kv: bool = option(False, "recompute infilled slots' KV in one causal pass (ablation)", hidden=True)
    join_check: bool = option(False, "check slot joins: a slot after a committed response token starts with that "
                                     "token's causal prediction; one committed right after another slot must too, "
                                     "or is re-planned (greedy only)", hidden=True)
    causal_infill: bool = option(False, "infill: the token each round takes without a check (the first one not yet "
                                        "accepted) becomes the causal prediction from the token before it, as "
                                        "speculative's extra token; the mask's draft only when they agree (greedy only)",
                                  hidden=True)
    recheck_rows: bool = option(False, "after a parallel infill, feed its rows again in one causal pass, each after "
                                       "the chosen slots before it (as recompute_kv), and commit them only up to "
                                       "the first row with a token that pass gives token_threshold or less and does "
                                       "not predict; the rows after it are re-planned", hidden=True)
    verify: bool = option(False, "verify the plan-and-infill answer as a draft of the speculative decoder: the "
                                 "output is then AR decoding's, token for token, and the forwards of both count",
                           hidden=True)

    def __post_init__(self) -> None:
        if self.checks:
            for name in GUARDS:
                object.__setattr__(self, name, True)
        self.validate()

    def validate(self) -> None:
        s, L, B = self.slot_size, self.gen_length, self.serial_blocks
        check_gen_length(L)  # slot_size and serial_blocks are bounded by it below
        for name in ("slot_size", "serial_blocks"):
            check_positive(name, getattr(self, name))
        if s * B > L:
            raise ValueError(f"slot_size x serial_blocks = {s} x {B} = {s * B} exceeds gen_length {L} "
                             "(each serial block needs at least one slot)")
        if L % (s * B):
            lo = L // (s * B) * s * B
            raise ValueError(f"gen_length {L} must be a multiple of slot_size x serial_blocks = {s * B} "
                             f"(each serial block a whole number of slots); try gen_length {lo} or {lo + s * B}")
        for name in ("slot_threshold", "token_threshold"):
            check_probability(name, getattr(self, name))
        check_sampling(self.temperature)
        if self.checks and self.temperature > 0:
            raise ValueError("checks compare drafts with the greedy causal prediction: they need temperature 0")
        for name in ("join_check", "causal_infill"):
            if getattr(self, name) and self.temperature > 0:
                raise ValueError(f"{name} compares drafts with the greedy causal prediction: it needs temperature 0")


def _whole_slots(s) -> int:
    return s["slot_size"] * s["serial_blocks"]


for _name, _l2r, _text in (("refusion", False, "plan-and-infill (spec section 4)"),
                           ("refusion-l2r", True, "plan-and-infill that always takes the leftmost undecoded slot")):
    register(Decoder(_name, ReFusionParams, "refusion.decoding.refusion:generate_refusion", _text,
                     fits=("refusion",), fixed={"left_to_right": _l2r}, gen_unit=_whole_slots, seeds_per_row=True))

# ---- autoregressive -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ARParams:
    """autoregressive with the KV cache"""

    gen_length: int = gen_length_option()
    temperature: float = temperature_option()
    top_k: int | None = top_k_option()
    top_p: float | None = top_p_option()
    first_from_mask: bool | None = option(None, "read the first token from a <|mask|> at its position "
                                                "(default: on when the model has a mask token and no causal_first_token)", hidden=True)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        check_gen_length(self.gen_length)
        check_sampling(self.temperature, self.top_k, self.top_p)


def ar_batch_params(p: ARParams, config) -> SpeculativeParams:
    """AR is the speculative batch with no drafts (one token per forward, no masks but the first token's
    where it comes from one): what `ar` runs (speculative.generate_ar) and what its jobs join the
    server's continuous batch with, whatever the model (one without a mask token reads its first token
    from the prompt's last)."""
    return SpeculativeParams(gen_length=p.gen_length, draft_length=0, mask_length=0, widths="fixed",
                             temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                             first_from_mask=p.first_from_mask)


register(Decoder("ar", ARParams, "refusion.decoding.speculative:generate_ar", "autoregressive with the KV cache",
                 fits=("refusion", "ar"), needs_mask=False, aliases={"max_new_tokens": "gen_length"},
                 batch=ar_batch_params, seeds_per_row=True, controls=True))

# ---- masked diffusion -----------------------------------------------------------------------------


@dataclass(frozen=True)
class MDMParams:
    """masked diffusion"""

    gen_length: int = gen_length_option()
    block_length: int = option(32, "tokens per semi-autoregressive block")
    steps: int | None = option(None, "total denoising steps (default: gen-length, one token per step)")
    threshold: float | None = option(None, "commit every mask above this confidence, at least one per step")
    temperature: float = temperature_option()
    prefix_cache: bool | None = option(None, "reuse the prompt's and finished blocks' KV (default: on for a causal "
                                             "model, where it is exact; off for a bidirectional one)", hidden=True)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        L, b = self.gen_length, self.block_length
        check_gen_length(L)
        check_positive("block_length", b)  # and a divisor of gen_length, so bounded by it
        if L % b:
            raise ValueError(f"gen_length {L} must be a positive multiple of block_length {b}")
        if self.threshold is not None and self.steps is not None:
            raise ValueError("steps sets a fixed number of commits per step; the threshold mode takes none")
        if self.threshold is None and self.steps is not None:
            check_positive("steps", self.steps)
            if self.steps % (L // b):
                raise ValueError(f"steps {self.steps} must be a positive multiple of the number of blocks {L // b}")
            if self.steps > L:
                raise ValueError(f"steps {self.steps} exceeds gen_length {L}: every step must commit a token")
        if self.threshold is not None:
            check_probability("threshold", self.threshold)
        check_sampling(self.temperature)


register(Decoder("mdm", MDMParams, "refusion.decoding.mdm:generate_mdm",
                 "LLaDA-style masked diffusion: a fixed number of tokens per step, semi-autoregressive blocks",
                 fits=("mdm",), fixed={"threshold": None}, gen_unit=lambda s: s["block_length"]))
register(Decoder("mdm-threshold", MDMParams, "refusion.decoding.mdm:generate_mdm",
                 "Fast-dLLM-style masked diffusion: every mask above a confidence, at least one per step",
                 fits=("mdm",), fixed={"steps": None}, defaults={"threshold": 0.9},
                 gen_unit=lambda s: s["block_length"]))
