"""Helpers shared by the task modules: seeded subsets, the sizes of generated splits, answer extraction."""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable

from refusion.tasks import Example


def subset(examples: list[Example], n: int | None, seed: int) -> list[Example]:
    """All examples in file order (n=None), else the first n after a shuffle seeded by `seed`."""
    if n is None:
        return examples
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    return [examples[i] for i in order[:n]]


# A generated train split repeats prompts, so any n is possible, but every example is held in memory.
MAX_GENERATED = 1_000_000


def check_generated_n(name: str, split: str, n: int, test_size: int) -> None:
    """Refuse, before generating anything, an n a generated split cannot supply: its test prompts are
    distinct and the family has only so many (past them the loader would search on and on, holding
    what it found), and no split is generated past MAX_GENERATED examples."""
    limit = test_size if split == "test" else MAX_GENERATED
    if n > limit:
        what = "distinct test examples" if split == "test" else f"{split} examples (each held in memory)"
        raise ValueError(f"task {name!r} supplies at most {limit} {what}; n {n} asks for more: ask for at most {limit}")


def in_test_split(prompt: str) -> bool:
    """Which split a generated prompt belongs to: a stable hash of its text, so the two never share one."""
    return int(hashlib.sha1(prompt.encode()).hexdigest()[:8], 16) % 10 == 0


def generated_split(family: str, name: str, split: str, n: int | None, seed: int, test_size: int,
                    make: Callable[[random.Random], Example]) -> list[Example]:
    """n examples of a generated task in `split` (default 500 test / 20000 train; at most test_size
    test): make(rng) draws one (its id is set here), with rng seeded by name, split, seed and index.
    Test prompts are distinct; train prompts may repeat."""
    if split not in ("train", "test"):
        raise ValueError(f"{family} tasks have splits 'train' and 'test', not {split!r}")
    n = n if n is not None else (500 if split == "test" else 20000)
    check_generated_n(name, split, n, test_size)
    out, seen, i = [], set(), 0
    want_test = split == "test"
    while len(out) < n:
        ex = make(random.Random(f"{name}/{split}/{seed}/{i}"))
        i += 1
        if in_test_split(ex.prompt) == want_test and not (want_test and ex.prompt in seen):
            seen.add(ex.prompt)
            ex.id = f"{name}/{split}/{len(out)}"
            out.append(ex)
        if i > 50 * n + 1000:
            raise ValueError(f"task {name!r} cannot produce {n} distinct {split} examples")
    return out


_NUM = re.compile(r"-?\d+(?:\.\d+)?")


def extract_final_number(text: str) -> str | None:
    """The number after the last "####", else the last number in the text (commas and $ ignored)."""
    text = text.replace(",", "").replace("$", "")
    if "####" in text:
        m = _NUM.search(text.rsplit("####", 1)[1])
        if m:
            return m.group()
    nums = _NUM.findall(text)
    return nums[-1] if nums else None


def numbers_equal(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return False
    try:
        return abs(float(a) - float(b)) < 1e-6
    except ValueError:
        return False


def extract_letter(output: str, letters: str = "ABCD") -> str | None:
    """The chosen option: "Answer: X" / "answer is X" (last one), else a lone letter opening the output."""
    cls = f"[{letters}{letters.lower()}]"
    m = re.findall(rf"[Aa]nswer(?: is)?\s*:?\s*\(?({cls})\b", output)
    if m:
        return m[-1].upper()
    m = re.match(rf"\s*\(?([{letters}])\b", output)
    if m:
        return m.group(1)
    m = re.findall(rf"\b([{letters}])\b", output)
    return m[-1] if m else None


def extract_code(output: str) -> str:
    """The first fenced code block (```python or ```), else the whole output."""
    m = re.search(r"```[a-zA-Z0-9_+-]*\n(.*?)(?:```|$)", output, re.S)
    return (m.group(1) if m else output).strip("\n")
