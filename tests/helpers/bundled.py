"""The bundled default model, and held-out prompts of the task families its recipe trained it on
(recipe.toml beside the weights), so that the tests follow the model when it is replaced."""

from __future__ import annotations

import functools
import tomllib

from refusion.model.checkpoint import load_model
from refusion.bundled import BUNDLED
from refusion.training.data import trained_tasks
from refusion.tasks import Example, get_task
from refusion.model.tokenizer import Tokenizer


@functools.lru_cache(maxsize=None)
def bundled():
    assert (BUNDLED / "config.json").exists(), f"the bundled model is missing from {BUNDLED}"
    return load_model(BUNDLED), Tokenizer.from_dir(BUNDLED)


@functools.lru_cache(maxsize=None)
def bundled_tasks() -> tuple[str, ...]:
    return trained_tasks(tomllib.loads((BUNDLED / "recipe.toml").read_text())["data"])


def task_examples(per_task: int = 2, seed: int = 1) -> list[Example]:
    """per_task held-out examples of each of the bundled model's task families, family by family."""
    return [ex for name in bundled_tasks() for ex in get_task(name).load("test", n=per_task, seed=seed)]
