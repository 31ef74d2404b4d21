"""`refusion train`: a TrainConfig from a file and overrides, then the trainer."""

from __future__ import annotations

import argparse
import json

from refusion.cli.args import SMALL_MODEL_THREADS, positive_int
from refusion.training.config import defaults_text


def add_parser(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("train", help="train a ReFusion (or AR / MDM baseline) model",
                       description="Train with a config file (TOML or YAML) of TrainConfig fields and overrides.\n"
                                   "Resumes from the newest checkpoint in out_dir, with the configuration it was\n"
                                   "trained with (out_dir/train_config.json): other values of the fields that\n"
                                   "set the model are refused, those that change how it trains need\n"
                                   "--allow-changed. One training at a time uses an out_dir (out_dir/.lock).\n"
                                   "Under torchrun, data parallel over the processes: whole copies (ddp) or\n"
                                   "sharded (fsdp). A run resumes on another number of processes (another\n"
                                   "machine): point the new run at the same out_dir with another\n"
                                   "--nproc-per-node; a step's global batch does not depend on it (fsdp's\n"
                                   "sharded checkpoints are resharded on load).",
                       epilog="Every TrainConfig field (refusion/training/config.py) can be set in the config file\n"
                              "or with --set; --print-config prints them all, resolved, as TOML. Defaults:\n\n"
                              + defaults_text())
    t.add_argument("--config", help="a TOML or YAML file of TrainConfig fields")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field (JSON value), e.g. --set lr=3e-4 --set model.num_layers=2")
    t.add_argument("--objective", choices=("refusion", "ar", "mdm"), help="training objective")
    t.add_argument("--init", help="start from this checkpoint directory, or a model name (smollm2)")
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
    t.add_argument("--allow-changed", action="append", default=[], metavar="FIELD[,FIELD]",
                   help="resume although these fields differ from the run's saved configuration, e.g. "
                        "--allow-changed max_steps,lr: fields that change how the run trains from the resumed step "
                        "on (refusing one names it and says what it does). The model's shape, init, tokenizer, "
                        "objective, variant, lora and strategy never change in a run; stop_after, save_every, "
                        "device, micro_batch_size and the like need no flag")
    t.add_argument("--print-config", action="store_true", help="print the resolved config as TOML and exit")
    t.add_argument("--plan", action="store_true",
                   help="print what the run needs per process (weights, gradients, AdamW state, activations; "
                        "ddp and fsdp, with and without activation checkpointing and CPU offload), tokens per "
                        "step, steps per epoch and whether it fits, then exit. Reads only init's config.json: "
                        "nothing is built, trained or downloaded")
    t.add_argument("--nproc", type=positive_int,
                   help="--plan: processes per node (default: torchrun's LOCAL_WORLD_SIZE / WORLD_SIZE, else 1)")
    t.add_argument("--nodes", type=positive_int, help="--plan: nodes (default: from torchrun's environment, else 1)")
    t.add_argument("--device-memory", metavar="SIZE",
                   help="--plan: memory of each process's device, e.g. 80GB (10^9 bytes), 80GiB, 81559MiB")
    t.add_argument("--json", action="store_true", help="--plan: print the plan as JSON")
    t.add_argument("--threads", type=positive_int, help=f"CPU threads (default: {SMALL_MODEL_THREADS})")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> None:
    from refusion.training.config import load_train_config, to_toml

    overrides = list(args.set)
    for name in ("objective", "init", "data", "out_dir", "max_steps", "strategy"):
        v = getattr(args, name)
        if v is not None:
            overrides.append(f"{name}={json.dumps(v)}")
    if args.plan:
        _print_plan(args, overrides)
        return
    for flag in ("nproc", "nodes", "device_memory", "json"):
        if getattr(args, flag) not in (None, False):
            raise ValueError(f"--{flag.replace('_', '-')} goes with --plan")
    cfg = load_train_config(args.config, overrides)
    if args.print_config:
        print(to_toml(cfg), end="")
        return
    from refusion.training.trainer import train

    allow = [name.strip() for item in args.allow_changed for name in item.split(",") if name.strip()]
    final = train(cfg, resume=not args.no_resume, progress=not args.no_progress, allow_changed=allow,
                  threads=args.threads)
    print(final)



def _print_plan(args: argparse.Namespace, overrides: list[str]) -> None:
    from refusion.training.config import load_train_config
    from refusion.training.plan import default_processes, make_plan, parse_memory, plan_table, read_model_config

    # the data and the weights need not be here yet: only init's config.json is read
    cfg = load_train_config(args.config, overrides, check_files=False)
    memory = parse_memory(args.device_memory) if args.device_memory is not None else None
    mc, source = read_model_config(cfg.init, cfg)
    nproc, nodes = default_processes()
    p = make_plan(cfg, mc, args.nproc or nproc, args.nodes or nodes, memory, source)
    print(json.dumps(p, indent=1) if args.json else plan_table(p))
