"""Everything a training run needs before its first step, in one `Run`: the process group and device,
the run directory's checks, tokenizer, model (mask token, LoRA, FSDP or DDP), data, optimizer, and
the state of the checkpoint it resumes from.

    run = setup(cfg)          # one per process; refusion.training.trainer.fit(run) trains it

Every check that can fail (options, out_dir, data, the model's size) fails here, before a step.
"""

from __future__ import annotations

import atexit
import functools
import os
import platform
import random
import sys
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from refusion.files import writing
from refusion.model.checkpoint import (STATE_FILE, add_mask_token, atomic_dir, load_config, load_model,
                                       register_mask_token)
from refusion.model.config import ModelConfig
from refusion.model.lora import apply_lora
from refusion.bundled import resolve_model
from refusion.model.mask_adapter import ADAPTER_WEIGHTS, adapter_parameters, add_mask_adapter, is_adapter_name
from refusion.model.size import check_memory
from refusion.model.tokenizer import Tokenizer
from refusion.model.transformer import Transformer
from refusion.runtime import count_parameters, resolve_device, set_threads
from refusion.training.config import TrainConfig
from refusion.training.config_changes import resume_changes, saved_config
from refusion.training.data import (BatchOrder, DataError, Example, encode_records, filter_by_length,
                                    train_bpe_tokenizer, training_records)
from refusion.training.optimizer import make_optimizer
from refusion.training.run_dir import latest_checkpoint, written_by
from refusion.training.variants import variant_of


@dataclass
class Run:
    """One process's part of a training run; the loop advances `step`, the model and the optimizer."""

    cfg: TrainConfig
    out: Path  # the run directory
    world: int  # processes
    rank: int
    device: torch.device
    micro: int  # micro-batch size: rows per forward and backward
    tokenizer: Tokenizer
    model: Transformer  # the module itself (sharded in place under FSDP)
    new_tokens: list[int]  # rows the base model never trained (LoRA trains them too)
    examples: list[Example]
    order: BatchOrder  # step -> the global batch's example indices
    optimizer: torch.optim.AdamW
    layout_gen: torch.Generator  # draws every objective layout (masks, slots) of the run
    step: int = 0  # optimizer steps taken
    ddp: DistributedDataParallel | None = None  # wraps `model` when several processes each hold all of it
    features: list | None = None  # feature_cache: each example's ExampleFeatures (training/mask_features.py)

    @property
    def fsdp(self) -> bool:
        return self.cfg.strategy == "fsdp"


def log(msg: str) -> None:
    """A note on stderr, from rank 0 only."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"refusion train: {msg}", file=sys.stderr)


def setup(cfg: TrainConfig, resume: bool = True, allow_changed: Collection[str] = (),
          threads: int | None = None) -> Run:
    """Build (or resume) this process's part of the run `cfg` describes. A resumed run's configuration
    may differ from its saved one only in fields config_changes allows (`allow_changed` names those
    it allows on request). `threads`: CPU threads; None applies runtime.set_threads' rule (one for a
    small model)."""
    cfg.validate()
    out = Path(cfg.out_dir)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    for note in getattr(cfg, "notes", []):
        log(note)
    if world > 1 and variant_of(cfg).mask_path:
        raise ValueError(f"the {variant_of(cfg).name} variant trains on one process (its passes are not wired through "
                         "DDP yet): run it without torchrun")
    device = _process_group(cfg, world)
    if cfg.dtype == "bfloat16" and device.type == "cpu" and cpu_bf16_is_emulated():
        log("warning: dtype bfloat16 on this CPU (no AVX512-BF16 or AMX instructions) is emulated and many times "
            "slower than float32; training goes on in bfloat16 as asked: set dtype = \"float32\" (--set "
            "dtype='\"float32\"') to train at full speed")
    micro = cfg.micro_batch_size or max(cfg.batch_size // world, 1)
    if cfg.batch_size % (world * micro):
        raise ValueError(f"batch_size {cfg.batch_size} must be a multiple of processes ({world}) x "
                         f"micro_batch_size ({micro})")
    ckpt = _checkpoint_to_resume(cfg, out, resume, allow_changed)

    # read once, when first needed: only a tokenizer trained on the data needs them before the examples
    @functools.cache
    def records() -> list[dict]:
        if cfg.data == "synthetic" or cfg.data.startswith("tasks:"):
            log(f"generating {cfg.synthetic_examples} examples of {cfg.data}")
        else:
            log(f"reading {cfg.data}")
        recs = training_records(cfg.data, cfg.synthetic_examples, cfg.seed, cfg.corpus, cfg.corpus_examples)
        if cfg.corpus is not None:
            log(f"data: {cfg.data} + {cfg.corpus_examples} passages of {cfg.corpus}: {len(recs)} records")
        return recs

    tokenizer = _tokenizer(cfg, out, ckpt, rank, world, records)
    model, new_tokens = _model(cfg, tokenizer, ckpt, device)
    n_params = count_parameters(model)
    n_threads = set_threads(threads, n_params)
    log(f"{n_params:,} parameters" + (f", {n_threads} CPU thread{'s' if n_threads > 1 else ''}"
                                       if device.type == "cpu" else f" on {device}"))
    examples = _examples(cfg, records(), tokenizer)
    if len(examples) < cfg.batch_size:
        raise DataError(f"only {len(examples)} examples after filtering, fewer than batch_size {cfg.batch_size}")
    run = Run(cfg, out, world, rank, device, micro, tokenizer, model, new_tokens, examples,
              BatchOrder([len(e) for e in examples], cfg.batch_size, cfg.seed, cfg.length_grouping),
              make_optimizer(model, cfg), torch.Generator().manual_seed(cfg.seed))
    if ckpt is not None:
        _resume(run, ckpt)
    if world > 1 and not run.fsdp:
        run.ddp = DistributedDataParallel(run.model, device_ids=[device.index] if device.type == "cuda" else None)
    return run


def _process_group(cfg: TrainConfig, world: int) -> torch.device:
    """Join the processes torchrun started (if any); this process's device."""
    fsdp = cfg.strategy == "fsdp"
    dev = resolve_device(cfg.device)
    if fsdp and not dist.is_initialized() and "MASTER_ADDR" not in os.environ:
        raise ValueError("strategy fsdp shards the model over the processes torchrun starts: run it as "
                         "torchrun --nproc-per-node N -m refusion.cli train ... (N = 1 works too); "
                         "without torchrun, train with the default strategy (ddp), which needs no process group")
    distributed = world > 1 or fsdp  # FSDP needs a process group even for one process
    if distributed and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
        atexit.register(leave_process_group)
    if dev.type == "cuda" and distributed:
        dev = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
        torch.cuda.set_device(dev)  # NCCL collectives and FSDP use the current device
    return dev


