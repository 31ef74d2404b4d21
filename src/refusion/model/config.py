"""ModelConfig: one dataclass for the Qwen3 and Llama / Qwen2 families, to and from HF config.json."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# HF architecture name -> (model_type, family defaults that differ between families)
ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
}


TORCH_DTYPES = ("float32", "bfloat16", "float16", "float64")  # config.json's torch_dtype (float64 loads as float32)
OBJECTIVES = ("refusion", "ar", "mdm")  # the training objectives (objectives.py); ModelConfig.training_objective


class ConfigError(ValueError):
    pass


@dataclass
class ModelConfig:
    vocab_size: int = 1024
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None  # None: hidden_size // num_heads
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear", ...} as in HF configs
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    qk_norm: bool = True  # Qwen3: per-head RMSNorm on q and k
    qkv_bias: bool = False  # Qwen2: bias on q, k, v
    o_bias: bool = False  # Llama / Qwen3 attention_bias=True also puts a bias on o_proj
    max_position_embeddings: int = 32768
    model_type: str = "qwen3"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    mask_token_id: int | None = None
    bidirectional: bool = False  # attention of a model trained with the MDM objective
    training_objective: str | None = None  # refusion | ar | mdm, written by `refusion train`; picks the default decoder
    torch_dtype: str = "float32"
    mask_adapter: dict | None = None  # {"rank", "alpha"[, "layers"]}: mask-only adapters (model/mask_adapter.py)
    # the prompt's last token was trained to predict the first response token (an ARM, a ReFusion
    # variant with boundary labels, a mask-adapted LM); otherwise decoders read it from a <|mask|>
    causal_first_token: bool = False
    extra: dict = field(default_factory=dict)  # unknown HF keys, written back unchanged

    def __post_init__(self) -> None:
        # a config.json (or a training config's [model] table) is user input: check types, not just values
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "max_position_embeddings") + (("head_dim",) if self.head_dim is not None else ()):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
        for name in ("rope_theta", "rms_norm_eps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ConfigError(f"{name} must be a number > 0, got {v!r}")
        # a token id outside the vocabulary is never produced or fed: an EOS of -7 would silently never stop
        V = self.vocab_size
        for name in ("bos_token_id", "pad_token_id", "mask_token_id", "eos_token_id"):
            v = getattr(self, name)
            ids = v if name == "eos_token_id" and isinstance(v, list) else [v]
            bad = next((i for i in ids if i is not None and (isinstance(i, bool) or not isinstance(i, int)
                                                             or not 0 <= i < V)), None)
            if bad is not None or (isinstance(v, list) and None in v):
                kind = "a token id or a list of token ids" if name == "eos_token_id" else "a token id"
                raise ConfigError(f"{name} must be {kind} in [0, {V}), got {v!r}")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ConfigError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}; set head_dim")
            self.head_dim = self.hidden_size // self.num_heads
        if self.head_dim % 2:
            raise ConfigError(f"head_dim {self.head_dim} must be even (RoPE rotates pairs of dimensions)")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")
        if self.mask_adapter is not None and self.mask_token_id is None:
            raise ConfigError("mask_adapter needs a mask_token_id (it adapts the mask token's rows)")
        if self.model_type not in ARCHITECTURES.values():
            raise ConfigError(f"unknown model_type {self.model_type!r}; supported: {sorted(ARCHITECTURES.values())}")
        if self.training_objective is not None and self.training_objective not in OBJECTIVES:
            raise ConfigError(f"training_objective must be one of {', '.join(OBJECTIVES)} (or absent), got "
                              f"{self.training_objective!r}")
        if not isinstance(self.torch_dtype, str) or self.torch_dtype.removeprefix("torch.") not in TORCH_DTYPES:
            raise ConfigError(f"torch_dtype must be one of {', '.join(TORCH_DTYPES)}, got {self.torch_dtype!r}")

    @property
    def eos_ids(self) -> list[int]:
        e = self.eos_token_id
        return [] if e is None else [e] if isinstance(e, int) else list(e)

    # ---- Hugging Face config.json ------------------------------------------------

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "ModelConfig":
        arch = (d.get("architectures") or [None])[0]
        model_type = d.get("model_type")
        if arch not in ARCHITECTURES and model_type not in ARCHITECTURES.values():
            raise ConfigError(
                f"unsupported architecture {arch!r} (model_type {model_type!r}); "
                f"refusion loads {', '.join(ARCHITECTURES)}")
        model_type = model_type if model_type in ARCHITECTURES.values() else ARCHITECTURES[arch]
        if d.get("use_sliding_window"):
            raise ConfigError("sliding-window attention (use_sliding_window=true) is not supported")
        # transformers >= 5 nests RoPE settings in rope_parameters; older files use rope_theta / rope_scaling.
        rope = dict(d.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", None) or d.get("rope_theta", 10000.0)
        scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type"))
            if scaling["rope_type"] == "default":
                scaling = None
        attention_bias = bool(d.get("attention_bias", False))
        known = {
            "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling", "rope_parameters",
            "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings", "bos_token_id", "eos_token_id",
            "pad_token_id", "mask_token_id", "bidirectional_attention", "torch_dtype", "dtype", "attention_bias", "hidden_act",
            "training_objective", "mask_adapter", "causal_first_token",
        }
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {d['hidden_act']!r} is not supported (only silu / SwiGLU)")
        try:
            return cls(
                vocab_size=d["vocab_size"],
                hidden_size=d["hidden_size"],
                intermediate_size=d["intermediate_size"],
                num_layers=d["num_hidden_layers"],
                num_heads=d["num_attention_heads"],
                num_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
                head_dim=d.get("head_dim"),
                rope_theta=float(theta),
                rope_scaling=scaling,
                rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                tie_word_embeddings=d.get("tie_word_embeddings", model_type != "llama"),
                qk_norm=model_type == "qwen3",
                qkv_bias=model_type == "qwen2" or attention_bias,
                o_bias=model_type != "qwen2" and attention_bias,
                max_position_embeddings=d.get("max_position_embeddings", 32768),
                model_type=model_type,
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=d.get("eos_token_id"),
                pad_token_id=d.get("pad_token_id"),
                mask_token_id=d.get("mask_token_id"),
                bidirectional=bool(d.get("bidirectional_attention", False)),
                training_objective=d.get("training_objective"),
                mask_adapter=d.get("mask_adapter"),
                causal_first_token=bool(d.get("causal_first_token", False)),
                torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
                extra={k: v for k, v in d.items() if k not in known},
            )
        except KeyError as e:
            raise ConfigError(f"config.json lacks required key {e.args[0]!r}") from None

    def to_hf(self) -> dict[str, Any]:
        arch = {v: k for k, v in ARCHITECTURES.items()}[self.model_type]
        d: dict[str, Any] = dict(self.extra)
        d.update(
            architectures=[arch],
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            torch_dtype=self.torch_dtype,
        )
        if self.model_type != "qwen2":
            d["attention_bias"] = self.qkv_bias
        if self.mask_token_id is not None:
            d["mask_token_id"] = self.mask_token_id
        if self.bidirectional:
            d["bidirectional_attention"] = True
        if self.training_objective is not None:
            d["training_objective"] = self.training_objective
        if self.mask_adapter is not None:
            d["mask_adapter"] = dict(self.mask_adapter)
        if self.causal_first_token:
            d["causal_first_token"] = True
        return d

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
