"""`refusion ...` subcommands: argument parsing only; the work is done by the library."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .decoding import DECODERS
from .fetch import FetchError, cache_dir


BUNDLED = Path(__file__).parent / "assets" / "refusion-tiny"


def default_model_dir() -> Path:
    """The model `refusion generate` runs when none is named: the small ReFusion model shipped in
    the package (configs/refusion-tiny.toml is its recipe) or, where it is absent, SmolLM2-135M-
    Instruct imported from its GGUF package on first use (autoregressive decoding only)."""
    if (BUNDLED / "config.json").exists():
        return BUNDLED
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


def decoder_params(args: argparse.Namespace, decoder: str) -> dict:
    """The flags that belong to `decoder`, as keyword arguments of refusion.decoding.decode."""
    if decoder in ("refusion", "refusion-l2r"):
        return dict(gen_length=args.gen_length, slot_size=args.slot_size, serial_blocks=args.serial_blocks,
                    slot_threshold=args.slot_threshold, token_threshold=args.token_threshold,
                    temperature=args.temperature, recompute_kv=args.recompute_kv)
    if decoder == "speculative":
        return dict(gen_length=args.gen_length, draft_length=args.draft_length, mask_length=args.mask_length,
                    adaptive=not args.fixed_widths, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, accept_prob=args.accept_prob)
    if decoder in ("mdm", "mdm-threshold"):
        p = dict(gen_length=args.gen_length, block_length=args.block_length, temperature=args.temperature,
                 prefix_cache=args.prefix_cache, steps=args.steps or args.gen_length)
        if decoder == "mdm-threshold":
            p["threshold"] = args.threshold
        return p
    return dict(max_new_tokens=args.gen_length, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


def cmd_generate(args: argparse.Namespace) -> None:
    from .checkpoint import load_model
    from .decoding import decode
    from .tokenizer import Tokenizer
    from .view import SlotView

    model_dir = Path(args.model) if args.model else default_model_dir()
    model = load_model(model_dir, dtype=args.dtype, device=args.device)
    tok = Tokenizer.from_dir(model_dir) if (model_dir / "tokenizer.json").exists() else None
    decoder = args.decoder or ("refusion" if model.config.mask_token_id is not None else "ar")
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
    view = None
    if not args.json and not args.no_view and sys.stderr.isatty():
        view = SlotView(tok, len(prompt), args.gen_length)
    res = decode(model, [prompt], decoder, seed=args.seed, on_commit=view.on_commit if view else None,
                 **decoder_params(args, decoder))[0]
    text = tok.decode(res.tokens) if tok is not None else None
    if args.json:
        print(json.dumps({**res.to_dict(), "text": text, "decoder": decoder, "model": str(model_dir)}))
        return
    if view is not None:
        view.close()
    print(text if text is not None else " ".join(map(str, res.tokens)))
    print(f"[{decoder}] {len(res.tokens)} tokens, {res.forwards} forwards, TPF {res.tpf:.2f}, "
          f"{res.tps:.1f} tokens/s, {res.seconds:.2f} s", file=sys.stderr)


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


def add_decoder_flags(g: argparse.ArgumentParser) -> None:
    """--decoder and every decoder's parameters (shared by generate and eval)."""
    g.add_argument("--decoder", choices=DECODERS, help="default: refusion if the model has a mask token, else ar")
    g.add_argument("--gen-length", type=int, default=128, help="tokens to generate (at most)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--seed", type=int, default=0)
    s = g.add_argument_group("self-speculative (speculative): greedy output identical to ar, several tokens per forward")
    s.add_argument("--draft-length", type=int, default=16, help="most draft tokens verified per forward (0: plain AR)")
    s.add_argument("--mask-length", type=int, help="masks fed per forward to draft ahead (default: draft width + 1)")
    s.add_argument("--fixed-widths", action="store_true",
                   help="always feed --draft-length drafts (default: each sequence's width follows its acceptance)")
    s.add_argument("--accept-prob", type=float,
                   help="lossy: also accept a draft token whose probability is at least this (default: exact)")
    r = g.add_argument_group("plan-and-infill (refusion, refusion-l2r)")
    r.add_argument("--slot-size", type=int, default=8)
    r.add_argument("--serial-blocks", type=int, default=1)
    r.add_argument("--slot-threshold", type=float, default=0.9)
    r.add_argument("--token-threshold", type=float, default=0.4)
    r.add_argument("--recompute-kv", action="store_true", help="recompute infilled slots' KV (ablation)")
    m = g.add_argument_group("masked diffusion (mdm, mdm-threshold)")
    m.add_argument("--block-length", type=int, default=32)
    m.add_argument("--steps", type=int, help="total denoising steps for mdm (default: gen-length)")
    m.add_argument("--threshold", type=float, default=0.9, help="confidence threshold for mdm-threshold")
    m.add_argument("--prefix-cache", action="store_true", help="reuse the prompt's and finished blocks' KV")
    a = g.add_argument_group("sampling (ar, speculative; with --temperature > 0)")
    a.add_argument("--top-k", type=int)
    a.add_argument("--top-p", type=float)


