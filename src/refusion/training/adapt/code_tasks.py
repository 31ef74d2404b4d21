"""Function requests asked the way MBPP asks them, written by the model itself (no test split, nothing
from a hub):

    statements  the model's own user turns begun with "Write a python function to" or "Write a function
                to" (magpie.py's `lead`, half each): the first line, kept when it reads as one task
    tests       the model's continuation of "<statement>\\nYour code should pass these tests:\\n\\nassert":
                its first assert lines (up to three) that parse as Python

The tests need not hold: like MBPP's they show the function's name and how it is called, so that the
answers learned from are the kind the model gives MBPP's prompts (which copy from those lines). Each
statement that nearly repeats an MBPP test or HumanEval task is dropped and counted.
"""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from refusion.tasks.code import MBPP_TESTS, mbpp_prompt
from refusion.training.adapt import magpie
from refusion.training.adapt.held_out import HeldOut, task_words
from refusion.training.adapt.recipe import estimate_seconds

if TYPE_CHECKING:
    from refusion.model.tokenizer import Tokenizer
    from refusion.model.transformer import Transformer

LEADS = ("Write a python function to", "Write a function to")  # (even seeds, odd seeds)
MOST_TESTS = 3  # (MBPP's)


def statement(text: str, finished: bool) -> str | None:
    """A sampled request's first line where it reads as one task: a sentence of a few words, no code;
    None otherwise (a line the model had not ended is not one)."""
    first, newline, _ = text.strip().partition("\n")
    line = first.strip()
    if not (newline or finished) or not 30 <= len(line) <= 200 or not line.endswith(".") or "`" in line:
        return None
    return line


def tests_of(continuation: str, finished: bool) -> list[str]:
    """The assert lines a continuation of "assert" starts with (that word given back to its first
    line), up to MOST_TESTS; the first line that is not one assert statement ends them, and so does
    the last line of a continuation that was cut off (it may be a cut assert)."""
    out = []
    lines = ("assert" + continuation).split("\n")
    for line in lines if finished else lines[:-1]:
        line = line.rstrip()
        if not line.startswith("assert "):
            break
        try:
            body = ast.parse(line).body
        except SyntaxError:
            break
        if len(body) != 1 or not isinstance(body[0], ast.Assert):
            break
        out.append(line)
        if len(out) == MOST_TESTS:
            break
    return out


def code_tasks(model: Transformer, tok: Tokenizer, n: int, held: HeldOut, run_dir: Path, batch_size: int,
               log: Callable[[str], None], parameters: int, progress: bool = True) -> tuple[list[str], int]:
    """n MBPP-style prompts the model wrote (fewer, said in the log, where it rarely writes one), and
    how many of its statements nearly repeated a held-out task. The raw samples are kept in
    run_dir/code_requests.jsonl and run_dir/code_tests.jsonl, so a resumed run draws the same."""
    requests, tests = run_dir / "code_requests.jsonl", run_dir / "code_tests.jsonl"
    drawn = math.ceil(n * 1.5) + 8
    while True:
        log(f"prompts: sampling {drawn} function requests from the model, then their tests "
            f"(first guess {2 * estimate_seconds('user turn', drawn, parameters) / 60:.0f} min)")
        for parity, lead in enumerate(LEADS):
            magpie.sample_user_turns(model, tok, requests, range(parity, drawn, 2), max_tokens=48,
                                     batch_size=batch_size, progress=progress, lead=lead, desc="function requests")
        fresh, dropped = _statements(requests, held)
        _sample_tests(model, tok, tests, fresh, batch_size, progress)
        made = _prompts(fresh, tests)
        if len(made) >= n or drawn >= 4 * n + 8:
            break
        drawn = min(4 * n + 8, drawn + math.ceil(1.5 * (n - len(made))) + 8)
    if len(made) < n:
        log(f"prompts: only {len(made)} of {n} function requests were kept (one task, new, with tests)")
    return made[:n], dropped


def _statements(requests: Path, held: HeldOut) -> tuple[dict[int, str], int]:
    """{seed: statement} of the usable requests, each once, in seed order; and the held-out repeats."""
    seen, fresh, dropped = set(), {}, 0
    for r in sorted(map(json.loads, magpie.records(requests)), key=lambda r: r["seed"]):
        line = statement(r["text"], r["finished"])
        if line is None or (key := magpie.normalized(line)) in seen:
            continue
        seen.add(key)
        if held.repeats(task_words(line)):
            dropped += 1
        else:
            fresh[r["seed"]] = line
    return fresh, dropped


def _sample_tests(model: Transformer, tok: Tokenizer, out: Path, statements: dict[int, str], batch_size: int,
                  progress: bool) -> None:
    """Each statement's tests as the model continues them (sampled from its seed), appended to `out`."""
    from refusion.decoding import ARParams

    prefix = magpie.user_prefix_ids(tok)

    def prompt_of(seed: int) -> list[int]:  # (MBPP's form, the tests begun)
        return prefix + tok.encode(statements[seed] + MBPP_TESTS + "assert", parse_special=False)

    params = ARParams(gen_length=32 * MOST_TESTS, temperature=0.7, top_p=0.95)
    magpie.sample_into(model, tok, out, statements, prompt_of, params, batch_size, progress, "their tests", "task")


def _prompts(statements: dict[int, str], tests: Path) -> list[str]:
    """The prompts of the statements whose tests hold at least one assert, in seed order."""
    sampled = {r["seed"]: r for r in map(json.loads, magpie.records(tests))}
    out = []
    for seed, line in statements.items():
        got = tests_of(sampled[seed]["text"], sampled[seed]["finished"]) if seed in sampled else []
        if got:
            out.append(mbpp_prompt(line, got))
    return out

