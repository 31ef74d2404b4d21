"""`refusion train --plan`: what a run needs per process, from its configuration and the model's
config.json alone (no weights read, no model built), before anyone rents the GPUs.

    p = make_plan(cfg, model_config, nproc=8, nodes=1, device_memory=parse_memory("80GB"))
    print(plan_table(p))        # or json.dumps(p)

Every figure is an estimate from the shapes, in bytes, per process. P is the parameter count
(model/size.py), N = nproc x nodes the processes, L the blocks, H the hidden size, I the MLP's,
V the vocabulary, q = heads x head_dim, kv = kv_heads x head_dim; a is the compute dtype's bytes
(2 for bfloat16, 4 for float32). What this project's trainer holds (training/setup.py, step.py,
optimizer.py, fsdp.py):

  ddp   every process holds the float32 model (P x 4), float32 gradients (P x 4), DDP's gradient
        buckets when N > 1 (P x 4: DistributedDataParallel's default copies gradients into them),
        AdamW's two float32 moments (P x 8); bfloat16 is autocast, which keeps a bf16 copy of every
        weight it casts from the forward to the backward (P x 2).
  fsdp  the float32 master weights, gradients and moments are sharded: P x (4 + 4 + 8) / N. The
        compute copies are gathered per unit in the compute dtype (FSDP's mixed precision): the root
        unit (embeddings, final norm, LM head) stays gathered from forward to backward, with its
        gradients; of the blocks, the running one and the prefetched next one are gathered, and one
        block's unsharded gradients wait for their reduce-scatter.
  load  before that, under ddp, every process builds or loads the whole float32 model in host memory
        (setup.py: load_model, then .to(device)): P x 4 per process, nproc times that per node. Under
        fsdp from a model directory (or resuming) no process holds the whole model: each reads its
        own slices (fsdp.py); rank 0 alone reads the V x H embedding (and an untied LM head) whole,
        one at a time, for a new mask token's mean row: V x H x 4. A fresh fsdp model (no init) is
        drawn whole on every process before sharding, as under ddp.
  offload (fsdp only; FSDP2's CPUOffloadPolicy) the sharded weights, gradients and moments live in
        host memory; the device keeps the gathered units, their gradients and the activations.

AdamW's foreach step runs once per parameter group (optimizer.py: the matrices of the blocks and an
untied LM head decay, the embeddings and norms do not) and allocates one float32 temporary per
(sharded) parameter of the group: the larger group x 4 bytes (/ N under fsdp). It runs after the
backward, when the activations, gathered copies and unsharded gradients are gone, so the peak is
    weights + optimizer + gradients (sharded; all of them under ddp)
        + max(gathered copies + unsharded gradients + activations, step temporaries).

Activations at micro-batch m and row length T (n = m x T tokens), saved for the backward by one
block's forward (model/transformer.py, Block.forward), per token:
    2H  residual stream (block input, after attention), in float32 under autocast, else a bytes
    2H  the two RMSNorm outputs (inputs of qkv_proj and gate_up_proj)
    q + 2kv           the fused q/k/v projection (v is a view of it)
    4(q + kv)         q and k through their norms (normed, weighted), RoPE (rolled copy, result)
    2q                attention output and its reshaped copy (o_proj's input)
    4I                gate/up (2I), silu(gate) (I), silu(gate) x up (down_proj's input, I)
all at a bytes, plus SDPA's float32 log-sum-exp (heads x 4 bytes), assuming a fused (flash or
memory-efficient) attention kernel: the math kernel would also keep [m, heads, T, T] per block.
Once per forward: the embeddings and RoPE angles (n x (H + 2 head_dim) x a), the attention mask
(m x T^2 bool, plus its additive copy in the residual stream's dtype; none for the ar objective,
which runs causal) and the logits with their loss (n x V x (a + 4 + 4 + 4): logits, their float32
copy for the cross-entropy, its saved log-softmax, and the gradient arriving at the backward).
Activation checkpointing (per block) keeps only every block's input (L x n x H) plus one block's
activations, recomputed during its backward.

It fits when the peak <= device memory x (1 - FRAGMENTATION) - CUDA_CONTEXT.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

from refusion.model.config import ConfigError, ModelConfig
from refusion.model.size import parameter_count
from refusion.training.config import TrainConfig
from refusion.training.variants import variant_of

FRAGMENTATION = 0.10  # of device memory lost to the caching allocator's fragmentation
CUDA_CONTEXT = 2**30  # bytes the CUDA context, cuBLAS and NCCL take before any tensor (about 1 GiB)
MAX_MICRO_BATCH = 4096  # the largest micro-batch the plan looks for

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_memory(text: str) -> int:
    """'80GB' (decimal), '80GiB' (binary), '81559MiB', '1.5TB' or a number of bytes -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _UNITS or float(m.group(1)) <= 0:
        raise ConfigError(f"device memory {text!r}: write a size such as 80GB, 80GiB or 81559MiB")
    return int(float(m.group(1)) * _UNITS[unit])


