"""Open chat requests, held out: what an instruct model is asked most (emails, recipes, summaries,
explanations, advice, lists, rewriting, stories, comparisons, how-tos), written for this project into
tasks/data/chat_requests.jsonl. Never a training prompt: `refusion adapt` measures its drafts on them
and drops any training prompt that nearly repeats one (training/adapt/prompts.py). There is no gold
answer; what is compared is the output of a model with the output of its base."""

from __future__ import annotations

import json

from refusion.tasks import Example
from refusion.tasks.common import subset
from refusion.tasks.sources import DATA

FILE = DATA / "chat_requests.jsonl"


def load_chat(split: str = "test", n: int | None = None, seed: int = 0) -> list[Example]:
    """The chat requests as Examples (id, prompt; kind in meta), the first n after a seeded shuffle."""
    if split != "test":
        raise ValueError("chat has only a 'test' split (it is held out)")
    exs = [Example(d["id"], d["request"], None, None, {"kind": d["kind"]})
           for d in map(json.loads, FILE.read_text(encoding="utf-8").splitlines())]
    return subset(exs, n, seed)
