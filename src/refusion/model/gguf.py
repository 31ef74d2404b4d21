"""Import a Llama-architecture GGUF file (llama.cpp's format) as a Hugging Face model directory.

The `gguf` package reads and dequantizes the tensors. What we add is the inverse of llama.cpp's
HF->GGUF converter: tensor names, the q/k row permutation, config.json from the metadata, and a
`tokenizers` byte-level BPE rebuilt from the stored vocabulary and merges. The result loads in
transformers as LlamaForCausalLM.

    import_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "runs/smollm2")
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import gguf  # optional dependency: pip install "refusion[gguf]"
import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tqdm import tqdm

from refusion.files import writing
from refusion.model.checkpoint import _atomic_dir, _commit_dir
from refusion.model.fetch import smollm2_gguf_file
from refusion.model.tokenizer import Tokenizer

# llama.cpp tensor names -> HF LlamaForCausalLM names ("blk.{i}." becomes "model.layers.{i}.")
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
CONTROL, USER_DEFINED = 3, 4

# tokenizer.ggml.pre -> how text is split before BPE. llama.cpp's "smollm"/"starcoder" isolate every digit
# and then apply GPT-2's regex (their original tokenizer.json: Digits + ByteLevel); "gpt2" is GPT-2's regex alone.
DIGIT_SPLIT_PRE = {"smollm", "starcoder"}
PLAIN_PRE = {"gpt2", "default"}


def _open(path: Path) -> gguf.GGUFReader:
    """A GGUFReader for a llama GGUF, or a one-line ValueError saying what is wrong."""
    if not path.exists():
        raise ValueError(f"GGUF file {path} does not exist; pass the path of a llama.cpp .gguf model file")
    if not path.is_file():
        raise ValueError(f"{path} is a directory, not a GGUF file; pass the path of a llama.cpp .gguf model file")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (no 'GGUF' magic at its start); "
                             "pass a llama.cpp .gguf model file")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # truncated or corrupt files raise anything from ValueError to IndexError
        raise ValueError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); "
                         "re-download or re-convert it") from None
    arch = reader.fields["general.architecture"].contents() if "general.architecture" in reader.fields else None
    if arch != "llama":
        raise ValueError(f"{path} holds a {arch!r} model; only 'llama' architecture GGUF files can be imported")
    return reader


def _f32(x: float) -> float:
    # GGUF stores floats as f32; write their shortest f32 spelling (1e-05, not 9.999999747378752e-06).
    return float(str(np.float32(x)))


def _hf_name(name: str) -> str:
    base, suffix = name.rsplit(".", 1)
    if base.startswith("blk."):
        _, i, part = base.split(".", 2)
        if part in LAYER_NAMES and suffix == "weight":
            return f"model.layers.{i}.{LAYER_NAMES[part]}.weight"
    elif base in TOP_NAMES and suffix == "weight":
        return f"{TOP_NAMES[base]}.weight"
    raise ValueError(f"GGUF tensor {name!r} has no Hugging Face Llama equivalent "
                     "(biases and rope_freqs, i.e. Llama-3.1 RoPE scaling, are not supported)")


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation. HF rotates the two halves of each head (x[:d/2], x[d/2:])
    as RoPE pairs, llama.cpp rotates adjacent rows (x0, x1), so its converter reorders each head's rows
    from (2, d/2) to (d/2, 2). Swap back."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _config(meta: dict[str, Any], tied: bool, dtype: torch.dtype) -> dict[str, Any]:
    a = lambda k, default=None: meta.get(f"llama.{k}", default)  # noqa: E731
    if a("rope.scaling.type", "none") not in ("none", "linear"):
        raise ValueError(f"RoPE scaling {a('rope.scaling.type')!r} is not supported; "
                         "only plain and linear RoPE GGUFs can be imported")
    d, n_head = a("embedding_length"), a("attention.head_count")
    head_dim = a("attention.key_length", d // n_head)
    if a("rope.dimension_count", head_dim) != head_dim:
        raise ValueError(f"partial RoPE (rope.dimension_count {a('rope.dimension_count')} < head_dim {head_dim}) "
                         "is not supported")
    factor = a("rope.scaling.factor")
    return dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=a("vocab_size", len(meta["tokenizer.ggml.tokens"])),
        hidden_size=d,
        intermediate_size=a("feed_forward_length"),
        num_hidden_layers=a("block_count"),
        num_attention_heads=n_head,
        num_key_value_heads=a("attention.head_count_kv", n_head),
        head_dim=head_dim,
        hidden_act="silu",
        rms_norm_eps=_f32(a("attention.layer_norm_rms_epsilon")),
        rope_theta=_f32(a("rope.freq_base", 10000.0)),
        rope_scaling={"rope_type": "linear", "factor": _f32(factor)} if a("rope.scaling.type") == "linear" else None,
        max_position_embeddings=a("context_length"),
        tie_word_embeddings=tied,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        torch_dtype=str(dtype).removeprefix("torch."),
    )


def _tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """tokenizer.json + tokenizer_config.json contents for a GPT-2 style (byte-level BPE) GGUF vocabulary."""
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported; "
                         "only 'gpt2' (byte-level BPE) vocabularies can be imported")
    if pre not in DIGIT_SPLIT_PRE | PLAIN_PRE:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported (known: {sorted(DIGIT_SPLIT_PRE | PLAIN_PRE)})")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    # Byte-level vocabularies are stored already spelled in GPT-2's byte alphabet ("Ġ" for a space),
    # so vocab and merges go to the BPE model as they are.
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False, byte_fallback=False))
    space = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=space, use_regex=True)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if pre in DIGIT_SPLIT_PRE else byte_level)
    tok.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, ...) are matched whole and skipped when decoding; user-defined ones
    # are matched whole but decoded.
    added = lambda kind, special: [AddedToken(t, special=special, normalized=False)  # noqa: E731
                                   for t, y in zip(tokens, types) if y == kind]
    tok.add_special_tokens(added(CONTROL, True))
    tok.add_tokens(added(USER_DEFINED, False))

    name = lambda key: tokens[meta[key]] if key in meta else None  # noqa: E731
    bos, eos = name("tokenizer.ggml.bos_token_id"), name("tokenizer.ggml.eos_token_id")
    add_bos, add_eos = bool(meta.get("tokenizer.ggml.add_bos_token")), bool(meta.get("tokenizer.ggml.add_eos_token"))
    b, e = [bos] * (add_bos and bos is not None), [eos] * (add_eos and eos is not None)
    if b or e:  # llama.cpp adds these around every encoded text; HF does it in the post-processor
        seq = lambda s: [*b, s, *e]  # noqa: E731
        tok.post_processor = processors.TemplateProcessing(
            single=seq("$A"), pair=seq("$A") + [f"{t}:1" for t in seq("$B")],
            special_tokens=[(t, tok.token_to_id(t)) for t in {*b, *e}])
    cfg = dict(
        tokenizer_class="PreTrainedTokenizerFast",
        bos_token=bos, eos_token=eos, pad_token=name("tokenizer.ggml.padding_token_id"),
        unk_token=name("tokenizer.ggml.unknown_token_id"),
        add_bos_token=add_bos, add_eos_token=add_eos, clean_up_tokenization_spaces=False,
        model_max_length=meta.get("llama.context_length"), chat_template=meta.get("tokenizer.chat_template"),
    )
    return Tokenizer(tok, {k: v for k, v in cfg.items() if v is not None})


def import_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32,
                overwrite: bool = False) -> Path:
    """Dequantize a llama GGUF into `out_dir`: config.json, model.safetensors (in `dtype`), tokenizer
    files and generation_config.json. Written to a temporary directory first, then renamed into place."""
    path, out_dir = Path(gguf_path), Path(out_dir)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype {dtype} is not supported; use torch.float32, torch.bfloat16 or torch.float16")
    reader = _open(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    n_head = meta["llama.attention.head_count"]
    n_kv = meta.get("llama.attention.head_count_kv", n_head)
    tmp = _atomic_dir(out_dir, overwrite)  # fails fast on a non-empty out_dir, before the slow part
    try:
        sd: dict[str, torch.Tensor] = {}
        for t in tqdm(reader.tensors, desc=f"importing {path.name}", unit="tensor"):
            name = _hf_name(t.name)
            shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # ggml lists dims fastest-first
            w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(shape))
            if t.name.endswith("attn_q.weight"):
                w = unpermute_qk(w, n_head)
            elif t.name.endswith("attn_k.weight"):
                w = unpermute_qk(w, n_kv)
            sd[name] = w.to(dtype).contiguous()
        tied = "lm_head.weight" not in sd  # llama.cpp drops output.weight when it equals token_embd
        cfg = _config(meta, tied, dtype)
        tokenizer = _tokenizer(meta)
        gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg[k] is not None}
        with writing(out_dir):  # a full disk: one line naming the directory
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
            save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            tokenizer.save(tmp)
            (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
            _commit_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def import_smollm2(out_dir: str | Path, dtype: torch.dtype = torch.float32, overwrite: bool = False) -> Path:
    """SmolLM2-135M-Instruct (the Q4_1 GGUF from refusion.model.fetch) as a Hugging Face directory."""
    return import_gguf(smollm2_gguf_file(), out_dir, dtype=dtype, overwrite=overwrite)