def leave_process_group() -> None:
    """Destroy the process group, if any (at exit once setup joined one): a process that exits
    with gloo's threads still running may abort in their destructors, after its work is done."""
    if dist.is_initialized():
        dist.destroy_process_group()


def cpu_bf16_is_emulated() -> bool:
    """True on an x86 CPU without AVX512-BF16 or AMX, where torch emulates bfloat16 matrix products
    (many times slower than float32); False elsewhere, or where torch cannot tell."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return False
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return all(p is not None for p in probes) and not any(p() for p in probes)


def _checkpoint_to_resume(cfg: TrainConfig, out: Path, resume: bool, allow_changed: Collection[str]) -> Path | None:
    ckpt = latest_checkpoint(out)
    if ckpt is not None and not resume:
        raise ValueError(f"{out} already holds a run ({ckpt.name}) and resuming is off (--no-resume): "
                         "choose a new out_dir, or remove this one to start over")
    if ckpt is not None and written_by(ckpt) != cfg.strategy:
        written = written_by(ckpt)
        raise ValueError(f"{ckpt} was written with strategy {written}: resume it with --strategy {written} "
                         "(or choose a new out_dir)")
    saved = saved_config(out) if ckpt is not None else None
    if saved is not None:  # (a run directory without one, written by hand, is taken as it is)
        changes = resume_changes(saved, cfg, allow_changed)
        if changes:
            log(f"resuming with a changed configuration: {', '.join(changes)}")
    return ckpt


def _tokenizer(cfg: TrainConfig, out: Path, ckpt: Path | None, rank: int, world: int,
               records: Callable[[], list[dict]]) -> Tokenizer:
    if ckpt is not None and not mask_only(cfg):  # a mask-only checkpoint holds the adapters alone
        return Tokenizer.from_dir(ckpt)
    if cfg.init is not None:
        return Tokenizer.from_dir(resolve_model(cfg.init))
    if cfg.tokenizer is not None:
        return Tokenizer.from_dir(cfg.tokenizer)
    # train a BPE on the data; rank 0 writes it and every process reads the same file
    tok_dir = out / "tokenizer"
    if rank == 0 and not (tok_dir / "tokenizer.json").exists():
        texts = [t for r in records() for t in (r["query"], r["response"])]
        log(f"training a BPE tokenizer on {len(texts) // 2} records")
        tok = train_bpe_tokenizer(texts, cfg.vocab_size)
        # whole or not at all: a resumed run takes a tokenizer.json as finished
        with writing(tok_dir), atomic_dir(tok_dir, overwrite=True) as tmp:
            tok.save(tmp)
        log(f"trained a {len(tok)}-token BPE tokenizer -> {tok_dir}")
    if world > 1:
        dist.barrier()
    return Tokenizer.from_dir(tok_dir)


def _model(cfg: TrainConfig, tok: Tokenizer, ckpt: Path | None, device: torch.device) -> tuple[Transformer, list[int]]:
    """The model to train, on its device (sharded under FSDP), and the token rows it adds."""
    fsdp = cfg.strategy == "fsdp"
    needs_mask = cfg.objective in ("refusion", "mdm") or cfg.mask_token
    # LoRA resumes from the base weights plus the saved adapters (checkpoints hold merged weights),
    # mask-only from the base plus the saved mask path (checkpoints hold nothing else); FSDP from the
    # checkpoint's shards, or the starting weights
    start = cfg.init if (cfg.lora or fsdp or mask_only(cfg)) else (ckpt or cfg.init)
    # FSDP where the weights come from files (a Hugging Face directory, a checkpoint): built on the
    # meta device, sharded, then each process reads its own slices (training/fsdp.py)
    on_meta = fsdp and (ckpt is not None or start is not None)
    new_tokens: list[int] = []
    mask_rows = None
    if on_meta:
        mc = load_config(resolve_model(start)) if start is not None else _new_config(cfg, tok, needs_mask)
        if needs_mask and mc.mask_token_id is None:
            mask_rows = register_mask_token(mc, tok)
            new_tokens = [mask_rows.token_id]
        with torch.device("meta"):
            model = Transformer(mc)
    elif start is not None:
        log(f"loading {start}")
        model = load_model(resolve_model(start), dtype=torch.float32)
        if needs_mask and model.config.mask_token_id is None:
            new_tokens = [add_mask_token(model, tok)]
    else:
        log("building a new model")
        model = _new_model(cfg, tok, needs_mask)
    if new_tokens:
        log(f"added the mask token to {cfg.init} (id {new_tokens[0]})")
    if cfg.max_length > model.config.max_position_embeddings:
        raise ValueError(f"max_length {cfg.max_length} exceeds {start or 'the model'}'s max_position_embeddings "
                         f"{model.config.max_position_embeddings}")
    model.config.bidirectional = cfg.objective == "mdm"
    model.config.training_objective = cfg.objective  # picks the model's default decoder
    # every objective but the paper's trains the prompt's last token to predict the first response token
    # (add_mask_token marks a causal base so; the paper's objective then makes its mask answer it)
    model.config.causal_first_token = (cfg.objective == "ar" or variant_of(cfg).name != "paper"
                                       or (model.config.causal_first_token and not new_tokens))
    if cfg.lora and (ckpt is None or fsdp):  # FSDP: the adapters must exist before sharding
        apply_seeded_lora(model, cfg, new_tokens)
    if variant_of(cfg).mask_path and model.config.mask_adapter is None:
        add_mask_adapter(model, cfg.mask_adapter or {}, gen=torch.Generator().manual_seed(cfg.seed))
        spec = model.config.mask_adapter
        where = f"the top {spec['layers']} blocks" if "layers" in spec else "every block"
        log(f"added a mask path (rank {spec['rank']} adapters on mask rows only, on {where})")
    if mask_only(cfg):  # the base is frozen: no gradient, no optimizer state, no graph for clean rows
        for name, p in model.named_parameters():  # (feature_cache: the mask embedding too)
            p.requires_grad_(is_adapter_name(name) and not (cfg.feature_cache and name == "mask_embedding"))
    model.gradient_checkpointing = cfg.gradient_checkpointing
    if fsdp:
        from refusion.training.fsdp import load_hf_shards, shard_model

        model = shard_model(model.train(), device, bf16=cfg.dtype == "bfloat16", offload=cfg.cpu_offload)
        if on_meta and ckpt is None:  # (resuming: the checkpoint's shards fill it, in _resume)
            log(f"loading {start}, each process its own slices")
            load_hf_shards(model, resolve_model(start), mask_rows, device)
        return model, new_tokens
    return model.to(device).train(), new_tokens


def mask_only(cfg: TrainConfig) -> bool:
    return cfg.objective == "refusion" and variant_of(cfg).name == "mask-only"


def _new_config(cfg: TrainConfig, tok: Tokenizer, needs_mask: bool) -> ModelConfig:
    """A fresh model's config: cfg.model's shape, the tokenizer's vocabulary and special tokens."""
    if tok.eos_id is None:
        raise DataError("the tokenizer has no eos_token")
    mcfg = ModelConfig(**{"vocab_size": len(tok), "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id,
                          "mask_token_id": tok.mask_id if needs_mask else None, **cfg.model})
    if mcfg.vocab_size < len(tok):
        raise ValueError(f"model.vocab_size {mcfg.vocab_size} is smaller than the tokenizer ({len(tok)})")
    return mcfg


