"""The training loop: one process or many (torchrun), three objectives, exact resume.

    refusion train --config configs/synthetic-scratch.toml --set lr=3e-4 --set max_steps=2000
    torchrun --nproc-per-node 2 -m refusion.cli train --config ...

Every step takes one global batch (the same examples whatever the number of processes), builds the
objective's layout for the whole global batch from one generator, and gives each process its rows;
each process splits its rows into micro-batches (gradient accumulation). Losses are normalised by
the global batch's counts, so N processes x M micro-batches compute the same loss and gradient as
one process with the whole batch. Checkpoints are Hugging Face directories written atomically,
with the optimizer, scheduler, data position and RNG states in training_state.pt: a run killed at
any point and resumed from its last checkpoint continues bit for bit.

Under torchrun the processes share the work in one of two ways (`strategy`): "ddp" keeps the whole
model, its gradients and optimizer state on every process; "fsdp" shards all three over the
processes (refusion.fsdp) and writes sharded checkpoints (refusion.sharded_checkpoint), exported
as a Hugging Face directory at the end.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import random
import shutil
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from refusion.model.checkpoint import DTYPES, STATE_FILE, add_mask_token, load_model, save_model
from refusion.model.config import ModelConfig
from refusion.training.data import DataError, encode_records, filter_by_length, length_batches, train_bpe_tokenizer, training_records
from refusion.model.lora import apply_lora, merged_state_dict
from refusion.model.transformer import Transformer
from refusion.training.objectives import TrainInputs, ar_token_count, build_inputs, compute_loss, make_batch, pad_responses
from refusion.training.run_dir import checkpoints, latest_checkpoint, prune_checkpoints, tensorboard, truncate_metrics, written_by
from refusion.runtime import resolve_device
from refusion.model.tokenizer import Tokenizer
from refusion.training.config import TrainConfig, load_train_config, to_toml  # noqa: F401 (the training API in one place)


# ----------------------------------------------------------------------------------------------
# pieces of the loop


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to lr, then cosine down to lr * min_lr_ratio at max_steps (step counts from 0)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(cfg.max_steps - cfg.warmup_steps, 1)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    # no weight decay on norms, biases and embeddings (the usual choice for transformers)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        embedding = "embed_tokens" in name or "token_rows" in name or "token_head_rows" in name
        (no_decay if p.ndim < 2 or embedding or "norm" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), foreach=True)


def _rows(inputs: TrainInputs, lo: int, hi: int) -> TrainInputs:
    """Rows lo:hi, with the columns cut to the longest of them (padding is always at the end)."""
    T = int((~inputs.pad[lo:hi]).sum(1).max())
    sub = {}
    for f in dataclasses.fields(inputs):
        v = getattr(inputs, f.name)
        if isinstance(v, Tensor) and v.ndim >= 2:
            v = v[lo:hi, ..., :T, :T] if f.name == "attn_mask" else v[lo:hi, :T]
        elif isinstance(v, Tensor):
            v = v[lo:hi]
        sub[f.name] = v
    return TrainInputs(**sub)


def _batch_rows(batch, lo: int, hi: int):
    return dataclasses.replace(batch, prompt_ids=batch.prompt_ids[lo:hi], prompt_len=batch.prompt_len[lo:hi],
                               response_ids=batch.response_ids[lo:hi], response_len=batch.response_len[lo:hi])


def _rng_state() -> dict:
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


# ----------------------------------------------------------------------------------------------
# the trainer


class Trainer:
    """Owns the model, optimizer, data order and checkpoints of one run (one per process)."""

    def __init__(self, cfg: TrainConfig, resume: bool = True, progress: bool = True) -> None:
        self.cfg = cfg.validate()
        self.out = Path(cfg.out_dir)
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.fsdp = cfg.strategy == "fsdp"
        for note in getattr(cfg, "notes", []):
            self._log(note)
        dev = resolve_device(cfg.device)
        if self.fsdp and not dist.is_initialized() and "MASTER_ADDR" not in os.environ:
            raise ValueError("strategy fsdp shards the model over the processes torchrun starts: run it as "
                             "torchrun --nproc-per-node N -m refusion.cli train ... (N = 1 works too); "
                             "without torchrun, train with the default strategy (ddp), which needs no process group")
        distributed = self.world > 1 or self.fsdp  # FSDP needs a process group even for one process
        if distributed and not dist.is_initialized():
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
        if dev.type == "cuda" and distributed:
            dev = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
            torch.cuda.set_device(dev)  # NCCL collectives and FSDP use the current device
        self.device = dev
        self.progress = progress and self.rank == 0
        self.micro = cfg.micro_batch_size or max(cfg.batch_size // self.world, 1)
        if cfg.batch_size % (self.world * self.micro):
            raise ValueError(f"batch_size {cfg.batch_size} must be a multiple of processes ({self.world}) x "
                             f"micro_batch_size ({self.micro})")
        self.ckpt = latest_checkpoint(self.out)
        if self.ckpt is not None and not resume:
            raise ValueError(f"{self.out} already holds a run ({self.ckpt.name}) and resuming is off (--no-resume): "
                             "choose a new out_dir, or remove this one to start over")
        if self.ckpt is not None and written_by(self.ckpt) != cfg.strategy:
            written = written_by(self.ckpt)
            raise ValueError(f"{self.ckpt} was written with strategy {written}: resume it with --strategy {written} "
                             "(or choose a new out_dir)")
        self.tokenizer = self._tokenizer()
        self.model = self._model()
        self.examples = self._examples()
        self.lengths = [len(e) for e in self.examples]
        self._epoch_batches: tuple[int, list[list[int]]] = (-1, [])
        if len(self.examples) < cfg.batch_size:
            raise DataError(f"only {len(self.examples)} examples after filtering, fewer than batch_size {cfg.batch_size}")
        self.optimizer = make_optimizer(self.model, cfg)
        self.layout_gen = torch.Generator().manual_seed(cfg.seed)
        self.step = 0
        if self.ckpt is not None:
            self._load_state(self.ckpt)
        self.ddp = None
        if self.world > 1 and not self.fsdp:
            self.ddp = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    # ---- set-up ---------------------------------------------------------------------

    def _log(self, msg: str) -> None:
        if self.rank == 0:
            print(f"refusion train: {msg}", file=sys.stderr)

    def _tokenizer(self) -> Tokenizer:
        cfg = self.cfg
        if self.ckpt is not None:
            return Tokenizer.from_dir(self.ckpt)
        if cfg.init is not None:
            return Tokenizer.from_dir(cfg.init)
        if cfg.tokenizer is not None:
            return Tokenizer.from_dir(cfg.tokenizer)
        # train a BPE on the data; rank 0 writes it and every process reads the same file
        tok_dir = self.out / "tokenizer"
        if self.rank == 0 and not (tok_dir / "tokenizer.json").exists():
            texts = [t for r in self._records() for t in (r["query"], r["response"])]
            tok = train_bpe_tokenizer(texts, cfg.vocab_size)
            tok_dir.mkdir(parents=True, exist_ok=True)
            tok.save(tok_dir)
            self._log(f"trained a {len(tok)}-token BPE tokenizer -> {tok_dir}")
        if self.world > 1:
            dist.barrier()
        return Tokenizer.from_dir(tok_dir)

    def _records(self) -> list[dict]:
        if not hasattr(self, "_recs"):
            cfg = self.cfg
            self._recs = training_records(cfg.data, cfg.synthetic_examples, cfg.seed, cfg.corpus, cfg.corpus_examples)
            if cfg.corpus is not None:
                self._log(f"data: {cfg.data} + {cfg.corpus_examples} passages of {cfg.corpus}: {len(self._recs)} records")
        return self._recs

    def _model(self) -> Transformer:
        cfg, tok = self.cfg, self.tokenizer
        needs_mask = cfg.objective in ("refusion", "mdm")
        # LoRA resumes from the base weights plus the saved adapters (checkpoints hold merged weights);
        # FSDP from the starting weights, overwritten by the checkpoint's shards once sharded
        start = cfg.init if (cfg.lora or self.fsdp) else (self.ckpt or cfg.init)
        self.new_tokens: list[int] = []  # rows the base model never trained (LoRA trains them too)
        if start is not None:
            model = load_model(start, dtype=torch.float32)
            if needs_mask and model.config.mask_token_id is None:
                mask_id = add_mask_token(model, tok)
                self.new_tokens = [mask_id]
                self._log(f"added the mask token to {cfg.init} (id {mask_id})")
        else:
            if tok.eos_id is None:
                raise DataError("the tokenizer has no eos_token")
            mcfg = ModelConfig(**{"vocab_size": len(tok), "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id,
                                  "mask_token_id": tok.mask_id if needs_mask else None, **cfg.model})
            if mcfg.vocab_size < len(tok):
                raise ValueError(f"model.vocab_size {mcfg.vocab_size} is smaller than the tokenizer ({len(tok)})")
            model = Transformer(mcfg).init_weights(seed=cfg.seed)
        if cfg.max_length > model.config.max_position_embeddings:
            raise ValueError(f"max_length {cfg.max_length} exceeds {start or 'the model'}'s max_position_embeddings "
                             f"{model.config.max_position_embeddings}")
        model.config.bidirectional = cfg.objective == "mdm"
        model.config.training_objective = cfg.objective  # picks the model's default decoder
        if cfg.lora and (self.ckpt is None or self.fsdp):  # FSDP: the adapters must exist before sharding
            self._apply_lora(model)
        model.gradient_checkpointing = cfg.gradient_checkpointing
        if self.fsdp:
            from refusion.training.fsdp import shard_model

            # from the CPU: fully_shard moves each unit's slice to the device as it shards it
            return shard_model(model.train(), self.device, bf16=cfg.dtype == "bfloat16")
        return model.to(self.device).train()

    def _apply_lora(self, model: Transformer) -> None:
        # adapters start from the run's seed, not from whatever the global generator holds: every
        # FSDP process builds its own copy before sharding, and the copies must be the same
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.seed)
            apply_lora(model, self.cfg.lora, self.new_tokens)

    def _examples(self):
        ex = encode_records(self._records(), self.tokenizer)
        kept, dropped = filter_by_length(ex, self.cfg.max_length)
        n_tok = sum(len(e) for e in kept)
        self._log(f"{len(kept)} examples ({n_tok} tokens); dropped {dropped} longer than {self.cfg.max_length} tokens")
        return kept

    # ---- one step -------------------------------------------------------------------

    def batch_indices(self, step: int) -> list[int]:
        per_epoch = len(self.examples) // self.cfg.batch_size
        epoch, i = divmod(step, per_epoch)
        if self._epoch_batches[0] != epoch:  # a pure function of (seed, epoch): built once per epoch
            self._epoch_batches = (epoch, length_batches(self.lengths, self.cfg.batch_size, self.cfg.seed, epoch))
        return self._epoch_batches[1][i]

    def train_step(self) -> dict[str, float]:
        cfg, model = self.cfg, self.ddp or self.model
        idx = self.batch_indices(self.step)
        pad_id = self.tokenizer.pad_id if self.tokenizer.pad_id is not None else 0
        batch = make_batch([self.examples[i].prompt for i in idx], [self.examples[i].response for i in idx], pad_id)
        if cfg.objective == "mdm" and cfg.mdm_eos_pad_to:
            batch = pad_responses(batch, self.model.config.eos_ids[0], cfg.mdm_eos_pad_to)
        kw = {} if cfg.objective == "ar" else {"eps": cfg.eps}
        if cfg.objective == "refusion":
            kw["slot_sizes"] = tuple(cfg.slot_sizes)
        mask_id = self.model.config.mask_token_id
        t0 = time.perf_counter()
        inputs = build_inputs(cfg.objective, batch, mask_id if mask_id is not None else -1, self.layout_gen, **kw)
        layout_s = time.perf_counter() - t0
        n_ar, B = ar_token_count(inputs), len(idx)
        for g in self.optimizer.param_groups:
            g["lr"] = lr_at(self.step, cfg)
        # this process's rows, in micro-batches
        per_rank = B // self.world
        starts = range(self.rank * per_rank, (self.rank + 1) * per_rank, self.micro)
        totals: dict[str, Tensor] = {}
        tokens = 0
        # FSDP's bf16 is its mixed precision policy (refusion.fsdp), not autocast
        autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16) if cfg.dtype == "bfloat16" and not self.fsdp
                    else nullcontext())
        for k, lo in enumerate(starts):
            sub = _rows(inputs, lo, lo + self.micro).to(self.device)
            sub_batch = _batch_rows(batch, lo, lo + self.micro).to(self.device)
            tokens += int((~sub.pad).sum())
            last = k == len(starts) - 1
            # DDP reduces once, after the last micro-batch. FSDP reduce-scatters after every one:
            # its gradients then stay sharded between micro-batches instead of whole on every process
            sync = nullcontext() if (self.ddp is None or last) else self.ddp.no_sync()
            with sync:
                with autocast:
                    # causal objectives: padding is at the end, so plain causal attention is exact there
                    mask = sub.attn_mask if sub.attention == "bidirectional" else None
                    logits = model(sub.input_ids, sub.position_ids, mask)
                loss, stats = compute_loss(cfg.objective, logits, sub, sub_batch, n_ar.to(self.device), B)
                # DDP and FSDP average gradients over processes; the global loss is their sum
                (loss * self.world).backward()
            for key, v in stats.items():
                totals[key] = totals.get(key, 0) + v
        params = [p for p in self.model.parameters() if p.requires_grad]
        if cfg.grad_clip <= 0:
            grad_norm = torch.tensor(0.0)
        elif self.fsdp:
            from refusion.training.fsdp import clip_grad_norm

            grad_norm = clip_grad_norm(params, cfg.grad_clip)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        out = {k: v.float() for k, v in totals.items() if "loss" in k}
        if self.world > 1:  # the global batch's loss is the sum of the processes' parts
            vec = torch.stack([out[k] for k in sorted(out)] + [torch.tensor(float(tokens))]).to(self.device)
            dist.all_reduce(vec)
            out = dict(zip(sorted(out), vec[:-1]))
            tokens = int(vec[-1])
        rec = {k: float(v) for k, v in out.items()}
        rec.update(step=self.step, lr=lr_at(self.step - 1, cfg), grad_norm=float(grad_norm), tokens=tokens,
                   layout_s=layout_s)
        return rec

    # ---- checkpoints ----------------------------------------------------------------

    def _state(self) -> bytes:
        s = {"step": self.step, "layout_gen": self.layout_gen.get_state(), "rng": _rng_state(),
             "config": dataclasses.asdict(self.cfg)}
        if self.fsdp:  # weights and optimizer are in the shards; the export rebuilds LoRA's token rows
            s["new_tokens"] = self.new_tokens
        else:
            s["optimizer"] = self.optimizer.state_dict()
            s["lora"] = {k: v for k, v in self.model.state_dict().items() if "lora_" in k}
        buf = io.BytesIO()
        torch.save(s, buf)
        return buf.getvalue()

    def _load_state(self, path: Path) -> None:
        s = torch.load(path / STATE_FILE, weights_only=False)
        rng = s["rng"]
        if self.fsdp:
            from refusion.training.sharded_checkpoint import load_sharded

            # a process the checkpoint did not have (more processes now) starts from rank 0's states
            rng = load_sharded(path, self.model, self.optimizer) or rng
        else:
            if self.cfg.lora:
                self._apply_lora(self.model)
                self.model.load_state_dict(s["lora"], strict=False)
                self.model.to(self.device)
                self.optimizer = make_optimizer(self.model, self.cfg)
            self.optimizer.load_state_dict(s["optimizer"])
        self.layout_gen.set_state(s["layout_gen"])
        _set_rng_state(rng)
        self.step = s["step"]
        self._log(f"resumed from {path} at step {self.step}")

    def _save_model(self, path: Path, dtype: torch.dtype | None, extra: dict | None) -> None:
        model = self.model
        if self.cfg.lora:  # save the merged weights under the plain names
            model = Transformer(self.model.config)
            model.load_state_dict(merged_state_dict(self.model))
        save_model(model, path, self.tokenizer, dtype=dtype, overwrite=True, extra_files=extra)

    def save_checkpoint(self) -> Path | None:
        path = self.out / f"checkpoint-{self.step}"
        if self.fsdp:  # every process writes its own shards
            from refusion.training.sharded_checkpoint import save_sharded

            save_sharded(path, self.model, self.optimizer, _rng_state(), self.tokenizer,
                         {STATE_FILE: self._state()} if self.rank == 0 else {})
        elif self.rank == 0:
            self._save_model(path, None, {STATE_FILE: self._state()})
        if self.rank != 0:
            return None
        prune_checkpoints(self.out, self.cfg.keep_checkpoints)
        return path

    # ---- the loop -------------------------------------------------------------------

    def fit(self) -> Path:
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        metrics = self.out / "metrics.jsonl"
        if self.rank == 0:
            (self.out / "train_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
            truncate_metrics(metrics, self.step)
        writer = tensorboard(self.out) if self.rank == 0 else None
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=cfg.max_steps, initial=self.step, desc=f"train {cfg.objective}", unit="step",
                       dynamic_ncols=True)
        log = open(metrics, "a") if self.rank == 0 else None
        try:
            end = min(cfg.max_steps, cfg.stop_after or cfg.max_steps)
            while self.step < end:
                t0 = time.perf_counter()
                rec = self.train_step()
                rec["seconds"] = time.perf_counter() - t0
                rec["tokens_per_s"] = rec["tokens"] / rec["seconds"]
                if log is not None:
                    log.write(json.dumps(rec) + "\n")
                    log.flush()
                if writer is not None:
                    for k in ("loss", "ar_loss", "mdm_loss", "lr", "grad_norm", "tokens_per_s"):
                        if k in rec:
                            writer.add_scalar(f"train/{k}", rec[k], self.step)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}")
                if self.step % cfg.save_every == 0 or self.step == end:
                    self.save_checkpoint()
        finally:
            if bar is not None:
                bar.close()
            if log is not None:
                log.close()
            if writer is not None:
                writer.close()
        final = self.out / "model"
        if self.rank == 0 and self.step >= cfg.max_steps:
            if self.fsdp:  # consolidated from the last checkpoint's shards, by this process alone
                from refusion.training.sharded_checkpoint import export_checkpoint

                export_checkpoint(self.out / f"checkpoint-{self.step}", final, DTYPES[cfg.save_dtype], overwrite=True)
            else:
                self._save_model(final, DTYPES[cfg.save_dtype], None)
            self._log(f"saved {final}")
        if self.world > 1:
            dist.barrier()
        return final if self.step >= cfg.max_steps else self.out / f"checkpoint-{self.step}"


def train(cfg: TrainConfig, resume: bool = True, progress: bool = True) -> Path:
    """Train (or resume) a run; returns the final model directory.

    A run that fails before its first checkpoint (a bad option that only shows at step one, data
    that does not fit) leaves no directory behind if it created the directory: a later attempt
    with the same out_dir then starts clean instead of meeting a half-made run.
    """
    out = Path(cfg.out_dir)
    created = not out.exists()
    try:
        return Trainer(cfg, resume=resume, progress=progress).fit()
    except Exception:
        if created and int(os.environ.get("RANK", "0")) == 0 and not checkpoints(out):
            shutil.rmtree(out, ignore_errors=True)
        raise
