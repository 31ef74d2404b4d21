"""ARC-Challenge (1172 test questions) and MMLU (14042), scored by the letter the model chooses.
(MMLU-Pro and GPQA, in the paper's table, have no offline source; these stand in for them.)"""

from __future__ import annotations

import re

from refusion.tasks import Example, Score, Task
from refusion.tasks.common import extract_letter, subset
from refusion.tasks.sources import arrow_rows, request_docs

LETTERS = "ABCDE"
INSTRUCTION = "Answer with the letter of the correct option, as 'Answer: X'."


def _example(id_: str, question: str, options: list[str], gold: int) -> Example:
    letters = LETTERS[:len(options)]
    text = question.strip() + "\n" + "\n".join(f"{l}. {o}" for l, o in zip(letters, options))
    return Example(id_, f"{text}\n\n{INSTRUCTION}", f"Answer: {letters[gold]}", letters[gold],
                   {"letters": letters})


def load_arc(split: str = "test", n: int | None = None, seed: int = 0) -> list[Example]:
    if split != "test":
        raise ValueError("arc_challenge has only a 'test' split here")
    exs, seen = [], set()
    for d in request_docs("arc_challenge"):  # one row per option: keep each question once
        if d["id"] in seen:
            continue
        seen.add(d["id"])
        q = d["query"].removeprefix("Question:").rsplit("\nAnswer:", 1)[0]
        stem, *opts = re.split(r"\n\s*[A-E]\.\s", q)
        exs.append(_example(f"arc/{d['id']}", stem, [o.strip() for o in opts], int(d["gold"])))
    return subset(exs, n, seed)


def load_mmlu(split: str = "test", n: int | None = None, seed: int = 0) -> list[Example]:
    if split != "test":
        raise ValueError("mmlu has only a 'test' split here")
    exs = [_example(f"mmlu/{r['subject']}/{i}", r["question"], list(r["choices"]), int(r["answer"]))
           for i, r in enumerate(arrow_rows("mmlu"))]
    return subset(exs, n, seed)


def score_choice(ex: Example, output: str) -> Score:
    got = extract_letter(output, ex.meta.get("letters", "ABCD"))
    return Score(got, got == ex.answer)


TASKS: dict[str, Task] = {
    "arc_challenge": Task("arc_challenge", "multiple_choice", ("test",), load_arc, score_choice,
                          "ARC-Challenge test, chosen letter"),
    "mmlu": Task("mmlu", "multiple_choice", ("test",), load_mmlu, score_choice, "MMLU test (57 subjects), letter"),
}
