"""The recipe's settings: what a run is asked for (Options), the budgets it derives (full and --quick),
the training configuration derived from the model, and a rough time estimate per stage.

The training configuration is the one that made the shipped SmolLM2 adapter (the base frozen, a
`<|mask|>` embedding and rank-32 adapters gated to mask rows, blocks of 4, 8 or 16 masks after in-order
prefixes), with what depends on the model taken from it: `init`, and `max_length` within its positions.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

DEFAULT_PROMPTS = 6000  # prose 2,400, maths 1,200, code 2,400 (half HumanEval's way, half MBPP's)
QUICK_PROMPTS = 8
DEFAULT_STEPS = 1200
# the adapters' rank: 64 trained to a lower loss than 16 on the same batches, but a decode step runs the
# adapters on every mask row, and at 64 they added about a tenth to a CPU forward at batch 1
RANK = 32
MAX_TOKENS = 256  # the longest answer learned from (a cut one gets no EOS)


@dataclass(frozen=True)
class Options:
    """What defines a run (a rerun in the same directory must give the same; the rest may change)."""

    prompts: int = DEFAULT_PROMPTS
    mix: dict[str, float] = field(default_factory=lambda: {"prose": 2.0, "maths": 1.0, "code": 2.0})
    prompts_file: str | None = None  # (its text's SHA-256 is compared, so an edited file is noticed)
    max_tokens: int = MAX_TOKENS
    quick: bool = False
    seed: int = 0

    def defining(self, prompts_file_sha: str | None) -> dict:
        d = asdict(self)
        d["prompts_file"] = prompts_file_sha
        return d


@dataclass(frozen=True)
class Budget:
    """Sizes that --quick shrinks (a tiny model, in CI: a minute or two)."""

    steps: int = DEFAULT_STEPS
    batch_size: int = 8
    micro_batch_size: int = 4
    warmup_steps: int = 20
    save_every: int = 20
    sampler_cuts: int = 16
    sampler_examples: int = 1200  # answers the sampler learns from: its features cost forwards, its gain is small
    sampler_steps: int = 3000
    sampler_check_every: int = 250
    gen_batch: int = 32  # self-generate's batch: on a CPU a 32-row step costs about twice an 8-row one
    measure_prompts: int = 16  # held-out prompts per domain for choosing the decoding settings
    measure_tokens: int = 256
    measure_batch: int = 8  # the batch the chosen setting must not be slower than AR at


QUICK = Budget(steps=4, batch_size=2, micro_batch_size=1, warmup_steps=1, save_every=2, sampler_cuts=4,
               sampler_examples=3, sampler_steps=4, sampler_check_every=2, gen_batch=8, measure_prompts=2,
               measure_tokens=16, measure_batch=2)


def budget(opts: Options, steps: int | None = None) -> Budget:
    b = QUICK if opts.quick else Budget()
    return b if steps is None else Budget(**{**asdict(b), "steps": steps})


def train_overrides(init: str, data: str, out_dir: str, max_positions: int, b: Budget) -> list[str]:
    """`refusion train --set` overrides of the mask-only recipe (training/config.py's fields)."""
    fields = dict(objective="refusion", variant="mask-only", init=init, data=data, out_dir=out_dir,
                  max_length=min(1024, max_positions), slot_sizes=[4, 8, 16], batch_size=b.batch_size,
                  micro_batch_size=b.micro_batch_size, max_steps=b.steps, lr=1e-3, min_lr_ratio=0.1,
                  warmup_steps=b.warmup_steps, weight_decay=0.0, grad_clip=1.0, seed=0, save_every=b.save_every,
                  keep_checkpoints=2, save_dtype="bfloat16", dtype=train_dtype(),
                  mask_adapter={"rank": RANK, "alpha": 2 * RANK})
    return [f"{k}={json.dumps(v)}" for k, v in fields.items()]


def train_dtype() -> str:
    """bfloat16 (autocast; the adapter's weights stay float32) where the machine multiplies in it natively:
    a step takes about two thirds of float32's on an AVX512-BF16 CPU, at the same losses. float32 where
    bfloat16 would be emulated."""
    import torch

    from refusion.training.setup import cpu_bf16_is_emulated

    return "bfloat16" if torch.cuda.is_available() or not cpu_bf16_is_emulated() else "float32"


# seconds per unit for a 135M-parameter model on two threads of a 2-core CPU (SmolLM2's recipe), scaled
# by parameters: a first guess, printed as such; the progress bars give the real pace
_PER_UNIT = {"user turn": 0.3, "answer": 0.8, "step": 9.0, "sampler example": 0.75, "measured prompt": 12.0}
_REF_PARAMS = 134_515_008


def estimate_seconds(unit: str, count: int, parameters: int) -> float:
    return _PER_UNIT[unit] * count * parameters / _REF_PARAMS
