"""The terminal view: undecoded positions as dots, the latest commit highlighted, redrawn in place;
nothing after EOS, no special tokens, whole characters only, never taller than the terminal, and
erased at the end so the answer is printed once. The last test runs `refusion generate` under a
pseudo-terminal and replays what it wrote through a small terminal emulator."""

import io
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import fcntl
import pytest

from refusion.training.data import train_bpe_tokenizer
from refusion.cli.view import DIM, HIGHLIGHT, RESET, SlotView, _strip_ansi

BUNDLED = Path(__file__).parents[2] / "src" / "refusion" / "assets" / "refusion-tiny"


class Pieces:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + i) for i in ids)


def test_out_of_order_commits_render_with_gaps_then_fill():
    out = io.StringIO()
    v = SlotView(Pieces(), prompt_len=3, gen_length=8, out=out)
    v.on_commit(0, [7, 8], [4, 5])  # a later slot first
    assert _strip_ansi(v.render()) == "····ef"
    assert f"{HIGHLIGHT}e{RESET}" in v.render() and f"{DIM}·{RESET}" in v.render()
    v.on_commit(1, [3], [0])  # another row's commit is ignored
    v.on_commit(0, [3, 4, 5, 6], [0, 1, 2, 3])
    assert _strip_ansi(v.render()) == "abcdef"
    assert f"{HIGHLIGHT}e" not in v.render()  # only the latest commit is highlighted
    frames = out.getvalue()
    assert frames.count("\x1b[1F\x1b[J") == 1  # the second frame replaced the first (one line)
    v.close()
    assert out.getvalue().endswith("\x1b[1F\x1b[J")  # the last frame is erased, not drawn again


@pytest.fixture(scope="module")
def tok():
    # byte-level BPE trained on ASCII: 'é' (2 bytes) and '€' (3 bytes) are one token per byte
    return train_bpe_tokenizer(["the cat sat on the mat"] * 30, vocab_size=270)


def test_a_character_split_over_tokens_shows_whole_or_as_a_dot(tok):
    ids = tok.encode("café €5")
    assert len(ids) > len("café €5")  # the multi-byte characters really are split
    v = SlotView(tok, prompt_len=0, gen_length=len(ids), out=io.StringIO())
    text = ""
    for q, t in enumerate(ids):  # committed one token at a time, left to right
        v.on_commit(0, [q], [t])
        text = _strip_ansi(v.render())
        assert "\ufffd" not in text
    assert text == "café €5"
    # the second byte of 'é' alone, after a gap: a dot, not a replacement character; then whole
    k = len(tok.encode("caf"))
    w = SlotView(tok, prompt_len=0, gen_length=len(ids), out=io.StringIO())
    w.on_commit(0, [k + 1], [ids[k + 1]])
    assert _strip_ansi(w.render()) == "·" * (k + 2)
    w.on_commit(0, list(range(k + 1)), ids[:k + 1])
    assert _strip_ansi(w.render()) == "café"


def test_special_tokens_and_everything_after_eos_are_not_shown(tok):
    eos = tok.eos_id
    body = tok.encode("the cat")
    after = tok.encode(" sat")
    ids = body + [eos] + after
    v = SlotView(tok, prompt_len=5, gen_length=16, out=io.StringIO(), eos_ids=[eos])
    v.on_commit(0, [5 + len(body) + 1 + i for i in range(len(after))], after)  # a later slot first
    assert _strip_ansi(v.render()).endswith("sat")
    v.on_commit(0, list(range(5, 5 + len(ids) - len(after))), body + [eos])
    assert _strip_ansi(v.render()) == "the cat"  # no <|im_end|>, nothing after it


def test_a_frame_taller_than_the_terminal_shows_its_last_lines(tok, monkeypatch):
    ids = tok.encode("\n".join(f"line {i}" for i in range(30)))
    out = io.StringIO()
    v = SlotView(tok, prompt_len=0, gen_length=len(ids), out=out)
    monkeypatch.setattr(v, "_size", lambda: (20, 6))
    v.on_commit(0, list(range(len(ids))), ids)
    rows = v.frame_rows()
    assert len(rows) == 5 and _strip_ansi(rows[-1]) == "line 29"
    assert out.getvalue().count("\n") == 5  # what was drawn fits above the cursor's line


