"""Hugging Face checkpoint directories: load, save (atomically), and add the mask token.

A directory holds config.json, model.safetensors (or shards + model.safetensors.index.json),
tokenizer files and generation_config.json, readable by `transformers` as Qwen3ForCausalLM,
Qwen2ForCausalLM or LlamaForCausalLM. `mask_token_id` is kept in config.json.

Tensor names on disk are Hugging Face's; the model fuses some projections (transformer.fused_parts):
to_hf and from_hf translate, and every state that is read or written as a checkpoint goes through
them (hf_parts: the parts of one tensor).

For models no process holds whole (FSDP, refusion.training.fsdp): WeightSlices reads a directory's
tensors by rows, register_mask_token is add_mask_token without the weights, and write_model_dir
writes weights that arrive one group at a time, a shard as soon as it is full.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from refusion.files import writing
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


# kept beside the weights: the model's own answers, drafts for speculative decoding (decoding/corpus.py)
LOOKUP_CORPUS = "lookup_corpus.safetensors"

def _hf_key(name: str) -> str:
    return name if name.startswith("lm_head.") else "model." + name


def hf_parts(name: str, cfg: ModelConfig) -> list[tuple[str, int | None]]:
    """The Hugging Face tensors that make the model's tensor `name`, as (key, rows) in row order:
    one key (rows None: all of it), or the parts a fused projection stacks by rows."""
    module, _, leaf = name.rpartition(".")
    parent, _, proj = module.rpartition(".")
    parts = fused_parts(cfg).get(proj)
    if parts is None:
        return [(_hf_key(name), None)]
    return [(_hf_key(f"{parent}.{part}.{leaf}"), rows) for part, rows in parts]


def to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The model's state under Hugging Face names: each fused projection split into its parts
    (views, by rows), "model." before everything but the LM head."""
    out = {}
    for name, t in sd.items():
        parts = hf_parts(name, cfg)
        if len(parts) == 1:
            out[parts[0][0]] = t
            continue
        for (key, _), piece in zip(parts, t.split([rows for _, rows in parts])):
            out[key] = piece
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


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of Hugging Face directory `path`: model.safetensors, or the shards its
    index names (each checked to exist)."""
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
    for name in files:
        if not (path / name).is_file():
            raise CheckpointError(f"shard {name} named in {index} is missing from {path}")
    return [path / name for name in files]


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for f in weight_files(path):
        try:
            sd.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{f} is not a readable safetensors file: {e}") from None
    return sd


class WeightSlices:
    """The tensors of Hugging Face directory `path`, read by ranges of rows: safetensors maps the
    files and reads only the rows asked for, so that a process holding a slice of a model never
    reads the rest. `elements_read` counts what left the files."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.elements_read = 0
        self._file = {}  # tensor name -> the open file that holds it
        for f in weight_files(path):
            try:
                handle = safe_open(str(f), framework="pt")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{f} is not a readable safetensors file: {e}") from None
            self._file.update(dict.fromkeys(handle.keys(), handle))

    def shapes(self) -> dict[str, torch.Tensor]:
        """Every tensor of the files as an empty meta tensor of its shape (nothing is read)."""
        return {k: torch.empty(f.get_slice(k).get_shape(), device="meta") for k, f in self._file.items()}

    def shape(self, key: str) -> list[int]:
        return self._file[key].get_slice(key).get_shape()

    def rows(self, key: str, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows [start, stop) of tensor `key` (all of a 1-d tensor's elements in that range), as `dtype`."""
        t = self._file[key].get_slice(key)[start:stop].to(dtype)
        self.elements_read += t.numel()
        check_finite({key: t}, self.path)
        return t


def load_model(path: str | Path, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu",
               require_mask: bool = False, compile: bool | str = False) -> Transformer:
    """Load a Hugging Face model directory into a refusion Transformer (eval mode).

    compile: inference forwards through torch.compile'd graphs (model/compiled.py: enable_compile;
    its CompileStats are model.compiled.stats). Faster per forward once compiled, but not
    bit-identical to the eager default, so off unless asked for. A string is the compile mode
    (compiled.MODES; True means "default")."""
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
    check_weights(path, sd, expected)
    weights = {k: sd[k].to(dtype) for k in expected}
    check_finite(weights, path)
    model.load_state_dict(from_hf(weights, cfg), strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.reset_rope()  # buffers are not in the file and were built on "meta"
    model = model.to(device).eval()
    model.directory = Path(path)  # where files kept beside the weights are read from (decoding/corpus.py)
    if compile:
        enable_compile(model, mode="default" if compile is True else compile)
    return model


def check_weights(path: str | Path, sd: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
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


@contextlib.contextmanager
def atomic_dir(path: Path, overwrite: bool) -> Iterator[Path]:
    """A temporary directory beside `path` to fill; it becomes `path` (atomically) when the block ends,
    and is removed if the block fails, so `path` is never half-written."""
    tmp = _atomic_dir(path, overwrite)
    try:
        yield tmp
        _commit_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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


def _write_weights(tensors: Iterable[tuple[str, torch.Tensor]], tmp: Path, max_shard_bytes: int) -> torch.dtype:
    """model.safetensors, or shards of at most max_shard_bytes and their index, written as the
    tensors arrive: one shard is in memory at a time. Returns the first tensor's dtype."""
    shards: list[tuple[Path, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    size = total = 0
    dtype = None

    def flush() -> None:
        f = tmp / f".shard-{len(shards)}"  # named once the number of shards is known
        save_file(shard, str(f), metadata={"format": "pt"})
        shards.append((f, list(shard)))

    for k, v in tensors:
        dtype = dtype or v.dtype
        n = v.numel() * v.element_size()
        if shard and size + n > max_shard_bytes:
            flush()
            shard, size = {}, 0
        shard[k] = v
        size += n
        total += n
    flush()
    if len(shards) == 1:
        os.replace(shards[0][0], tmp / "model.safetensors")
        return dtype
    weight_map = {}
    for i, (f, keys) in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(f, tmp / name)
        weight_map.update(dict.fromkeys(keys, name))
    (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return dtype


def save_model(model: Transformer, path: str | Path, tokenizer: Tokenizer | None = None,
               dtype: torch.dtype | None = None, max_shard_bytes: int = 2 * 1024**3, overwrite: bool = False,
               extra_files: dict[str, bytes | str] | None = None) -> Path:
    """Write a Hugging Face directory atomically (temporary directory, then rename)."""
    weights = to_hf(model.state_dict(), model.config).items()
    return write_model_dir(path, model.config, weights, tokenizer, dtype, max_shard_bytes, overwrite, extra_files)


def write_model_dir(path: str | Path, cfg: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]],
                    tokenizer: Tokenizer | None = None, dtype: torch.dtype | None = None,
                    max_shard_bytes: int = 2 * 1024**3, overwrite: bool = False,
                    extra_files: dict[str, bytes | str] | None = None) -> Path:
    """save_model's directory from `weights`, (Hugging Face name, tensor) pairs that may be produced
    one group at a time (refusion.training.sharded_checkpoint's export streams them block by block):
    a shard is written as soon as it is full."""
    path = Path(path)
    # a full disk: one line naming the directory, and no half-written one
    with writing(path), atomic_dir(path, overwrite) as tmp:
        _fill_model_dir(tmp, cfg, weights, tokenizer, dtype, max_shard_bytes, extra_files)
    return path


def _fill_model_dir(tmp: Path, cfg: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]],
                    tokenizer: Tokenizer | None, dtype: torch.dtype | None, max_shard_bytes: int,
                    extra_files: dict[str, bytes | str] | None) -> None:
    """The files of a model directory, written into the temporary directory `tmp`."""
    tied = cfg.tie_word_embeddings
    out_dtype = _write_weights(((k, (v.to(dtype) if dtype else v).detach().cpu().contiguous())
                                for k, v in weights if not (tied and k == "lm_head.weight")), tmp, max_shard_bytes)
    hf = cfg.to_hf()
    hf["torch_dtype"] = str(out_dtype).removeprefix("torch.")
    (tmp / "config.json").write_text(json.dumps(hf, indent=2))
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}
    (tmp / "generation_config.json").write_text(json.dumps({k: v for k, v in gen.items() if v is not None}, indent=2))
    if tokenizer is not None:
        tokenizer.save(tmp)
    for name, data in (extra_files or {}).items():
        (tmp / name).write_bytes(data if isinstance(data, bytes) else data.encode())


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


@dataclass
class MaskRows:
    """Where a new mask token's weights start (register_mask_token): rows `rows` of the embedding,
    and of an untied LM head, are set to the mean of that matrix's rows [:mean_of] (as the file
    holds them: before the vocabulary grew)."""

    token_id: int
    rows: range
    mean_of: int


def register_mask_token(cfg: ModelConfig, tokenizer: Tokenizer, token: str = MASK_TOKEN,
                        force: bool = False) -> MaskRows | None:
    """add_mask_token without the weights: add the token to the tokenizer, record it in `cfg`
    (mask_token_id, causal_first_token, the vocabulary grown where the token needs a new row) and
    return which rows the weights must initialise (None where the model has the token already).
    A model built on the meta device from `cfg` then loads its weights with these rows."""
    check_mask_token(cfg, tokenizer, token, force)
    if cfg.mask_token_id is not None:
        return None
    (mask_id,) = tokenizer.add_special_tokens([token])
    tokenizer.config["mask_token"] = token
    old = cfg.vocab_size
    if mask_id >= old:  # new rows, all at the mean of the existing ones
        mask = MaskRows(mask_id, range(old, mask_id + 1), old)
        cfg.vocab_size = mask_id + 1
    else:  # the row exists (padded vocabulary) but was never trained: start it from the mean of the text rows
        mask = MaskRows(mask_id, range(mask_id, mask_id + 1), len(tokenizer) - 1)
    cfg.mask_token_id = mask_id
    cfg.causal_first_token = True
    return mask


def add_mask_token(model: Transformer, tokenizer: Tokenizer, token: str = MASK_TOKEN, force: bool = False) -> int:
    """Give a causal LM a mask token: add it to the tokenizer, grow the embeddings if needed,
    initialise its row(s) to the mean embedding (a neutral start), record mask_token_id, and
    causal_first_token: a model never trained with the mask takes its first response token from the
    prompt's last token, as it always did, not from the untrained mask (training that teaches the
    mask to predict it sets the flag again). Refused as check_mask_token says (force: allow an
    existing ordinary token)."""
    cfg = model.config
    old = cfg.vocab_size
    mask = register_mask_token(cfg, tokenizer, token, force)
    if mask is None:
        return cfg.mask_token_id
    if cfg.vocab_size > old:
        new = cfg.vocab_size
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
    else:
        with torch.no_grad():
            model.embed_tokens.weight[mask.token_id] = model.embed_tokens.weight[:mask.mean_of].mean(0)
            if not cfg.tie_word_embeddings:
                model.lm_head.weight[mask.token_id] = model.lm_head.weight[:mask.mean_of].mean(0)
    return mask.token_id
