"""What a resumed run may change in its configuration.

A run directory's train_config.json records the TrainConfig its checkpoints were trained with. A
resume (`refusion train` into a directory with checkpoints) compares the new configuration with it,
field by field, and each field is in one of three groups:

    FIXED       what the run trains: the model's shape, its starting weights, tokenizer, objective,
                adapters, sharding. Never changes within a run: train into a new out_dir.
    ON_REQUEST  how it trains from the resumed step on: data, batches, schedule, optimizer, arithmetic.
                Refused unless named in allow_changed (`--allow-changed FIELD,...`); the message says
                what each change does.
    FREE        nothing the steps compute: when and where to save and stop, the device, how a global
                batch is split into micro-batches or packed into rows (the same sums, rounded
                differently), recomputing activations, where FSDP keeps its shards (cpu_offload: the
                same step, on the host's kernels). Taken as they are, with a note.

out_dir is not compared (a run directory may be moved). A field the file lacks (written before the
field existed) counts as having its default.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection
from pathlib import Path

from refusion.model.config import ConfigError
from refusion.training.config import TrainConfig

FIXED = ("objective", "variant", "mask_adapter", "mask_token", "init", "model", "tokenizer", "vocab_size", "lora",
         "strategy", "feature_cache", "feature_phases")

_SCHEDULE = "the learning rate follows the new schedule (it jumps where the two schedules differ)"
# field -> what changing it does from the resumed step on
ON_REQUEST = {
    "data": "the batches come from the new examples",
    "synthetic_examples": "the batches come from the new examples",
    "corpus": "the batches come from the new examples",
    "corpus_examples": "the batches come from the new examples",
    "max_length": "the batches come from the examples that fit the new length",
    "seed": "the batches follow another order (examples of this epoch may repeat or be skipped)",
    "length_grouping": "the batches follow another order (examples of this epoch may repeat or be skipped)",
    "batch_size": "each step takes a batch of the new size, in the order a run of that size would have "
                  "(examples of this epoch may repeat or be skipped)",
    "slot_sizes": "the objective lays out its examples differently",
    "eps": "the objective masks at other rates",
    "mask_loss_weight": "the mask term weighs differently against the next-token term",
    "mask_target": "the masks learn from other targets",
    "mdm_eos_pad_to": "the objective pads responses differently",
    "max_steps": "the run ends at the new max_steps, and since the cosine schedule spans max_steps, " + _SCHEDULE,
    "lr": _SCHEDULE,
    "min_lr_ratio": _SCHEDULE,
    "warmup_steps": _SCHEDULE,
    "weight_decay": "AdamW decays with the new weight_decay (its moments carry over)",
    "betas": "AdamW averages with the new betas (its moments carry over)",
    "grad_clip": "gradients are clipped at the new norm",
    "dtype": "the forward and backward run in the new dtype (the weights and optimizer stay float32)",
}

FREE = ("stop_after", "save_every", "keep_checkpoints", "save_dtype", "device", "micro_batch_size",
        "gradient_checkpointing", "pack", "cpu_offload")
NOT_COMPARED = ("out_dir",)

CONFIG_FILE = "train_config.json"


def check_allow_changed(names: Collection[str]) -> None:
    """Refuse, before any work, an allow_changed that names no field or a field that can never change."""
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    for name in names:
        if name not in known:
            raise ConfigError(f"--allow-changed {name}: no such training option (fields that may change on "
                              f"request: {', '.join(ON_REQUEST)})")
        if name in FIXED:
            raise ConfigError(f"--allow-changed {name}: {name} sets what the run trains and cannot change within "
                              "a run; train into a new --out")


def saved_config(out: Path) -> dict | None:
    """The configuration recorded in run directory `out`, None when it has none."""
    path = out / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not the JSON of a training configuration ({e}): restore it, or remove it "
                          "to resume without comparing configurations") from None
    if not isinstance(saved, dict):
        raise ConfigError(f"{path} is not the JSON of a training configuration (a {type(saved).__name__})")
    return saved


def resume_changes(saved: dict, cfg: TrainConfig, allow_changed: Collection[str] = ()) -> list[str]:
    """The fields where `cfg` differs from the `saved` configuration, as `name old -> new`, when every
    change is FREE or allowed; otherwise a ConfigError that lists them and says what to do."""
    changes: dict[str, str] = {}
    for f in dataclasses.fields(TrainConfig):
        if f.name in NOT_COMPARED:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        old, new = saved.get(f.name, default), getattr(cfg, f.name)
        if old != new:
            changes[f.name] = _difference(f.name, old, new)
    listed = ", ".join(changes.values())
    fixed = [n for n in changes if n in FIXED]
    if fixed:
        raise ConfigError(f"cannot resume {cfg.out_dir} with another configuration ({listed}): "
                          f"{', '.join(fixed)} set{'s' if len(fixed) == 1 else ''} what the run trains and cannot "
                          "change within a run; train into a new --out")
    refused = [n for n in changes if n in ON_REQUEST and n not in allow_changed]
    if refused:
        effects = "; ".join(f"{n}: {ON_REQUEST[n]}" for n in refused)
        raise ConfigError(f"cannot resume {cfg.out_dir} with a changed configuration ({listed}). From the resumed "
                          f"step on, {effects}. To accept, pass --allow-changed {','.join(refused)}; to start over, "
                          "choose a new --out")
    return list(changes.values())


def _difference(name: str, old, new) -> str:
    """`name old -> new`; for two tables, only their keys that differ (`model.num_layers 2 -> 3`)."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = [k for k in {**old, **new} if old.get(k) != new.get(k)]
        return ", ".join(f"{name}.{k} {json.dumps(old.get(k))} -> {json.dumps(new.get(k))}" for k in keys)
    return f"{name} {json.dumps(old)} -> {json.dumps(new)}"