# ---- under a pseudo-terminal ----------------------------------------------------------------------


class Terminal:
    """Just enough of a VT100 for what the view writes: text with deferred auto-wrap, CR, LF with
    scrolling into a history, CSI n F (previous line), CSI J (clear below), SGR (ignored)."""

    def __init__(self, cols: int, rows: int) -> None:
        self.cols, self.rows = cols, rows
        self.screen = [[] for _ in range(rows)]
        self.history: list[list[str]] = []
        self.r = self.c = 0
        self.pending = False

    def _lf(self) -> None:
        if self.r == self.rows - 1:
            self.history.append(self.screen.pop(0))
            self.screen.append([])
        else:
            self.r += 1

    def feed(self, text: str) -> None:
        i = 0
        while i < len(text):
            ch = text[i]
            if ch == "\x1b":
                m = re.match(r"\x1b\[([0-9;]*)([A-Za-z])", text[i:])
                assert m, f"unexpected escape {text[i:i + 8]!r}"
                n = int(m.group(1)) if m.group(1).isdigit() else 1
                if m.group(2) == "F":
                    self.r, self.c = max(0, self.r - n), 0
                elif m.group(2) == "J":
                    self.screen[self.r] = self.screen[self.r][: self.c]
                    for k in range(self.r + 1, self.rows):
                        self.screen[k] = []
                else:
                    assert m.group(2) == "m", m.group(0)
                self.pending = False
                i += len(m.group(0))
                continue
            if ch == "\r":
                self.c, self.pending = 0, False
            elif ch == "\n":
                self._lf()
                self.pending = False
            else:
                if self.pending:
                    self.c, self.pending = 0, False
                    self._lf()
                line = self.screen[self.r]
                line += [" "] * (self.c + 1 - len(line))
                line[self.c] = ch
                self.c += 1
                if self.c == self.cols:
                    self.c, self.pending = self.cols - 1, True
            i += 1

    def lines(self) -> list[str]:
        out = ["".join(line).rstrip() for line in self.history + self.screen]
        while out and not out[-1]:
            out.pop()
        return out


def run_in_pty(argv: list[str], cols: int, rows: int, timeout: float = 120) -> str:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    chunks, deadline = [], time.time() + timeout
    while time.time() < deadline:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=10)
    os.close(master)
    return b"".join(chunks).decode("utf-8", errors="replace")


@pytest.mark.parametrize("decoder,flags", [("speculative", []), ("refusion", ["--slot-size", "4", "--slot-threshold",
                                                                              "0.999", "--token-threshold", "0.99"])])
def test_generate_under_a_terminal_prints_the_answer_once_and_leaves_no_frames(decoder, flags):
    # a held-out prompt with a long answer: many commits (left to right, and out of order in small
    # small, hard-to-take slots), frames taller than the terminal
    prompt = "Add: 14 + 52 + 22"
    base = [sys.executable, "-m", "refusion.cli", "generate", prompt, "--gen-length", "128", "--threads", "1",
            "--decoder", decoder, *flags]
    plain = subprocess.run(base + ["--no-view"], capture_output=True, text=True, check=True).stdout
    cols, rows = 30, 4  # narrow and short: the answer wraps, and frames are taller than the terminal
    raw = run_in_pty(base, cols, rows)
    assert "Traceback" not in raw
    assert raw.count("\x1b[J") >= 5  # the view drew (and replaced) many frames
    term = Terminal(cols, rows)
    term.feed(raw)
    wrapped = []
    for line in plain.splitlines():  # the answer as the terminal wraps it (at the last column)
        wrapped += [line[i:i + cols].rstrip() for i in range(0, max(len(line), 1), cols)]
    got = term.lines()
    stats = next(i for i, line in enumerate(got) if line.startswith(f"[{decoder}]"))
    assert got[:stats] == wrapped  # the answer once, and nothing the frames left behind
    assert "<|im_end|>" not in raw and "\ufffd" not in raw