def cmd_eval(args: argparse.Namespace) -> None:
    from .checkpoint import load_model
    from .evaluate import EvalConfig, evaluate, result_stem
    from .tasks import get_task
    from .tokenizer import Tokenizer

    model_dir = Path(args.model) if args.model else default_model_dir()
    model = load_model(model_dir, dtype=args.dtype, device=args.device)
    tok = Tokenizer.from_dir(model_dir)
    decoder = args.decoder or ("refusion" if model.config.mask_token_id is not None else "ar")
    name = args.label or model_dir.name
    out = Path(args.out)
    for task_name in args.task.split(","):
        task = get_task(task_name)
        cfg = EvalConfig(decoder=decoder, params=decoder_params(args, decoder), n=args.n, split=args.split,
                         batch_size=args.batch_size, seed=args.seed, system=args.system, tag=args.tag)
        stem = result_stem(name, task_name, cfg.label)
        summary = evaluate(model, tok, task, cfg, model_name=name, records_path=out / f"{stem}.jsonl",
                           progress=not args.no_progress)
        (out / f"{stem}.json").write_text(json.dumps(summary, indent=2))
        lo, hi = summary["ci95"]
        print(f"{name} {task_name} {summary['decoder']}: accuracy {100 * summary['accuracy']:.1f}% "
              f"[{100 * lo:.1f}, {100 * hi:.1f}] over {summary['n']}, {summary['tps']:.1f} tokens/s, "
              f"TPF {summary['tpf']:.2f} -> {out / stem}.json")


def cmd_report(args: argparse.Namespace) -> None:
    from .report import report

    print(report(args.paths, out=args.out, plot=args.plot))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="refusion", description="ReFusion: train, decode, evaluate.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a response to a prompt")
    g.add_argument("prompt", nargs="?", help="prompt text (the chat template is applied unless --raw)")
    g.add_argument("--model", help="Hugging Face model directory (default: the bundled default model)")
    g.add_argument("--prompt-ids", type=_parse_ids, help="exact prompt token ids, e.g. 1,2,3")
    g.add_argument("--system", help="system message for the chat template")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    add_decoder_flags(g)
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

    e = sub.add_parser("eval", help="evaluate a model on tasks with a decoder (accuracy and speed)")
    e.add_argument("--model", help="model directory (default: the bundled default model)")
    e.add_argument("--task", required=True, help="task name(s), comma-separated (see refusion.tasks)")
    e.add_argument("--n", type=int, help="number of samples (default: the whole split)")
    e.add_argument("--split", default="test")
    e.add_argument("--batch-size", type=int, default=1)
    e.add_argument("--system", help="system message for the chat template")
    e.add_argument("--label", help="model name in the results (default: the directory name)")
    e.add_argument("--tag", help="suffix for the decoder name, to tell parameter settings apart")
    e.add_argument("--out", default="results", help="directory for <model>__<task>__<decoder>.json/.jsonl")
    e.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    e.add_argument("--device", default="cpu")
    e.add_argument("--no-progress", action="store_true")
    add_decoder_flags(e)
    e.set_defaults(func=cmd_eval)

    rp = sub.add_parser("report", help="markdown table and accuracy-vs-speed plot from eval results")
    rp.add_argument("paths", nargs="+", help="result directories or summary .json files")
    rp.add_argument("--out", help="write the markdown here too")
    rp.add_argument("--plot", help="write the accuracy-vs-TPS plot here (PNG; needs matplotlib)")
    rp.set_defaults(func=cmd_report)

    from . import train
    from .serve import command as serve
    from .tasks import sources

    train.add_parser(sub)
    sources.add_parser(sub)
    serve.add_parser(sub)
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
