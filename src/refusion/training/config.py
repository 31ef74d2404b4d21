"""TrainConfig: every training option, read from a TOML or YAML file plus key=value overrides, and
checked (types, ranges, files that must exist) before a run directory is created.

Kept apart from train.py so that reading, checking and printing a configuration needs no torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from refusion.bundled import is_model_name
from refusion.model.config import OBJECTIVES, ConfigError, ModelConfig

SAVE_DTYPES = ("float32", "bfloat16", "float16")
STRATEGIES = ("ddp", "fsdp")
LORA_KEYS = {"r", "alpha", "dropout", "target_modules"}
MAX_SEED = 2**63 - 1
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class TrainConfig:
    # what to train
    objective: str = "refusion"  # refusion | ar | mdm
    variant: str | None = None  # of the refusion objective (variants.py): None = DEFAULT_VARIANT (hybrid); paper, ...
    mask_adapter: dict | None = None  # decoupled, mask-only: {"rank", "alpha", "layers"} of the mask path (default
    #                                   rank 16, every block)
    feature_cache: bool = False  # mask-only: freeze the mask embedding, compute the clean tokens and the blocks below
    #                              the adapted ones once per example, train the adapted blocks alone on those
    #                              features (training/mask_features.py); mask_adapter.layers says how many
    feature_phases: int = 4  # feature_cache: block phases (sets of cut points) computed per example
    mask_target: str = "token"  # mask-only: what each mask learns to predict, its token ("token") or the frozen
    #                             base's next-token distribution at its position ("distribution": distillation)
    mask_token: bool = False  # give the model a mask token even where the objective needs none (an ARM
    #                           whose vocabulary, and so whose softmax, matches its ReFusion siblings')
    init: str | None = None  # a checkpoint directory or a model name (refusion.bundled); None: a fresh model
    model: dict = field(default_factory=dict)  # ModelConfig fields of a fresh model
    tokenizer: str | None = None  # a directory with tokenizer.json for a fresh model; None: train a BPE
    vocab_size: int = 1024  # of the BPE trained on the data when `tokenizer` is None
    # data
    data: str = "synthetic"  # a JSON / JSONL file of {"query", "response"}, "synthetic", or "tasks:sort,add,..."
    synthetic_examples: int = 20000  # examples generated for "synthetic" or "tasks:..." data
    corpus: str | None = None  # general text mixed into `data`: "stdlib" (refusion.training.corpus); None: none
    corpus_examples: int = 20000  # passages of `corpus` added to the data
    max_length: int = 512  # prompt + response tokens; longer examples are dropped (and counted)
    slot_sizes: list[int] = field(default_factory=lambda: [4, 8, 16, 32])
    eps: float = 1e-3
    mask_loss_weight: float = 1.0  # refusion objective: loss = AR + mask_loss_weight * MDM (1: the paper's loss)
    mdm_eos_pad_to: int | None = None  # MDM only: EOS-pad responses to this length (LLaDA SFT), e.g. the eval gen_length
    # optimisation
    batch_size: int = 16  # examples per optimizer step, over all processes
    micro_batch_size: int | None = None  # examples per forward per process; None: batch_size / processes
    pack: bool = False  # several examples per row (training/packing.py): each micro-batch's examples are packed,
    #                     longest first, into rows as long as its longest example, attention block-diagonal over
    #                     them; the same examples, layouts and loss as unpacked, fewer padding columns computed.
    #                     Not with the decoupled and mask-only variants (a second pass over each example's cache)
    length_grouping: bool = True  # batches of examples of similar length (little padding to save); false: batches
    #                               of random examples, which pack = true then spares most of the padding
    max_steps: int = 1000
    stop_after: int | None = None  # end this invocation after this step; the schedule still spans max_steps
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 100  # more than max_steps: scaled to a tenth of max_steps (with a note)
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0  # 0: no clipping
    dtype: str = "float32"  # float32 | bfloat16 (autocast)
    gradient_checkpointing: bool = False
    strategy: str = "ddp"  # under torchrun: ddp (whole model on every process) | fsdp (weights, grads, Adam state sharded)
    cpu_offload: bool = False  # fsdp: the shards (weights, grads, Adam state) in host memory, the step on the CPU
    lora: dict | None = None  # e.g. {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    seed: int = 0
    # output
    out_dir: str = "runs/refusion"
    save_every: int = 200
    keep_checkpoints: int = 2
    save_dtype: str = "float32"  # of the final model (checkpoints stay float32 for exact resume)
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps

    def validate(self, check_files: bool = True) -> "TrainConfig":
        """Check every field; returns self. A warm-up longer than the run is scaled to a tenth of it
        (the note says so), so that `--max-steps 50` works with the default warm-up. check_files:
        also that the data, init and tokenizer exist (a plan, made before they are downloaded, skips it)."""
        if not hasattr(self, "notes"):  # validate() runs more than once; notes stay (not a field: not saved)
            self.notes: list[str] = []
        for f in dataclasses.fields(self):
            _check_type(f.name, getattr(self, f.name), f.type)
        self._check_numbers()
        if self.warmup_steps > self.max_steps:
            scaled = self.max_steps // 10
            self.notes.append(f"warmup_steps {self.warmup_steps} is more than max_steps {self.max_steps}: "
                              f"warm-up scaled to {scaled} steps (a tenth of the run)")
            self.warmup_steps = scaled
        self._check_model()
        if self.lora is not None:
            _check_lora(self.lora)
        self._check_variant()
        if check_files:
            _check_paths(self)
        if self.device != "auto":
            from refusion.runtime import resolve_device  # imports torch: only when a device is named

            resolve_device(self.device)
        return self

    def _check_numbers(self) -> None:
        """The choices and every number's range."""
        _choice("objective", self.objective, OBJECTIVES)
        _choice("dtype", self.dtype, ("float32", "bfloat16"))
        _choice("strategy", self.strategy, STRATEGIES)
        _choice("save_dtype", self.save_dtype, SAVE_DTYPES)
        if self.corpus is not None:
            from refusion.training.corpus import CORPORA

            _choice("corpus", self.corpus, CORPORA)
        for name in ("batch_size", "max_steps", "max_length", "save_every", "keep_checkpoints", "synthetic_examples",
                     "vocab_size", "micro_batch_size", "stop_after", "mdm_eos_pad_to", "corpus_examples",
                     "feature_phases"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"{name} must be >= 1, got {v}")
        if not self.slot_sizes or any(s < 1 for s in self.slot_sizes):
            raise ConfigError(f"slot_sizes must be a non-empty list of integers >= 1, got {self.slot_sizes}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"lr must be a finite number > 0, got {self.lr}")
        for name, lo, hi in (("min_lr_ratio", 0, 1), ("eps", 0, 1)):
            v = getattr(self, name)
            if not lo <= v <= hi:
                raise ConfigError(f"{name} must lie in [{lo}, {hi}], got {v}")
        if not (math.isfinite(self.mask_loss_weight) and self.mask_loss_weight > 0):
            raise ConfigError(f"mask_loss_weight must be a finite number > 0, got {self.mask_loss_weight}")
        if self.mask_loss_weight != 1.0 and self.objective != "refusion":
            raise ConfigError(f"mask_loss_weight weighs the refusion objective's mask term; objective "
                              f"{self.objective!r} has none: drop it or set objective = \"refusion\"")
        for name in ("weight_decay", "grad_clip"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"{name} must be a finite number >= 0, got {v}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"betas must be two numbers in [0, 1), got {self.betas}")
        if self.cpu_offload and self.strategy != "fsdp":
            raise ConfigError("cpu_offload moves FSDP's shards (weights, gradients, AdamW state) to host memory: it "
                              f"needs strategy fsdp (--strategy fsdp under torchrun), not {self.strategy}")
        if self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.seed <= MAX_SEED:  # torch's generators take at most 64 bits, signed in places
            raise ConfigError(f"seed must be an integer in [0, 2**63 - 1], got {self.seed}")

    def _check_variant(self) -> None:
        from refusion.model.mask_adapter import check_adapter_config
        from refusion.training.variants import variant_of

        if self.variant is not None and self.objective != "refusion":
            raise ConfigError(f"variant {self.variant!r} is a variant of the refusion objective, not of {self.objective!r}")
        v = variant_of(self)
        if v.mask_path and self.mask_loss_weight != 1.0:
            raise ConfigError(f"mask_loss_weight: the {v.name} variant trains its mask path on its own parameters, "
                              "whose gradient a weight only rescales (AdamW undoes it): drop mask_loss_weight")
        if self.mask_adapter is not None:
            if not v.mask_path:
                raise ConfigError("mask_adapter sizes the decoupled and mask-only variants' mask path; set "
                                  "variant = \"mask-only\" (or \"decoupled\") or drop mask_adapter")
            check_adapter_config(self.mask_adapter)
        if v.name == "decoupled" and (self.lora is not None or self.strategy == "fsdp"):
            raise ConfigError("the decoupled variant trains the whole shared model plus its own mask path: "
                              "it does not combine with lora or strategy fsdp")
        if self.pack and v.name in ("decoupled", "mask-only"):
            raise ConfigError(f"pack: the {v.name} variant runs its masks in a second pass on top of each example's "
                              "own cache, which packed rows do not keep apart; set pack = false (or another variant)")
        if v.name == "mask-only":
            if self.init is None:
                raise ConfigError("the mask-only variant adapts a pretrained model: set init (a model directory "
                                  "or a name such as smollm2)")
            if self.lora is not None or self.strategy == "fsdp" or self.gradient_checkpointing:
                raise ConfigError("the mask-only variant trains its adapters on top of a frozen model: it does not "
                                  "combine with lora, strategy fsdp or gradient_checkpointing")
        if self.mask_target not in ("token", "distribution"):
            raise ConfigError(f"mask_target must be \"token\" or \"distribution\", got {self.mask_target!r}")
        if self.mask_target != "token" and (v.name != "mask-only" or self.feature_cache):
            raise ConfigError("mask_target = \"distribution\" distils the frozen base's next-token distribution "
                              "into the masks: it needs variant = \"mask-only\" without feature_cache")
        if self.feature_cache:
            if v.name != "mask-only":
                raise ConfigError("feature_cache trains a mask-only adapter on features of a frozen model: set "
                                  "variant = \"mask-only\" (or drop feature_cache)")
            if self.feature_phases > max(self.slot_sizes):
                raise ConfigError(f"feature_phases {self.feature_phases} is more than the block of "
                                  f"max(slot_sizes) = {max(self.slot_sizes)} has cut points")

    def _check_model(self) -> None:
        """The starting point (init, or a fresh model's table) and the data source."""
        if self.init is not None and (self.model or self.tokenizer is not None):
            # they describe a fresh model; one started from a checkpoint would ignore them without a word
            which = "model" if self.model else "tokenizer"
            raise ConfigError(f"{which} describes a fresh model; init {self.init} brings its own (drop one of them)")
        from refusion.training.data import task_names

        task_names(self.data)  # a "tasks:..." source names known tasks (one-line error otherwise)
        known = [f.name for f in dataclasses.fields(ModelConfig) if f.name != "extra"]
        unknown = set(self.model) - set(known)
        if unknown:
            raise ConfigError(f"unknown model fields: {', '.join(sorted(unknown))} (known: {', '.join(known)})")
        try:
            # a fresh model's table, checked now rather than after a tokenizer has been trained
            mc = ModelConfig(**{"vocab_size": max(self.vocab_size, 1), **self.model})
        except ConfigError as e:
            raise ConfigError(f"model: {e}") from None
        if self.init is None and self.max_length > mc.max_position_embeddings:
            raise ConfigError(f"max_length {self.max_length} exceeds the model's max_position_embeddings "
                              f"{mc.max_position_embeddings}: lower max_length or raise model.max_position_embeddings")


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


_KINDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
          "dict": "a table", "list[int]": "a list of integers", "list[float]": "a list of numbers", "None": "unset"}


def _is(value, kind: str) -> bool:
    if kind == "None":
        return value is None
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    if kind == "dict":
        return isinstance(value, dict)
    if kind.startswith("list[") and isinstance(value, list):
        return all(_is(v, kind[5:-1]) for v in value)
    return False


def _check_type(name: str, value, annotation: str) -> None:
    kinds = [k.strip() for k in str(annotation).split("|")]
    if not any(_is(value, k) for k in kinds):
        want = " or ".join(_KINDS.get(k, k) for k in kinds)
        raise ConfigError(f"{name} must be {want}, got {value!r}")


def _check_lora(lora: dict) -> None:
    unknown = set(lora) - LORA_KEYS
    if unknown:
        raise ConfigError(f"lora: unknown keys {', '.join(sorted(unknown))} (known: {', '.join(sorted(LORA_KEYS))})")
    r = lora.get("r", 8)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ConfigError(f"lora.r must be an integer >= 1, got {r!r}")
    for key, lo, hi in (("alpha", 0, math.inf), ("dropout", 0, 1)):
        v = lora.get(key, 0.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v < hi:
            raise ConfigError(f"lora.{key} must be a number in [{lo}, {hi}), got {v!r}")
    targets = lora.get("target_modules", ["q_proj"])
    if not isinstance(targets, list) or not targets or any(t not in LORA_TARGETS for t in targets):
        raise ConfigError(f"lora.target_modules must be a list of {', '.join(LORA_TARGETS)}, got {targets!r}")


def _check_paths(cfg: TrainConfig) -> None:
    if cfg.data != "synthetic" and not cfg.data.startswith("tasks:"):
        p = Path(cfg.data)
        if not p.exists():
            raise ConfigError(f"data {cfg.data}: no such file (a JSON / JSONL file of records, \"synthetic\" or "
                              f"\"tasks:NAME,...\")")
        if not p.is_file():
            raise ConfigError(f"data {cfg.data} is a directory, not a JSON or JSONL file of records")
    for name, must_hold in (("init", "config.json"), ("tokenizer", "tokenizer.json")):
        v = getattr(cfg, name)
        if v is None or (name == "init" and is_model_name(v)):
            continue
        p = Path(v)
        if not p.is_dir():
            raise ConfigError(f"{name} {v}: {'not a directory' if p.exists() else 'no such directory'}")
        if not (p / must_hold).is_file():
            raise ConfigError(f"{name} {v} has no {must_hold}")
    out = Path(cfg.out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out_dir {cfg.out_dir} is a file, not a directory")


# ----------------------------------------------------------------------------------------------
# files and overrides


def _parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # a bare string


def read_config_file(path: str | Path) -> dict:
    """The table of a TOML or YAML config file; errors name the file (and the line, where known)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    if not path.is_file():
        raise ConfigError(f"config file {path} is a directory")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if path.suffix == ".toml":
        import tomllib

        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML ({e})") from None
    elif path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
            what = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigError(f"{where}: invalid YAML ({what})") from None
        raw = {} if raw is None else raw
    else:
        raise ConfigError(f"config file {path}: use .toml, .yaml or .yml")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a table of TrainConfig fields at the top level, got a "
                          f"{type(raw).__name__}")
    return raw


def load_train_config(path: str | Path | None = None, overrides: list[str] = (), check_files: bool = True
                      ) -> TrainConfig:
    """A TrainConfig from a TOML or YAML file, then `key=value` overrides (values parsed as JSON,
    else taken as strings; `model.hidden_size=128` sets a field of the model table). check_files:
    see TrainConfig.validate."""
    raw: dict = read_config_file(path) if path is not None else {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set takes key=value, got {item!r}")
        *parents, leaf = key.strip().split(".")
        d = raw
        for i, p in enumerate(parents):
            d = d.setdefault(p, {})
            if not isinstance(d, dict):
                raise ConfigError(f"--set {key}: {'.'.join(parents[:i + 1])} is not a table")
        d[leaf] = _parse_value(value)
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    unknown = set(raw) - set(names)
    if unknown:
        raise ConfigError(f"unknown training options: {', '.join(sorted(unknown))} (known: {', '.join(names)})")
    return TrainConfig(**raw).validate(check_files)


def to_toml(cfg: TrainConfig) -> str:
    """The configuration as a TOML file that load_train_config reads back (unset options commented)."""
    lines, tables = [], []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if isinstance(v, dict) and v:
            tables.append((f.name, v))
        elif v is None or v == {}:
            lines.append(f"# {f.name} =  (unset)")
        else:
            lines.append(f"{f.name} = {_toml_value(v)}")
    for name, table in tables:
        lines += ["", f"[{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def defaults_text() -> str:
    """Every field's default, one indented `name = value` line each (`refusion train --help`)."""
    out = []
    for f in dataclasses.fields(TrainConfig):
        v = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out.append(f"  {f.name} = {'(unset)' if v is None else _toml_value(v)}")
    return "\n".join(out)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"no TOML form for {v!r}")
