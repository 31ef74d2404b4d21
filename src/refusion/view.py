"""A terminal view of one sequence being decoded: slots appear out of order as they are committed.

Undecoded positions show as a dim '·'; the tokens of the latest commit are highlighted. The view
redraws in place (ANSI cursor movement), so it is only used on a terminal; scripts get --no-view.
"""

from __future__ import annotations

import shutil
import sys
from typing import TextIO

from .tokenizer import Tokenizer

DIM, HIGHLIGHT, RESET = "\x1b[2m", "\x1b[1;32m", "\x1b[0m"


class SlotView:
    def __init__(self, tokenizer: Tokenizer | None, prompt_len: int, gen_length: int, row: int = 0,
                 out: TextIO = sys.stderr) -> None:
        self.tok, self.P, self.L, self.row, self.out = tokenizer, prompt_len, gen_length, row, out
        self.tokens: dict[int, int] = {}
        self.last: set[int] = set()
        self.lines = 0
        self.commits = 0

    def _piece(self, t: int) -> str:
        return self.tok.decode([t], skip_special_tokens=False) if self.tok is not None else f"{t} "

    def render(self) -> str:
        hi = max(self.tokens, default=self.P - 1)
        parts = []
        for q in range(self.P, min(hi + 1, self.P + self.L)):
            if q not in self.tokens:
                parts.append(f"{DIM}·{RESET}")
            else:
                piece = self._piece(self.tokens[q])
                parts.append(f"{HIGHLIGHT}{piece}{RESET}" if q in self.last else piece)
        return "".join(parts)

    def on_commit(self, row: int, positions: list[int], tokens: list[int]) -> None:
        if row != self.row:
            return
        self.tokens.update(zip(positions, tokens))
        self.last = set(positions)
        self.commits += 1
        self._draw(self.render())

    def _draw(self, text: str) -> None:
        if self.lines:
            self.out.write(f"\x1b[{self.lines}F\x1b[J")  # back to the first line of the last frame
        self.out.write(text + "\n")
        self.out.flush()
        width = shutil.get_terminal_size().columns
        plain = _strip_ansi(text)
        self.lines = sum(max(1, -(-len(line) // width)) for line in plain.split("\n"))

    def close(self) -> None:
        self.last = set()
        self._draw(self.render())


def _strip_ansi(s: str) -> str:
    for code in (DIM, HIGHLIGHT, RESET):
        s = s.replace(code, "")
    return s