def _new_model(cfg: TrainConfig, tok: Tokenizer, needs_mask: bool) -> Transformer:
    """A model from scratch, drawn from the run's seed."""
    mcfg = _new_config(cfg, tok, needs_mask)
    # float32 weights, gradients and two Adam moments: refuse a shape this machine cannot hold
    check_memory(mcfg, bytes_per_parameter=16, what="the model this config describes")
    return Transformer(mcfg).init_weights(seed=cfg.seed)


def apply_seeded_lora(model: Transformer, cfg: TrainConfig, new_tokens: list[int]) -> None:
    # adapters start from the run's seed, not from whatever the global generator holds: every
    # FSDP process makes its own copy before sharding, and the copies must be the same. On a meta
    # model they are made on the CPU (with the values a real one gets; sharding keeps them)
    meta = model.embed_tokens.weight.is_meta
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        apply_lora(model, cfg.lora, new_tokens, device="cpu" if meta else None)


def _examples(cfg: TrainConfig, records: list[dict], tok: Tokenizer) -> list[Example]:
    log(f"tokenizing {len(records)} records")
    kept, dropped = filter_by_length(encode_records(records, tok), cfg.max_length)
    n_tok = sum(len(e) for e in kept)
    log(f"{len(kept)} examples ({n_tok} tokens); dropped {dropped} longer than {cfg.max_length} tokens")
    return kept


