"""Evaluation tasks: one module per family, all on one small interface.

A task turns a split into Examples (a user prompt, a reference response for training, a gold answer)
and scores a model's output against an Example. The chat template is applied by the caller, so a
task only writes the user message.

  synthetic.py        tasks a small model trained on this machine can learn (train/test splits, seeded)
  words.py            sort, add, repeat: word-level tasks a sub-megabyte model masters (the fixture model)
  maths.py            GSM8K, MATH, MATH-500 (answer extraction and normalisation)
  code.py             MBPP and HumanEval, scored by running their tests in the sandbox
  multiple_choice.py  ARC-Challenge and MMLU, scored by the chosen letter
  sources.py          where the real benchmarks' files come from (`refusion data`)

Each module listed in _MODULES exposes TASKS: dict[str, Task].
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Example:
    id: str
    prompt: str  # the user message
    target: str | None  # a reference response (training target / gold solution), if the task has one
    answer: Any  # what `score` compares against (a number, a letter, hidden tests, ...)
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Score:
    extracted: str | None  # the answer read out of the output (None: none found)
    correct: bool


@dataclass
class Task:
    name: str
    kind: str  # "math", "code", "multiple_choice" or "structured"
    splits: tuple[str, ...]  # e.g. ("train", "test")
    load: Callable[..., list[Example]]  # load(split, n=None, seed=0) -> examples (first n after a seeded shuffle)
    score: Callable[[Example, str], Score]
    description: str = ""
    score_many: Callable[[list[Example], list[str]], list[Score]] | None = None  # batched (e.g. parallel sandbox)


_MODULES = ("synthetic", "words", "maths", "code", "multiple_choice")


def all_tasks() -> dict[str, Task]:
    """Every task by name. Each module listed above exposes TASKS: dict[str, Task]."""
    tasks: dict[str, Task] = {}
    for mod in _MODULES:
        tasks.update(importlib.import_module(f"{__name__}.{mod}").TASKS)
    return tasks


def get_task(name: str) -> Task:
    tasks = all_tasks()
    if name not in tasks:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(tasks))}")
    return tasks[name]
