"""A terminal view of one sequence being decoded: slots appear out of order as they are committed.

Undecoded positions show as a dim '·'; the tokens of the latest commit are highlighted. The view
redraws in place (ANSI cursor movement), so it is only used on a terminal; scripts get --no-view.

What a frame shows is what the answer will be: special tokens are left out, nothing after the first
committed EOS is shown (the result ends there), and text is decoded over runs of neighbouring
tokens, so a character whose bytes are split over several tokens appears whole once they are all
there (a dim '·' until then) instead of as '�'. A frame taller than the terminal shows its last
lines only (a taller one would scroll, and the lines scrolled away could not be redrawn), and
close() erases the last frame: the caller prints the answer once.
"""

from __future__ import annotations

import os
import shutil
import sys
import unicodedata
from typing import TextIO

from refusion.model.tokenizer import Tokenizer

DIM, HIGHLIGHT, RESET = "\x1b[2m", "\x1b[1;32m", "\x1b[0m"
DOT = "·"
LOOKBACK = 4  # tokens of context when decoding a token's text: a UTF-8 character has at most 4 bytes
REPLACEMENT = "\ufffd"


class SlotView:
    def __init__(self, tokenizer: Tokenizer | None, prompt_len: int, gen_length: int, row: int = 0,
                 out: TextIO = sys.stderr, eos_ids: list[int] | None = None) -> None:
        self.tok, self.P, self.L, self.row, self.out = tokenizer, prompt_len, gen_length, row, out
        self.eos = set(eos_ids or [])
        self.tokens: dict[int, int] = {}
        self.last: set[int] = set()
        self.lines = 0
        self.commits = 0
        self._pieces: dict[tuple[int, ...], str | None] = {}

    # ---- text -------------------------------------------------------------------------

    def _piece(self, window: tuple[int, ...]) -> str | None:
        """The text the last token of `window` adds after the ones before it; None while it ends
        inside a character whose remaining bytes are still to come."""
        if window not in self._pieces:
            if self.tok is None:
                piece: str | None = f"{window[-1]} "
            else:
                before = self.tok.decode(list(window[:-1]), skip_special_tokens=True).rstrip(REPLACEMENT)
                text = self.tok.decode(list(window), skip_special_tokens=True)
                if text.endswith(REPLACEMENT):
                    piece = None
                else:
                    piece = text[len(before):] if text.startswith(before) else text
            self._pieces[window] = piece
        return self._pieces[window]

    def _end(self) -> int:
        """One past the last position to show: the latest commit, but never past the first EOS."""
        end = min(max(self.tokens, default=self.P - 1) + 1, self.P + self.L)
        eos = [q for q, t in self.tokens.items() if t in self.eos]
        return min(end, min(eos) + 1) if eos else end

    def cells(self) -> list[tuple[str, str]]:
        """The frame as (text, style) pieces in position order."""
        out: list[tuple[str, str]] = []
        run: list[int] = []  # tokens of the current run of committed positions
        end = self._end()
        for q in range(self.P, end):
            if q not in self.tokens:
                run = []
                out.append((DOT, DIM))
                continue
            run.append(self.tokens[q])
            piece = self._piece(tuple(run[-LOOKBACK - 1:]))
            style = HIGHLIGHT if q in self.last else ""
            if piece is None:
                # part of a character: shown by the token that completes it, a dot while none does
                if not (q + 1 < end and q + 1 in self.tokens):
                    out.append((DOT, DIM))
            else:
                # the start of a character whose first bytes sit before a gap stays a dot
                out += [(DOT, DIM) if ch == REPLACEMENT else (_printable(ch), style) for ch in piece]
        return out

    def render(self) -> str:
        return "".join(f"{style}{text}{RESET}" if style else text for text, style in self.cells())

    # ---- drawing ----------------------------------------------------------------------

    def on_commit(self, row: int, positions: list[int], tokens: list[int]) -> None:
        if row != self.row:
            return
        self.tokens.update(zip(positions, tokens))
        self.last = set(positions)
        self.commits += 1
        self._draw()

    def _size(self) -> tuple[int, int]:
        try:
            size = os.get_terminal_size(self.out.fileno())
        except (AttributeError, OSError, ValueError):  # not a real terminal (tests, pipes)
            size = shutil.get_terminal_size()
        return max(size.columns, 2), max(size.lines, 2)

    def frame_rows(self) -> list[str]:
        """The frame cut into terminal rows (one column short of the width, so that no terminal
        wraps on its own), only as many as fit above the cursor's line."""
        width, height = self._size()
        rows: list[str] = [""]
        used = 0
        for text, style in self.cells():
            for ch in text:
                if ch == "\n":
                    rows.append("")
                    used = 0
                    continue
                w = _width(ch)
                if used + w > width - 1:
                    rows.append("")
                    used = 0
                rows[-1] += f"{style}{ch}{RESET}" if style else ch
                used += w
        return rows[-(height - 1):]

    def _erase(self) -> None:
        if self.lines:
            self.out.write(f"\x1b[{self.lines}F\x1b[J")  # back to the first line of the last frame, clear below
            self.lines = 0

    def _draw(self) -> None:
        rows = self.frame_rows()
        self._erase()
        self.out.write("\n".join(rows) + "\n")
        self.out.flush()
        self.lines = len(rows)

    def close(self) -> None:
        """Erase the last frame: the answer is printed once, by the caller."""
        self._erase()
        self.out.flush()


def _printable(ch: str) -> str:
    if ch == "\t":
        return "    "
    # a control character from the model (ESC, CR, ...) would move the cursor under the view
    return " " if ch != "\n" and unicodedata.category(ch) in ("Cc", "Cf") else ch


def _width(ch: str) -> int:
    if unicodedata.combining(ch):
        return 0
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1


def _strip_ansi(s: str) -> str:
    for code in (DIM, HIGHLIGHT, RESET):
        s = s.replace(code, "")
    return s
