"""ReFusion (arXiv 2512.13586) in plain PyTorch: train, decode, evaluate and serve.

The packages, from the bottom up (ARCHITECTURE.md draws them):

    model/       configuration, the transformer, caches, checkpoints, tokenizer, importers
    decoding/    the decoder registry and every decoder
    tasks/       task families: load, prompt, extract, score (and the code sandbox)
    training/    objectives, data, the trainer
    evaluation/  evaluation runs, reports, the lm-eval adapter
    serve/       the HTTP server
    cli/         the `refusion` command

The names most programs need are here too, loaded on first use (importing refusion loads no torch):

    model = refusion.load_model(path)
    results = refusion.decode(model, [prompt_ids], "speculative", gen_length=128)
"""

from __future__ import annotations

import importlib

_API = {"load_model": "refusion.model.checkpoint", "save_model": "refusion.model.checkpoint",
        "Tokenizer": "refusion.model.tokenizer", "ModelConfig": "refusion.model.config",
        "Transformer": "refusion.model.transformer", "decode": "refusion.decoding",
        "DecodeResult": "refusion.decoding"}


def __getattr__(name: str):
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'refusion' has no attribute {name!r}")


__all__ = sorted(_API)
