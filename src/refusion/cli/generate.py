"""`refusion generate`: one prompt through a decoder, showing the slots being filled on a terminal."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from refusion.cli.args import MODEL_HELP, add_runtime_flags, resolve_model_dir, utf8_text
from refusion.cli.decoder_flags import add_decoder_flags, choose_decoder


def add_parser(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="generate a response to a prompt", description="Generate a response to a "
                       "prompt, showing the slots being filled on a terminal.")
    g.add_argument("prompt", nargs="?", type=utf8_text, help="prompt text (the chat template is applied unless --raw)")
    g.add_argument("--model", help=MODEL_HELP)
    g.add_argument("--prompt-ids", type=_parse_ids, help="exact prompt token ids, e.g. 1,2,3 (instead of text)")
    g.add_argument("--system", type=utf8_text, help="system message for the chat template")
    g.add_argument("--raw", action="store_true", help="the prompt is the model's raw input: no chat template, and the "
                   "strings of special tokens in it (<|im_end|>) are those tokens; without it they are plain text")
    add_decoder_flags(g)
    c = g.add_argument_group("structured output (decoders ar and speculative; the output is theirs, token for token)")
    c.add_argument("--json-schema", metavar="FILE", help="the response is JSON valid against the JSON schema in FILE")
    c.add_argument("--regex", metavar="PATTERN", help="the response matches PATTERN whole (Rust regex syntax)")
    add_runtime_flags(g)
    g.add_argument("--json", action="store_true", help="machine-readable output")
    g.add_argument("--no-view", action="store_true", help="print only the final text")
    g.set_defaults(func=cmd_generate)


def _parse_ids(text: str) -> list[int]:
    """Token ids "1,2,3" (spaces around an id allowed); an empty item is a typo, not something to skip.
    Ids past the model's vocabulary are refused with the model's config, before its weights load."""
    items = [x.strip() for x in text.split(",")]
    if items == [""]:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    if "" in items:
        raise argparse.ArgumentTypeError(f"--prompt-ids has an empty item (item {items.index('') + 1} of {text!r}); "
                                         "give comma-separated token ids, e.g. 1,2,3")
    bad = next((x for x in items if not re.fullmatch(r"-?[0-9]+", x)), None)
    if bad is not None:
        raise argparse.ArgumentTypeError(f"--prompt-ids takes comma-separated integers, got {text!r} ({bad!r} is not one)")
    ids = [int(x) for x in items]
    if min(ids) < 0:
        raise argparse.ArgumentTypeError(f"--prompt-ids takes token ids, which are >= 0, got {min(ids)}")
    return ids


def _prompt(args: argparse.Namespace, tok, model_dir: Path) -> list[int]:
    if args.prompt is not None and args.prompt_ids is not None:
        raise ValueError("give a prompt (text) or --prompt-ids, not both")
    if args.prompt_ids is not None:
        if args.raw or args.system is not None:
            raise ValueError("--raw and --system apply to a text prompt, not to --prompt-ids")
        return args.prompt_ids
    if args.prompt is None:
        raise ValueError("give a prompt (text) or --prompt-ids 1,2,3")
    if tok is None:
        raise ValueError(f"{model_dir} has no tokenizer.json; use --prompt-ids")
    if args.raw:
        if args.system is not None:
            raise ValueError("--system goes into the chat template, which --raw turns off")
        ids = tok.encode(args.prompt)
        if not ids:
            raise ValueError("the prompt is empty (with --raw there is no chat template to add tokens)")
        return ids
    return tok.chat_prompt_ids(args.prompt, system=args.system)


def _controls(args: argparse.Namespace, tok, decoder: str):
    """The grammar --json-schema or --regex asks for (None without either), checked before the weights load."""
    if args.json_schema is None and args.regex is None:
        return None
    from refusion.decoding import Controls, grammar, registry

    if args.json_schema is not None and args.regex is not None:
        raise ValueError("give --json-schema or --regex, not both")
    if not registry.get(decoder).controls:
        raise ValueError(f"--json-schema and --regex need a decoder that keeps to a grammar exactly "
                         f"({', '.join(registry.with_controls())}), "
                         f"not {decoder}: add --decoder speculative")
    if tok is None:
        raise ValueError("--json-schema and --regex need the model's tokenizer (tokenizer.json)")
    if args.regex is not None:
        return Controls(grammar=grammar.regex(tok, args.regex))
    path = Path(args.json_schema)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"--json-schema {path} is not UTF-8 text") from None
    try:
        return Controls(grammar=grammar.json_schema(tok, text))
    except ValueError as e:
        raise ValueError(f"--json-schema {path}: {e}") from None


def cmd_generate(args: argparse.Namespace) -> None:
    from refusion.model.checkpoint import load_config, load_model
    from refusion.decoding import decode, make_params
    from refusion.decoding.params import check_prompts
    from refusion.runtime import count_parameters, resolve_device, set_threads
    from refusion.model.tokenizer import Tokenizer
    from refusion.cli.view import SlotView

    model_dir = resolve_model_dir(args)
    device = resolve_device(args.device)
    # everything that can be refused is checked before the weights are read
    config = load_config(model_dir)
    tok = Tokenizer.from_dir(model_dir) if (model_dir / "tokenizer.json").exists() else None
    prompt = _prompt(args, tok, model_dir)
    decoder, params = choose_decoder(args, config, model_dir)
    gen_length = make_params(decoder, config, **params).gen_length
    check_prompts(config, [prompt], gen_length)
    controls = _controls(args, tok, decoder)
    model = load_model(model_dir, dtype=args.dtype, device=device, compile=args.compile)
    set_threads(args.threads, count_parameters(model))
    view = None
    if not args.json and not args.no_view and sys.stderr.isatty():
        view = SlotView(tok, len(prompt), gen_length, eos_ids=model.config.eos_ids)
    try:
        res = decode(model, [prompt], decoder, seed=args.seed, on_commit=view.on_commit if view else None,
                     controls=controls, **params)[0]
    finally:
        if view is not None:
            view.close()  # erases the frames: the answer is printed once, below
    text = tok.decode(res.tokens) if tok is not None else None
    if args.json:
        print(json.dumps({**res.to_dict(), "text": text, "decoder": decoder, "model": str(model_dir)}))
        return
    print(text if text is not None else " ".join(map(str, res.tokens)))
    print(f"[{decoder}] {len(res.tokens)} tokens, {res.forwards} forwards, TPF {res.tpf:.2f}, "
          f"{res.tps:.1f} tokens/s, {res.seconds:.2f} s", file=sys.stderr)
    if model.compiled is not None:
        print(f"[compile] {model.compiled.stats.summary()}", file=sys.stderr)