# ----------------------------------------------------------------------------------------------
# resuming: the state refusion.training.checkpointing writes into every checkpoint


def rng_state() -> dict:
    s = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def _set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def _older_layout(path: Path, what: str) -> str:
    return (f"cannot resume {path}: it was written by refusion 0.1, which kept q/k/v and gate/up as separate "
            f"weights (and LoRA through peft), so {what} cannot be loaded; finish that run with refusion 0.1, "
            f"or start a new run from its weights with --init {path} --out NEW_DIR")


def _resume(run: Run, path: Path) -> None:
    """Continue from checkpoint `path`: weights (where the model was not loaded from it), optimizer,
    step, layout generator and random number generators, exactly as they were when it was written.
    AdamW's betas and weight decay are the configuration's (the saved ones, unless a resume changed them)."""
    log(f"resuming from {path}")
    hyper = [{k: g[k] for k in ("betas", "weight_decay")} for g in run.optimizer.param_groups]
    s = torch.load(path / STATE_FILE, weights_only=False)
    rng = s["rng"]
    if run.fsdp:
        from refusion.training.sharded_checkpoint import load_sharded

        written = len(list(path.glob("rng-*.pt")))  # one per process that wrote it
        if written != run.world:  # the global batch, its layouts and the schedule do not depend on it
            log(f"{path.name} was written by {written} processes, resumed by {run.world}: DCP reshards its weights "
                "and optimizer state")
        # a process the checkpoint did not have starts from rank 0's states: a step draws nothing
        # from the global generators (its layouts come from layout_gen) but LoRA dropout, whose masks
        # depend on which rows a process holds anyway
        rng = load_sharded(path, run.model, run.optimizer) or rng
    else:
        if mask_only(run.cfg):
            load_mask_path(run.model, path)
        if run.cfg.lora:
            apply_seeded_lora(run.model, run.cfg, run.new_tokens)
            unknown = sorted(set(s["lora"]) - set(run.model.state_dict()))
            if unknown:  # peft's names (refusion 0.1): load_state_dict(strict=False) would drop them
                raise ValueError(_older_layout(path, f"its adapter weights ({unknown[0]}, ...)"))
            run.model.load_state_dict(s["lora"], strict=False)
            run.model.to(run.device)
            run.optimizer = make_optimizer(run.model, run.cfg)
        try:
            run.optimizer.load_state_dict(s["optimizer"])
        except ValueError:  # parameter groups of another size: separate q/k/v and gate/up (refusion 0.1)
            raise ValueError(_older_layout(path, "its optimizer state")) from None
    for g, h in zip(run.optimizer.param_groups, hyper):
        g.update(h)
    run.layout_gen.set_state(s["layout_gen"])
    _set_rng_state(rng)
    run.step = s["step"]


def load_mask_path(model: Transformer, ckpt: Path) -> None:
    """The mask path's weights from a mask-only checkpoint (its ADAPTER_WEIGHTS), in place."""
    from safetensors.torch import load_file

    saved = load_file(str(ckpt / ADAPTER_WEIGHTS))
    with torch.no_grad():
        for name, p in adapter_parameters(model):
            p.copy_(saved[name])
