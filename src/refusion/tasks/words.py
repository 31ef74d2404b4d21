"""Word-level task families small enough for a sub-megabyte model to master on one CPU.

  sort    sort 5-10 two-digit numbers:  "Sort: 41 17 93 12" -> "12 17 41 93"             (exact match)
  add     add 2-3 two-digit numbers (total below 100), column by column, with a running
          sum: "23 + 45: 3 + 5 = 8, 2 + 4 = 6, so 68", a line a step, then "#### N"       (final answer)
  repeat  repeat a list of words N times (one copy a line), or each word N times          (exact match)

The response is a pure function of the query, so a model can learn to answer every query exactly;
responses run to 12-73 tokens, long enough that decoding several tokens per forward matters. These
are the tasks of the fixture model tests/fixtures/refusion-words (configs/refusion-words.toml).

Every example is a pure function of (task, split, seed, index). Train and test are disjoint by the
same stable hash of the prompt as the synthetic families (refusion.tasks.common.in_test_split).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from refusion.tasks import Example, Score, Task
from refusion.tasks.common import extract_final_number, generated_split, numbers_equal

WORDS = ["red", "blue", "green", "cat", "dog", "fox", "owl", "sun", "moon", "star", "tree", "leaf", "rock", "sea",
         "rain", "snow", "wind", "fire", "bird", "fish", "bear", "wolf", "lamp", "door", "book", "cup", "hat", "box",
         "key", "ship"]


def make_sort(rng: random.Random) -> tuple[str, str, str]:
    nums = rng.sample(range(10, 100), rng.randint(5, 10))
    target = " ".join(map(str, sorted(nums)))
    return "Sort: " + " ".join(map(str, nums)), target, target


def add_step(a: int, b: int) -> str:
    """One worked step in columns (a + b < 100): "68 + 12: 8 + 2 = 10, 6 + 1 + 1 = 8, so 80"."""
    units = a % 10 + b % 10
    carry = " + 1" if units >= 10 else ""
    return (f"{a} + {b}: {a % 10} + {b % 10} = {units}, {a // 10} + {b // 10}{carry} = {(a + b) // 10}, "
            f"so {a + b}")


def make_add(rng: random.Random) -> tuple[str, str, int]:
    k = rng.randint(2, 3)
    while True:
        nums = [rng.randint(10, 89) for _ in range(k)]
        if sum(nums) <= 99:
            break
    total, lines = nums[0], []
    for x in nums[1:]:
        lines.append(add_step(total, x))
        total += x
    return "Add: " + " + ".join(map(str, nums)), "\n".join(lines + [f"#### {total}"]), total


def make_repeat(rng: random.Random) -> tuple[str, str, str]:
    if rng.random() < 0.5:
        k, words = rng.randint(3, 5), rng.sample(WORDS, rng.randint(3, 6))
        line = " ".join(words)
        return f"Repeat {k} times: {line}", "\n".join([line] * k), " ".join([line] * k)
    k, words = rng.randint(3, 4), rng.sample(WORDS, rng.randint(4, 8))
    target = " ".join(w for w in words for _ in range(k))
    return f"Repeat each word {k} times: {' '.join(words)}", target, target


def _norm(text: str) -> str:
    return " ".join(text.split())


def score_exact(ex: Example, output: str) -> Score:
    """Exact match up to whitespace (line breaks included)."""
    got = _norm(output)
    return Score(got, got == _norm(str(ex.answer)))


def score_add(ex: Example, output: str) -> Score:
    got = extract_final_number(output)
    return Score(got, numbers_equal(got, str(ex.answer)))


MAKERS: dict[str, Callable[[random.Random], tuple[str, str, object]]] = {
    "sort": make_sort, "add": make_add, "repeat": make_repeat}


# The distinct test prompts each family supplies within the loader's search (measured; add has few).
TEST_SIZES = {"sort": 100_000, "add": 4000, "repeat": 100_000}


def load(name: str, split: str, n: int | None = None, seed: int = 0) -> list[Example]:
    """n examples of `name` in `split` (default 500 test / 20000 train; at most TEST_SIZES test);
    test prompts are distinct."""
    return generated_split("word", name, split, n, seed, TEST_SIZES[name],
                           lambda rng: Example("", *MAKERS[name](rng)))


def _task(name: str, kind: str, score, description: str) -> Task:
    return Task(name, kind, ("train", "test"), lambda split, n=None, seed=0: load(name, split, n, seed), score,
                description)


TASKS: dict[str, Task] = {
    "sort": _task("sort", "structured", score_exact, "sort 5-10 two-digit numbers, exact match"),
    "add": _task("add", "math", score_add, "add 2-3 two-digit numbers column by column, running sum, '#### N'"),
    "repeat": _task("repeat", "structured", score_exact, "repeat a list of words, or each word, N times; exact match"),
}
