"""`refusion adapt`: any causal LM made faster with its answers unchanged, in one resumable command.

    adapt("smollm2", "runs/adapt-smollm2")      # prompts -> own answers -> mask-only training -> sampler
                                                # -> export -> measurement -> runs/adapt-smollm2/adapter

The model's `<|mask|>` rows learn to draft what the model itself would write next, from its own greedy
answers to prompts of the kinds it is asked (prose, maths and code by default); self-speculative
decoding then verifies the drafts with the model's causal predictions, so greedy output stays the
base's, token for token. The stages are in pipeline.py, the run directory in run.py, the prompts in
prompts.py and magpie.py, the settings in recipe.py, the measurement in measure.py.
"""

from __future__ import annotations

from pathlib import Path

from refusion.training.adapt.recipe import Options


def adapt(model: str, out: str | Path, opts: Options | None = None, hours: float | None = None,
          threads: int | None = None, progress: bool = True, export: str | Path | None = None) -> Path:
    """Run (or resume) every stage; the adapter directory (`--model` it)."""
    from refusion.training.adapt.pipeline import Pipeline

    return Pipeline(model, out, opts or Options(), hours, threads, progress, export)()


__all__ = ["Options", "adapt"]