def read_model_config(init: str | None, cfg: TrainConfig) -> tuple[ModelConfig, str]:
    """The model a run starts from, from `init`'s config.json alone (or a fresh model's table), and
    where it came from."""
    if init is None:
        # the tokenizer trained on the data has at most vocab_size tokens
        return ModelConfig(**{"vocab_size": cfg.vocab_size, **cfg.model}), "a fresh model (the config's [model] table)"
    from refusion.bundled import is_model_name, resolve_model

    path = resolve_model(init) if is_model_name(init) else Path(init)
    if not path.is_dir():
        raise ConfigError(f"init {init}: {'not a directory' if path.exists() else 'no such directory'} "
                          "(the plan reads the config.json of the model directory init names)")
    if not (path / "config.json").is_file():
        raise ConfigError(f"init {init} has no config.json (the plan reads only that file)")
    try:
        d = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path / 'config.json'}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path / 'config.json'}: expected a JSON object")
    return ModelConfig.from_hf(d), str(path / "config.json")


def default_processes() -> tuple[int, int]:
    """(processes per node, nodes) as torchrun's environment says, else (1, 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return local, max(world // max(local, 1), 1)


def row_length(cfg: TrainConfig) -> int:
    """The longest row a forward sees: prompt + response, but the joint layouts put the response in
    twice (joint, hybrid) or three times (joint-hybrid), and MDM's EOS padding may lengthen it."""
    if cfg.objective == "refusion" and variant_of(cfg).name == "joint-hybrid":
        return 3 * cfg.max_length
    if cfg.objective == "refusion" and variant_of(cfg).name in ("joint", "hybrid"):
        return 2 * cfg.max_length
    if cfg.objective == "mdm" and cfg.mdm_eos_pad_to:
        return cfg.max_length + cfg.mdm_eos_pad_to
    return cfg.max_length


def block_and_root(mc: ModelConfig) -> tuple[int, int]:
    """Parameters of one block, and of the rest (embeddings, final norm, LM head)."""
    one, two = (parameter_count(dataclasses.replace(mc, num_layers=n)) for n in (1, 2))
    block = two - one
    return block, parameter_count(mc) - mc.num_layers * block


def decayed_parameters(mc: ModelConfig) -> int:
    """Parameters of AdamW's weight-decay group (training/optimizer.py): the blocks' matrices and an
    untied LM head; the other group holds the embeddings, norms and biases."""
    H, I, d = mc.hidden_size, mc.intermediate_size, mc.head_dim
    q, kv = mc.num_heads * d, mc.num_kv_heads * d
    head = 0 if mc.tie_word_embeddings else mc.vocab_size * H
    return mc.num_layers * (H * (q + 2 * kv) + q * H + H * 2 * I + I * H) + head


