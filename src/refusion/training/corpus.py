"""General text for pretraining a base model offline: the Python standard library's own source.

Every machine that runs this project has it (about 12 MB of real code without its test folders), so a
base model can be pretrained on something broader than the task mixture without a dataset hub. Records
keep the project's {"query", "response"} format: the query is "Continue this Python code:" and the
first lines of a passage, the response is the rest of the passage, so a causal LM learns to continue
real code (the loss is on the response, as in every objective here).

The passages are a pure function of (n, seed) on a given Python version; another version's library
gives other passages (this project's configs and CI use Python 3.11).
"""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

CORPORA = ("stdlib",)
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3"}


def stdlib_files() -> list[Path]:
    """The standard library's .py files, without test folders and installed packages, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts)]
    if not files:
        raise FileNotFoundError(f"no Python source under {root}: this interpreter ships its standard library "
                                "without sources; use another corpus or data file")
    return sorted(files)


def stdlib_records(n: int, seed: int = 0, lines: tuple[int, int] = (4, 12), max_chars: int = 400) -> list[dict]:
    """n continuation records from the standard library: a passage of 4-12 lines cut
    at a random place, the first third (at least one line) as the query's code, the rest as the response.

    Passages longer than max_chars are cut at a line end, so records fit short training contexts."""
    rng = random.Random(seed)
    files = stdlib_files()
    texts: dict[Path, list[str]] = {}
    out: list[dict] = []
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 20 * n + 1000:
            raise RuntimeError(f"could not cut {n} passages from the standard library (got {len(out)})")
        path = rng.choice(files)
        if path not in texts:
            texts[path] = path.read_text(encoding="utf-8", errors="replace").splitlines()
        src = texts[path]
        k = rng.randint(*lines)
        if len(src) < k:
            continue
        start = rng.randrange(len(src) - k + 1)
        passage = src[start:start + k]
        while passage and len("\n".join(passage)) > max_chars:
            passage.pop()
        if len(passage) < 3 or not passage[0].strip() or sum(bool(x.strip()) for x in passage) < 3:
            continue  # blank-started or mostly empty passages teach nothing
        cut = max(1, len(passage) // 3)
        head, tail = "\n".join(passage[:cut]), "\n".join(passage[cut:])
        if not tail.strip():
            continue
        out.append({"query": f"Continue this Python code:\n{head}", "response": tail})
    return out


def stdlib_functions(n: int, seed: int = 0, max_chars: int = 1200) -> list[str]:
    """n functions of the standard library as HumanEval-style prompts: a public module-level function's
    `def` line(s) and its docstring, up to the docstring's end (the body left to complete). Drawn from
    the files in a seeded order; each function once. Fewer than n when the library has fewer."""
    return _stdlib_defs(n, seed, max_chars, methods=False)


def stdlib_methods(n: int, seed: int = 0, max_chars: int = 1200) -> list[str]:
    """n methods of the standard library's public classes, as stdlib_functions gives functions: the
    method's `def` line(s) and docstring, dedented to stand alone (its `self` kept). There are about
    three times as many of them as module-level functions, so more code prompts of HumanEval's kind."""
    return _stdlib_defs(n, seed, max_chars, methods=True)


def _stdlib_defs(n: int, seed: int, max_chars: int, methods: bool) -> list[str]:
    import ast

    files = stdlib_files()
    random.Random(seed).shuffle(files)
    out: list[str] = []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(text)
        except SyntaxError:  # (a library file of another Python's grammar)
            continue
        lines = text.splitlines()
        if methods:
            nodes = [m for c in tree.body if isinstance(c, ast.ClassDef) and not c.name.startswith("_")
                     for m in c.body]
        else:
            nodes = tree.body
        for node in nodes:
            if (not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or node.decorator_list
                    or len(node.body) < 2 or ast.get_docstring(node) is None):
                continue  # a docstring and something after it to write
            indent = " " * node.col_offset
            head = "\n".join(x.removeprefix(indent) for x in lines[node.lineno - 1:node.body[0].end_lineno]) + "\n"
            if len(head) <= max_chars:
                out.append(head)
                if len(out) == n:
                    return out
    return out


def corpus_records(name: str, n: int, seed: int = 0) -> list[dict]:
    """n records of corpus `name` (one of CORPORA)."""
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; known corpora: {', '.join(CORPORA)}")
    return stdlib_records(n, seed)
