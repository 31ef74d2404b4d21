"""Decoders on one interface: decode(model, prompts, decoder=..., **params) -> list[DecodeResult].

Every decoder is a record in the registry (registry.py); the built-in ones (params.py):

refusion       plan-and-infill (spec section 4)
refusion-l2r   plan-and-infill that always takes the leftmost undecoded slot
ar             autoregressive with the KV cache: the speculative batch with no drafts
speculative    self-speculative: the masks draft, causal predictions verify; greedy AR's exact output
mdm            LLaDA-style masked diffusion (fixed tokens per step, semi-autoregressive blocks)
mdm-threshold  Fast-dLLM-style: every mask above a confidence, at least one per step

Each decoder function takes (model, prompts, params, *, eos_ids, seed, on_commit). The decoder
modules import torch; they are loaded on first use, so that `refusion --help` (which only needs
the registry) starts without it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from refusion.decoding import model_settings
from refusion.decoding import params as _builtin  # noqa: F401  (registers the built-in decoders)
from refusion.decoding.params import (ARParams, MDMParams, ReFusionParams, SpeculativeParams, as_prompts,
                                     check_max_rows, check_seed, row_seeds)
from refusion.decoding.registry import (Decoder, batch_decoders, default_decoder, get, make_params, mismatch, names,
                                       register, unregister, with_controls)

if TYPE_CHECKING:
    from refusion.decoding.common import DecodeResult
    from refusion.decoding.controls import Controls
    from refusion.model.transformer import Transformer


def decode(model: Transformer, prompts: list[list[int]], decoder: str | None = None,
           eos_ids: list[int] | None = None, seed: int | list[int] | None = None,
           on_commit: Callable[..., None] | None = None,
           controls: Controls | list[Controls | None] | None = None, batch_size: int | None = None,
           **params) -> list[DecodeResult]:
    """Run a registered decoder. Parameters it does not take are an error, not silently ignored;
    so are bad values, and a prompt + gen_length beyond the model's positions (checked before
    anything is allocated).

    on_commit(row, positions, tokens) is called for every commit, as it happens (streaming). A
    decoder can commit tokens at positions after the sequence's first EOS before it knows where
    that EOS is (plan-and-infill drafts later slots first; masked diffusion fills a whole block):
    those commits are reported too, and are not part of the result. The result is always what
    the commits give when sorted by position and cut after the first EOS, so a streaming client
    should do the same.

    controls: a Controls for every prompt, or a list of one (or None) per prompt (decoding/controls.py:
    grammar, logit_bias, penalties, logprobs), honoured exactly by the decoders that take them (`ar`,
    `speculative`; the registry record's `controls`); others refuse them. A row asking for logprobs
    gets them in its result's `logprobs`, and when streaming, on_commit(row, positions, tokens,
    logprobs) with a fourth argument for every row (a controls.Logprobs of those tokens, None for a
    row that did not ask) whenever any row asked.

    batch_size: at most this many sequences at once (default: every prompt in one batch). A decoder
    that joins a continuous batch (the registry record's `batch`: `ar`, `speculative`) gives a
    finished sequence's row to the next prompt, as a server does, and every output is what it is
    alone; others decode the prompts in groups of batch_size, each with `seed`.

    seed: one for the whole call, or (decoders with `batch`) a list of one per prompt: a row's draws
    depend on its own seed alone, so a prompt decodes the same whatever the batch it is in.

    decoder None: the model's own (its decoding.json, else the one its training objective fits).
    A model loaded with `load_model` starts from the settings in its decoding.json
    (decoding/model_settings.py); the parameters given here win over them.
    """
    prompts = as_prompts(prompts)  # NumPy / torch ids become ints; a flat list, text or bools are refused
    decoder, params = model_settings.resolve(model_settings.of_model(model), model.config, decoder, params)
    p = make_params(decoder, model.config, **params)
    check_max_rows(batch_size)
    record = get(decoder)
    if isinstance(seed, (list, tuple)):
        if record.batch is None:
            raise ValueError(f"decoder {decoder!r} takes one seed for the whole call; a seed per prompt needs a "
                             f"decoder that runs each sequence on its own: {', '.join(batch_decoders())}")
        seed = row_seeds(seed, len(prompts))
    else:
        check_seed(seed)
    run = record.runner()
    more = {}
    if controls is not None:
        from refusion.decoding.controls import as_list

        per_row = [c if c is not None and c.active else None for c in as_list(controls, len(prompts))]
        if any(per_row):
            if not record.controls:
                raise ValueError(f"decoder {decoder!r} cannot apply grammar, logit_bias, penalties or logprobs "
                                 f"exactly; use one that does: {', '.join(with_controls())}")
            more["controls"] = per_row
    if batch_size is not None and record.batch is not None:
        more["max_rows"] = batch_size
    elif batch_size is not None and batch_size < len(prompts):
        results = []
        for lo in range(0, len(prompts), batch_size):
            group = {k: v[lo:lo + batch_size] for k, v in more.items()}  # (controls: one per prompt)
            rows = (None if on_commit is None else
                    lambda r, *a, lo=lo: on_commit(lo + r, *a))  # (rows numbered across the groups)
            results += run(model, prompts[lo:lo + batch_size], p, eos_ids=eos_ids, seed=seed, on_commit=rows, **group)
        return results
    return run(model, prompts, p, eos_ids=eos_ids, seed=seed, on_commit=on_commit, **more)


_LAZY = {"DecodeResult": "common", "Controls": "controls", "Logprobs": "controls", "generate_mdm": "mdm",
         "generate_refusion": "refusion", "SpeculativeBatch": "speculative", "generate_speculative": "speculative"}


def __getattr__(name: str):
    if name == "DECODERS":  # the registered names, now
        return names()
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DECODERS", "ARParams", "Controls", "DecodeResult", "Logprobs", "Decoder", "MDMParams", "ReFusionParams",
           "SpeculativeBatch", "SpeculativeParams", "decode", "default_decoder", "generate_mdm", "generate_refusion",
           "generate_speculative", "make_params", "mismatch", "register", "unregister"]
