"""Hugging Face checkpoint directories: load, save (atomically), and add the mask token.

A directory holds config.json, model.safetensors (or shards + model.safetensors.index.json),
tokenizer files and generation_config.json, readable by `transformers` as Qwen3ForCausalLM,
Qwen2ForCausalLM or LlamaForCausalLM. `mask_token_id` is kept in config.json.

Tensor names on disk are Hugging Face's; the model fuses some projections (transformer.fused_parts):
to_hf and from_hf translate, and every state that is read or written as a checkpoint goes through
them.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from refusion.model.compiled import enable_compile
from refusion.model.config import ConfigError, ModelConfig
from refusion.model.size import check_memory
from refusion.model.transformer import Transformer, fused_parts
from refusion.model.tokenizer import MASK_TOKEN, Tokenizer

INDEX = "model.safetensors.index.json"
STATE_FILE = "training_state.pt"  # a training checkpoint's optimizer, data position and RNG states
SHARDED_DIR = "dcp"  # a sharded (FSDP) training checkpoint's weights: refusion.training.sharded_checkpoint
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    pass


def _hf_key(name: str) -> str:
    return name if name.startswith("lm_head.") else "model." + name


def to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The model's state under Hugging Face names: each fused projection split into its parts
    (views, by rows), "model." before everything but the LM head."""
    fused = fused_parts(cfg)
    out = {}
    for name, t in sd.items():
        module, _, leaf = name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        if proj not in fused:
            out[_hf_key(name)] = t
            continue
        parts = fused[proj]
        for (part, _), piece in zip(parts, t.split([rows for _, rows in parts])):
            out[_hf_key(f"{parent}.{part}.{leaf}")] = piece
    return out


def from_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face names to the model's: the inverse of to_hf (the parts of a fused projection
    concatenated by rows; every part must be there)."""
    fused = fused_parts(cfg)
    owner = {part: (proj, i) for proj, parts in fused.items() for i, (part, _) in enumerate(parts)}
    out, pieces = {}, {}
    for key, t in sd.items():
        name = key.removeprefix("model.")
        module, _, leaf = name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        if proj not in owner:
            out[name] = t
            continue
        whole, i = owner[proj]
        fused_name = f"{parent}.{whole}.{leaf}"
        out.setdefault(fused_name, None)  # its place in the order: where its first part was
        pieces.setdefault(fused_name, {})[i] = t
    for name, got in pieces.items():
        parts = fused[name.rsplit(".", 2)[-2]]
        if len(got) != len(parts):
            missing = [part for i, (part, _) in enumerate(parts) if i not in got]
            raise CheckpointError(f"{_hf_key(name)}: the parts {missing} are missing")
        out[name] = torch.cat([got[i] for i in range(len(parts))])
    return out


def load_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    if path.is_file():
        raise CheckpointError(f"{path} is a file; a model is a Hugging Face directory (config.json, model.safetensors, ...)")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    f = path / "config.json"
    if not f.exists():
        raise CheckpointError(f"{path} has no config.json; is it a Hugging Face model directory?")
    d = _read_json(f)
    if not isinstance(d, dict):
        raise CheckpointError(f"{f} holds a JSON {type(d).__name__}, not an object of model settings")
    try:
        return ModelConfig.from_hf(d)
    except ConfigError as e:
        raise CheckpointError(f"{f}: {e}") from None


def _read_json(f: Path):
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{f} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f} is not valid JSON: {e}") from None


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    single, index = path / "model.safetensors", path / INDEX
    if index.exists():
        weight_map = _read_json(index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index} has no \"weight_map\" of tensor names to shard files")
        files = sorted(set(weight_map.values()))
    elif single.exists():
        files = [single.name]
    elif (path / SHARDED_DIR).is_dir():
        raise CheckpointError(f"{path} is a sharded training checkpoint (refusion train --strategy fsdp); "
                              f"export it to a Hugging Face directory first: refusion export {path} OUT")
    else:
        found = ", ".join(sorted(p.name for p in path.iterdir())) or "nothing"
        raise CheckpointError(f"{path} has no model.safetensors or {INDEX} (found: {found})")
    sd: dict[str, torch.Tensor] = {}
    for name in files:
        if not (path / name).is_file():
            raise CheckpointError(f"shard {name} named in {index} is missing from {path}")
        try:
            sd.update(load_file(str(path / name)))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path / name} is not a readable safetensors file: {e}") from None
    return sd


def load_model(path: str | Path, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu",
               require_mask: bool = False, compile: bool = False) -> Transformer:
    """Load a Hugging Face model directory into a refusion Transformer (eval mode).

    compile: inference forwards through torch.compile'd graphs (model/compiled.py: enable_compile;
    its CompileStats are model.compiled.stats). Faster per forward once compiled, but not
    bit-identical to the eager default, so off unless asked for."""
    from refusion.runtime import resolve_device

    device = resolve_device(device)  # before reading the weights: a bad device fails at once
    cfg = load_config(path)
    if require_mask and cfg.mask_token_id is None:
        raise CheckpointError(f"{path}: config.json has no mask_token_id; this needs a ReFusion model "
                              "(convert one with `refusion add-mask-token` or train one)")
    dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    dtype = dtype or DTYPES.get(cfg.torch_dtype.removeprefix("torch."), torch.float32)
    try:  # before the meta model: shapes past torch's sizes would end there in an overflow
        check_memory(cfg, dtype.itemsize, f"the model {Path(path) / 'config.json'} describes")
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    sd = load_state_dict(path)
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = to_hf(model.state_dict(), cfg)  # names and shapes on disk
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    _check_weights(path, sd, expected)
    weights = {k: sd[k].to(dtype) for k in expected}
    check_finite(weights, path)
    model.load_state_dict(from_hf(weights, cfg), strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.reset_rope()  # buffers are not in the file and were built on "meta"
    model = model.to(device).eval()
    if compile:
        enable_compile(model)
    return model


def _check_weights(path: str | Path, sd: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """The file's tensors are the ones config.json implies, by name and shape."""
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(k for k in set(sd) - set(expected) if not k.endswith("rotary_emb.inv_freq"))
    if missing or unexpected:
        raise CheckpointError(f"{path}: weights do not match config.json "
                              f"(missing: {missing[:3]}{'...' if len(missing) > 3 else ''}, "
                              f"unexpected: {unexpected[:3]}{'...' if len(unexpected) > 3 else ''})")
    for k, v in expected.items():
        if sd[k].shape != v.shape:
            raise CheckpointError(f"{path}: {k} has shape {tuple(sd[k].shape)}, config.json implies {tuple(v.shape)}")


