"""ReFusion (arXiv 2512.13586) in plain PyTorch: train, decode, evaluate and serve.

The packages, from the bottom up (ARCHITECTURE.md draws them):

    model/       configuration, the transformer, caches, checkpoints, tokenizer, importers
    decoding/    the decoder registry and every decoder
    tasks/       task families: load, prompt, extract, score (and the code sandbox)
    training/    objectives, data, the trainer
    evaluation/  evaluation runs, reports, the lm-eval adapter
    serve/       the HTTP server
    cli/         the `refusion` command

Importing this package loads no torch.
"""

from refusion import _moved

_moved.install()