def activation_bytes(mc: ModelConfig, objective: str, micro: int, T: int, a: int, residual: int,
                     checkpointing: bool) -> dict[str, int]:
    """Activations of one micro-batch (module docstring): per block, per forward, and in all."""
    H, I, V, d = mc.hidden_size, mc.intermediate_size, mc.vocab_size, mc.head_dim
    q, kv = mc.num_heads * d, mc.num_kv_heads * d
    n = micro * T
    per_token = 2 * H * residual + (2 * H + (q + 2 * kv) + 4 * (q + kv) + 2 * q + 4 * I) * a + mc.num_heads * 4
    block = n * per_token
    mask = 0 if objective == "ar" else micro * T * T * (1 + residual)
    head = n * V * (a + 4 + 4 + 4)
    once = n * (H + 2 * d) * a + mask + head
    blocks = (mc.num_layers * n * H * residual + block) if checkpointing else mc.num_layers * block
    return {"per_block": block, "blocks": blocks, "mask": mask, "logits": head, "total": blocks + once}


def memory(mc: ModelConfig, cfg: TrainConfig, strategy: str, world: int, micro: int, checkpointing: bool,
           offload: bool) -> dict[str, int]:
    """Bytes per process (device, and host under offload) of one setting (module docstring)."""
    P = parameter_count(mc)
    block, root = block_and_root(mc)
    bf16 = cfg.dtype == "bfloat16"
    a = 2 if bf16 else 4
    buffers = mc.max_position_embeddings * 2 * mc.head_dim * 4  # the float32 RoPE table
    group = max(decayed_parameters(mc), P - decayed_parameters(mc))  # AdamW's larger parameter group
    if strategy == "ddp":
        weights = P * 4 + buffers
        copies = P * 2 if bf16 else 0  # autocast's bf16 weights
        held = P * 4 + (P * 4 if world > 1 else 0)  # gradients + DDP's buckets
        in_flight = 0
        optimizer = P * 8
        step_temp = group * 4
        residual = 4  # autocast leaves the residual stream in float32
    else:
        weights = P * 4 // world + buffers
        copies = (root + 2 * block) * a  # gathered root, running and prefetched block
        held = P * 4 // world  # sharded gradients
        in_flight = (root + block) * a  # unsharded gradients of the root and one block
        optimizer = P * 8 // world
        step_temp = group * 4 // world
        residual = a
    host = 0
    if offload:
        host = 2 * (P * 4 // world) + optimizer + step_temp
        weights, held, optimizer, step_temp = buffers, 0, 0, 0
    act = activation_bytes(mc, cfg.objective, micro, row_length(cfg), a, residual, checkpointing)
    # the forward and backward hold copies, unsharded gradients and activations; AdamW's step, after
    # them, its temporaries instead
    peak = weights + optimizer + held + max(copies + in_flight + act["total"], step_temp)
    grads = held + in_flight
    return {"weights": weights, "compute_copies": copies, "gradients": grads, "optimizer": optimizer,
            "activations": act["total"], "activations_per_block": act["per_block"], "logits": act["logits"],
            "attention_mask": act["mask"], "step_temporaries": step_temp, "peak": peak, "host": host}


def sharded_load(cfg: TrainConfig) -> bool:
    """Whether each process loads only its own slices of the model (module docstring: load)."""
    return cfg.strategy == "fsdp" and cfg.init is not None


def load_bytes(mc: ModelConfig, cfg: TrainConfig, nproc: int) -> int:
    """Host memory a node holds while its processes load the model (module docstring: load)."""
    if sharded_load(cfg):
        return mc.vocab_size * mc.hidden_size * 4
    return parameter_count(mc) * 4 * nproc


def budget(device_memory: int) -> int:
    """What a process may use of a device of `device_memory` bytes."""
    return int(device_memory * (1 - FRAGMENTATION)) - CUDA_CONTEXT


def largest_micro_batch(mc: ModelConfig, cfg: TrainConfig, strategy: str, world: int, checkpointing: bool,
                        offload: bool, device_memory: int, limit: int) -> int:
    """The largest micro-batch (at most `limit`) whose peak fits; 0 when not even one example does."""
    best = 0
    for m in range(1, min(limit, MAX_MICRO_BATCH) + 1):
        if memory(mc, cfg, strategy, world, m, checkpointing, offload)["peak"] > budget(device_memory):
            break
        best = m
    return best


def count_records(data: str) -> int | None:
    """Records of a local JSON / JSONL data file (None where it is not one, or not here)."""
    p = Path(data)
    if not p.is_file():
        return None
    if p.suffix == ".jsonl":
        with p.open(encoding="utf-8") as f:
            return sum(1 for line in f if line.strip())
    try:
        recs = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return len(recs) if isinstance(recs, list) else None


def make_plan(cfg: TrainConfig, mc: ModelConfig, nproc: int, nodes: int, device_memory: int | None,
              source: str = "") -> dict:
    """The plan of `cfg` on nproc x nodes processes with `device_memory` bytes each: a JSON-able dict."""
    world = nproc * nodes
    micro = cfg.micro_batch_size or max(cfg.batch_size // world, 1)
    notes = []
    if cfg.batch_size % (world * micro):
        notes.append(f"batch_size {cfg.batch_size} is not a multiple of processes ({world}) x micro_batch_size "
                     f"({micro}): the run would refuse it")
    if cfg.lora is not None or (cfg.objective == "refusion" and variant_of(cfg).mask_path):
        notes.append("figures are for full-parameter training: LoRA and mask-path runs train (and hold "
                     "gradients and AdamW state for) far fewer parameters")
    T = row_length(cfg)
    if cfg.init is not None and T > mc.max_position_embeddings:
        notes.append(f"rows of up to {T} tokens exceed the model's max_position_embeddings {mc.max_position_embeddings}")
    generated = cfg.data == "synthetic" or cfg.data.startswith("tasks:")
    records = cfg.synthetic_examples if generated else count_records(cfg.data)
    if records is not None and cfg.corpus is not None:
        records += cfg.corpus_examples
    steps_per_epoch = records // cfg.batch_size if records is not None else None
    settings = []
    for strategy in ("ddp", "fsdp"):
        for checkpointing in (False, True):
            for offload in ((False, True) if strategy == "fsdp" else (False,)):
                mem = memory(mc, cfg, strategy, world, micro, checkpointing, offload)
                s = {"strategy": strategy, "checkpointing": checkpointing, "offload": offload,
                     "configured": (strategy == cfg.strategy and checkpointing == cfg.gradient_checkpointing
                                    and offload == cfg.cpu_offload), **mem}
                if device_memory is not None:
                    s["fits"] = mem["peak"] <= budget(device_memory)
                    s["largest_micro_batch"] = largest_micro_batch(mc, cfg, strategy, world, checkpointing, offload,
                                                                   device_memory, cfg.batch_size // world)
                settings.append(s)
    block, root = block_and_root(mc)
    return {
        "model": {"source": source, "parameters": parameter_count(mc), "per_block": block, "blocks": mc.num_layers,
                  "embeddings_and_head": root},
        "processes": {"per_node": nproc, "nodes": nodes, "total": world},
        "device_memory": device_memory,
        "usable_memory": budget(device_memory) if device_memory is not None else None,
        "fragmentation": FRAGMENTATION, "cuda_context": CUDA_CONTEXT,
        "objective": cfg.objective, "variant": variant_of(cfg).name if cfg.objective == "refusion" else None,
        "dtype": cfg.dtype, "strategy": cfg.strategy, "gradient_checkpointing": cfg.gradient_checkpointing,
        "batch_size": cfg.batch_size, "micro_batch_size": micro,
        "accumulation_steps": max(cfg.batch_size // (world * micro), 1),
        "sharded_load": sharded_load(cfg), "host_at_load_per_node": load_bytes(mc, cfg, nproc),
        "row_length": T, "tokens_per_step_max": cfg.batch_size * T,
        "records": records, "steps_per_epoch": steps_per_epoch, "max_steps": cfg.max_steps,
        "epochs": cfg.max_steps / steps_per_epoch if steps_per_epoch else None,
        "settings": settings, "notes": notes,
    }


def _gb(n: int) -> str:
    return f"{n / 10**9:.1f}"


def plan_table(p: dict) -> str:
    """The plan as a readable table (GB = 10^9 bytes)."""
    m, pr = p["model"], p["processes"]
    variant = f" ({p['variant']})" if p["variant"] else ""
    lines = [
        f"model: {m['parameters']:,} parameters ({m['blocks']} blocks of {m['per_block']:,}, "
        f"{m['embeddings_and_head']:,} in embeddings, final norm and LM head) from {m['source']}",
        f"processes: {pr['total']} ({pr['per_node']} per node x {pr['nodes']} node{'s' if pr['nodes'] > 1 else ''}); "
        f"configured: strategy {p['strategy']}, dtype {p['dtype']}, activation checkpointing "
        f"{'on' if p['gradient_checkpointing'] else 'off'}",
        f"objective {p['objective']}{variant}: rows of up to {p['row_length']} tokens; micro-batch "
        f"{p['micro_batch_size']} x {p['accumulation_steps']} accumulation step(s) x {pr['total']} processes = "
        f"batch {p['batch_size']}; at most {p['tokens_per_step_max']:,} tokens per step",
    ]
    if p["steps_per_epoch"] is not None:
        lines.append(f"data: {p['records']:,} records (before length filtering): {p['steps_per_epoch']:,} steps "
                     f"per epoch; max_steps {p['max_steps']:,} = {p['epochs']:.2f} epochs")
    else:
        lines.append(f"data: not a local file here: steps per epoch unknown (max_steps {p['max_steps']:,})")
    if p["sharded_load"]:
        lines.append(f"loading: each process reads only its own slices of the weights; rank 0 also reads the "
                     f"embedding whole (a new mask token's mean row): {_gb(p['host_at_load_per_node'])} GB at most")
    else:
        lines.append(f"loading: every process first holds the whole float32 model in host memory: "
                     f"{_gb(p['host_at_load_per_node'])} GB per node of {pr['per_node']}")
    if p["device_memory"] is not None:
        lines.append(f"device memory {_gb(p['device_memory'])} GB per process; usable {_gb(p['usable_memory'])} GB "
                     f"(less {p['fragmentation']:.0%} for fragmentation and {p['cuda_context'] / 2**30:.0f} GiB "
                     "of CUDA context)")
    lines += ["", "per process, GB        weights  copies  grads  optim  activ  peak   host   fits  max micro"]
    for s in p["settings"]:
        name = (f"{'*' if s['configured'] else ' '} {s['strategy']}"
                f"{' +ckpt' if s['checkpointing'] else ''}{' +offload' if s['offload'] else ''}")
        fits = ("yes" if s["fits"] else "NO") if "fits" in s else "-"
        micro = str(s["largest_micro_batch"]) if "largest_micro_batch" in s else "-"
        lines.append(f"{name:<22} {_gb(s['weights']):>7} {_gb(s['compute_copies']):>7} {_gb(s['gradients']):>6} "
                     f"{_gb(s['optimizer']):>6} {_gb(s['activations']):>6} {_gb(s['peak']):>6} "
                     f"{_gb(s['host']):>6} {fits:>5} {micro:>10}")
    conf = next(s for s in p["settings"] if s["configured"])
    lines += ["", "* the configured setting. copies: gathered bf16/compute weights (fsdp) or autocast's (ddp); "
                  "host: per process under CPU offload",
              f"activations: {_gb(conf['activations_per_block'])} GB per block per micro-batch, logits and loss "
              f"{_gb(conf['logits'])} GB, attention mask {_gb(conf['attention_mask'])} GB (fused attention assumed)"]
    lines += [f"note: {n}" for n in p["notes"]]
    if "fits" in conf:
        verdict = "FITS" if conf["fits"] else "DOES NOT FIT"
        lines.append(f"{verdict}: peak {_gb(conf['peak'])} GB of {_gb(p['usable_memory'])} GB usable; largest "
                     f"micro-batch that fits: {conf['largest_micro_batch']}")
    else:
        lines.append("give --device-memory (e.g. 80GB) to check the fit")
    return "\n".join(lines)