def check_finite(weights: dict[str, torch.Tensor], path: str | Path) -> None:
    """Every weight a finite number: a NaN or an inf (a diverged run, a broken file, a value past
    float16's range) decodes to garbage or to nothing, with no error. One reduction per tensor
    (aminmax propagates NaN), no copy."""
    for name, t in weights.items():
        if not t.is_floating_point() or t.numel() == 0:
            continue
        lo, hi = (float(x) for x in torch.aminmax(t))
        if not (math.isfinite(lo) and math.isfinite(hi)):
            what = "NaN" if math.isnan(lo) else "inf"
            raise CheckpointError(f"{path}: {name} holds {what} values (the first tensor that does); the weights "
                                  "are broken (a diverged training run?) and would decode to garbage")


def _atomic_dir(path: Path, overwrite: bool):
    if path.exists() and any(path.iterdir()) and not overwrite:
        raise CheckpointError(f"{path} exists and is not empty; choose another directory or allow overwriting it "
                              "(overwrite=True)")
    path.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))


def _commit_dir(tmp: Path, path: Path) -> None:
    # mkdtemp makes a private (0700) directory: give it the permissions a plain mkdir would have
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    for f in tmp.iterdir():
        if f.is_file():
            os.chmod(f, 0o666 & ~umask)
    # rename is atomic; the old directory (if any) is moved aside first and removed after.
    old = None
    if path.exists():
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_weights(sd: dict[str, torch.Tensor], tmp: Path, max_shard_bytes: int) -> None:
    """model.safetensors, or shards of at most max_shard_bytes and their index."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in sd.items():
        n = v.numel() * v.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += n
    if len(shards) == 1:
        save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(tmp / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(v.numel() * v.element_size() for v in sd.values())
    (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def save_model(model: Transformer, path: str | Path, tokenizer: Tokenizer | None = None,
               dtype: torch.dtype | None = None, max_shard_bytes: int = 2 * 1024**3, overwrite: bool = False,
               extra_files: dict[str, bytes | str] | None = None) -> Path:
    """Write a Hugging Face directory atomically (temporary directory, then rename)."""
    path = Path(path)
    cfg = model.config
    tmp = _atomic_dir(path, overwrite)
    try:
        sd = {}
        for k, v in to_hf(model.state_dict(), cfg).items():
            if cfg.tie_word_embeddings and k == "lm_head.weight":
                continue
            sd[k] = (v.to(dtype) if dtype else v).detach().cpu().contiguous()
        out_dtype = next(iter(sd.values())).dtype
        hf = cfg.to_hf()
        hf["torch_dtype"] = str(out_dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(hf, indent=2))
        _write_weights(sd, tmp, max_shard_bytes)
        gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}
        (tmp / "generation_config.json").write_text(json.dumps({k: v for k, v in gen.items() if v is not None}, indent=2))
        if tokenizer is not None:
            tokenizer.save(tmp)
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data if isinstance(data, bytes) else data.encode())
        _commit_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def check_mask_token(model_config: ModelConfig, tokenizer: Tokenizer, token: str = MASK_TOKEN,
                     force: bool = False) -> None:
    """Refuse what add_mask_token should not do: an empty token, a model that has a mask token
    already, a token that is already a special token of the tokenizer or the model (EOS, BOS, pad,
    unk, a chat marker: the mask would take its place, and EOS would stop ending answers), and
    (unless forced) an ordinary word of the vocabulary, which would stop meaning that word. The
    tokenizer's own mask token (its config's mask_token, or <|mask|>) is fine where nothing uses it
    yet: the published ReFusion tokenizer carries <|mask|> that way."""
    if not token or token.strip() != token:
        raise CheckpointError(f"the mask token must be a non-empty string without surrounding spaces, got {token!r}")
    tid = tokenizer.token_id(token)
    if model_config.mask_token_id is not None:
        if tid == model_config.mask_token_id:
            return  # already this model's mask token: adding it again changes nothing
        raise CheckpointError(f"the model already has a mask token (mask_token_id {model_config.mask_token_id})")
    if tid is None:
        return
    roles = tokenizer.special_roles()
    for role, ids in (("pad", [model_config.pad_token_id]), ("bos", [model_config.bos_token_id]),
                      ("eos", model_config.eos_ids)):
        roles.update({i: role for i in ids if i is not None})
    role = roles.get(tid)
    if role is not None and role != "special":
        raise CheckpointError(f"{token!r} is the {role} token (id {tid}); the mask must be a token of its own: "
                              "choose a new one, e.g. <|mask|>")
    if role == "special" and tid != tokenizer.mask_id:
        raise CheckpointError(f"{token!r} is already a special token of the tokenizer (id {tid}); the mask must be "
                              "a token of its own: choose a new one, e.g. <|mask|>")
    if role is None and not force:
        raise CheckpointError(f"{token!r} is already token {tid} of the vocabulary (an ordinary word); making it "
                              "the mask would change what it means: choose a new token, e.g. <|mask|>, or force it")


def add_mask_token(model: Transformer, tokenizer: Tokenizer, token: str = MASK_TOKEN, force: bool = False) -> int:
    """Give a causal LM a mask token: add it to the tokenizer, grow the embeddings if needed,
    initialise its row(s) to the mean embedding (a neutral start), record mask_token_id, and
    causal_first_token: a model never trained with the mask takes its first response token from the
    prompt's last token, as it always did, not from the untrained mask (training that teaches the
    mask to predict it sets the flag again). Refused as check_mask_token says (force: allow an
    existing ordinary token)."""
    cfg = model.config
    check_mask_token(cfg, tokenizer, token, force)
    if cfg.mask_token_id is not None:
        return cfg.mask_token_id
    (mask_id,) = tokenizer.add_special_tokens([token])
    tokenizer.config["mask_token"] = token
    old = cfg.vocab_size
    if mask_id >= old:
        new = mask_id + 1
        emb = model.embed_tokens
        w = emb.weight.data
        grown = torch.nn.Embedding(new, w.shape[1], device=w.device, dtype=w.dtype)
        grown.weight.data[:old] = w
        grown.weight.data[old:] = w.mean(0, keepdim=True)
        model.embed_tokens = grown
        if cfg.tie_word_embeddings:
            model.lm_head = torch.nn.Linear(w.shape[1], new, bias=False, device=w.device, dtype=w.dtype)
            model.lm_head.weight = grown.weight
        else:
            hw = model.lm_head.weight.data
            head = torch.nn.Linear(hw.shape[1], new, bias=False, device=hw.device, dtype=hw.dtype)
            head.weight.data[:old] = hw
            head.weight.data[old:] = hw.mean(0, keepdim=True)
            model.lm_head = head
        cfg.vocab_size = new
    else:  # the row exists (padded vocabulary) but was never trained: start it from the mean too
        with torch.no_grad():
            n_text = len(tokenizer) - 1
            model.embed_tokens.weight[mask_id] = model.embed_tokens.weight[:n_text].mean(0)
            if not cfg.tie_word_embeddings:
                model.lm_head.weight[mask_id] = model.lm_head.weight[:n_text].mean(0)
    cfg.mask_token_id = mask_id
    cfg.causal_first_token = True
    return mask_id
