"""`refusion ...` subcommands: argument parsing only; the work is done by the library."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .fetch import FetchError, cache_dir


def default_model_dir() -> Path:
    """The model `refusion generate` runs when none is named.

    Until a trained ReFusion model is bundled, this is SmolLM2-135M-Instruct, imported from its
    GGUF package on first use (autoregressive decoding only).
    """
    path = cache_dir() / "models" / "SmolLM2-135M-Instruct"
    if not (path / "config.json").exists():
        from .convert.gguf import import_smollm2

        print(f"refusion: importing the default model into {path} (once) ...", file=sys.stderr)
        import_smollm2(path, overwrite=True)
    return path


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids takes comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


def cmd_generate(args: argparse.Namespace) -> None:
    import torch

    from .checkpoint import load_model
    from .decoding import generate_ar
    from .tokenizer import Tokenizer

    model_dir = Path(args.model) if args.model else default_model_dir()
    model = load_model(model_dir, dtype=args.dtype, device=args.device)
    tok = Tokenizer.from_dir(model_dir) if (model_dir / "tokenizer.json").exists() else None
    if args.prompt_ids is not None:
        prompt = args.prompt_ids
    elif args.prompt is None:
        raise ValueError("give a prompt (text) or --prompt-ids 1,2,3")
    elif tok is None:
        raise ValueError(f"{model_dir} has no tokenizer.json; use --prompt-ids")
    elif args.raw:
        prompt = tok.encode(args.prompt)
    else:
        prompt = tok.chat_prompt_ids(args.prompt, system=args.system)
    if max(prompt) >= model.config.vocab_size or min(prompt) < 0:
        raise ValueError(f"prompt ids must lie in [0, {model.config.vocab_size})")
    torch.manual_seed(args.seed)
    stream = None
    if not args.json and not args.no_view and tok is not None:
        def stream(row: int, position: int, token: int) -> None:
            print(tok.decode([token]), end="", flush=True)
    res = generate_ar(model, [prompt], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                      top_k=args.top_k, top_p=args.top_p, seed=args.seed, on_token=stream)[0]
    text = tok.decode(res.tokens) if tok is not None else None
    if args.json:
        print(json.dumps({**res.to_dict(), "text": text, "decoder": "ar", "model": str(model_dir)}))
        return
    if stream is None:
        print(text if text is not None else " ".join(map(str, res.tokens)))
    else:
        print()
    print(f"[ar] {len(res.tokens)} tokens, {res.forwards} forwards, TPF {res.tpf:.2f}, "
          f"{res.tps:.1f} tokens/s", file=sys.stderr)


def cmd_import_gguf(args: argparse.Namespace) -> None:
    import torch

    from .convert.gguf import import_gguf, import_smollm2

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    if args.gguf == "smollm2":
        out = import_smollm2(args.out, dtype=dtype, overwrite=args.overwrite)
    else:
        out = import_gguf(args.gguf, args.out, dtype=dtype, overwrite=args.overwrite)
    print(out)


def cmd_add_mask_token(args: argparse.Namespace) -> None:
    from .checkpoint import add_mask_token, load_model, save_model
    from .tokenizer import Tokenizer

    model = load_model(args.src)
    tok = Tokenizer.from_dir(args.src)
    mask_id = add_mask_token(model, tok, args.token)
    save_model(model, args.out, tokenizer=tok, overwrite=args.overwrite)
    print(f"{args.out}: mask token {args.token!r} = id {mask_id}, vocab {model.config.vocab_size}")


def cmd_info(args: argparse.Namespace) -> None:
    from .checkpoint import load_config

    cfg = load_config(args.model)
    print(json.dumps(cfg.to_dict(), indent=2))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="refusion", description="ReFusion: train, decode, evaluate.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a response to a prompt")
    g.add_argument("prompt", nargs="?", help="prompt text (the chat template is applied unless --raw)")
    g.add_argument("--model", help="Hugging Face model directory (default: the bundled default model)")
    g.add_argument("--prompt-ids", type=_parse_ids, help="exact prompt token ids, e.g. 1,2,3")
    g.add_argument("--system", help="system message for the chat template")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--decoder", choices=["ar"], default="ar")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int)
    g.add_argument("--top-p", type=float)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    g.add_argument("--device", default="cpu")
    g.add_argument("--json", action="store_true", help="machine-readable output")
    g.add_argument("--no-view", action="store_true", help="print only the final text")
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("import-gguf", help="import a Llama GGUF file (or 'smollm2') into a HF directory")
    i.add_argument("gguf", help="path to a .gguf file, or 'smollm2' for SmolLM2-135M-Instruct from PyPI")
    i.add_argument("out", help="output directory")
    i.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    i.add_argument("--overwrite", action="store_true")
    i.set_defaults(func=cmd_import_gguf)

    a = sub.add_parser("add-mask-token", help="turn a causal LM directory into a ReFusion starting point")
    a.add_argument("src")
    a.add_argument("out")
    a.add_argument("--token", default="<|mask|>")
    a.add_argument("--overwrite", action="store_true")
    a.set_defaults(func=cmd_add_mask_token)

    n = sub.add_parser("info", help="print a model directory's configuration")
    n.add_argument("model")
    n.set_defaults(func=cmd_info)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FetchError, FileNotFoundError) as e:  # our errors carry one-line messages
        print(f"refusion: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
