"""Near-repeats of what the measurement holds out: a training prompt that nearly repeats a held-out
chat request, MBPP test task or HumanEval task is dropped (and counted), so that the figures are taken
on requests the masks never learned from."""

from __future__ import annotations

import re


def _bigrams(text: str) -> set[tuple[str, str]]:
    words = re.findall(r"[a-z0-9]+", text.lower())
    return {(words[i], words[i + 1]) for i in range(len(words) - 1)} or {(w, "") for w in words}


class HeldOut:
    """Held-out requests, to find training prompts that nearly repeat one: most of the request's word
    pairs in the prompt, or most of a short prompt's in the request."""

    def __init__(self, requests: list[str], share: float = 0.7) -> None:
        self.grams = [g for g in map(_bigrams, requests) if g]
        self.share = share

    def repeats(self, prompt: str) -> bool:
        g = _bigrams(prompt)
        if not g:
            return False
        return any(len(g & h) >= self.share * min(len(g), len(h)) for h in self.grams)


def held_out_chat() -> HeldOut:
    from refusion.tasks.chat import load_chat

    return HeldOut([e.prompt for e in load_chat()])


def task_words(statement: str) -> str:
    """A function request without the words every request of its kind starts with ("Write a python
    function to"), which would make any two look alike."""
    return re.sub(r"^\s*write\s+an?\s+(python\s+)?function\s+(to|that)\s+", "", statement, flags=re.IGNORECASE)


def held_out_code() -> HeldOut:
    """MBPP's test tasks (their statements) and HumanEval's (their docstrings' words)."""
    from refusion.tasks.code import load_humaneval, load_mbpp

    mbpp = [task_words(e.prompt.split("\n")[0]) for e in load_mbpp()]
    humaneval = [e.answer["prompt"] for e in load_humaneval()]
    return HeldOut(mbpp + humaneval)
