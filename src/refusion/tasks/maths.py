"""GSM8K, MATH (all 5000 test problems) and MATH-500, zero-shot for chat models.

GSM8K answers are read after the last "####" (else the last number); MATH answers from the last
\\boxed{} of the output, compared after the usual normalisation (spaces, \\left/\\right, \\dfrac, units
in \\text{}, degrees, dollars, "x =", thousands separators, trailing ".0"). Equivalent forms that
need algebra (0.5 vs \\frac{1}{2}, 2\\sqrt{2} vs \\sqrt{8}) are counted wrong, as in the Minerva scorer.
"""

from __future__ import annotations

import re

from . import Example, Score, Task
from .common import extract_final_number, numbers_equal, subset
from .sources import request_docs

GSM8K_INSTRUCTION = "Solve the problem step by step. End with the final answer on its own line as '#### <number>'."
MATH_INSTRUCTION = "Solve the problem step by step. Put the final answer in \\boxed{}."


# ---- GSM8K ---------------------------------------------------------------------------------


def load_gsm8k(split: str = "test", n: int | None = None, seed: int = 0) -> list[Example]:
    _test_only("gsm8k", split)
    exs = [Example(f"gsm8k/{i}", f"{d['question']}\n\n{GSM8K_INSTRUCTION}", d["answer"],
                   (d.get("short_answer") or extract_final_number(d["answer"])).replace(",", ""))
           for i, d in enumerate(request_docs("gsm8k"))]
    return subset(exs, n, seed)


def score_gsm8k(ex: Example, output: str) -> Score:
    got = extract_final_number(output)
    return Score(got, numbers_equal(got, str(ex.answer)))


# ---- MATH ----------------------------------------------------------------------------------


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...} (balanced braces), or of "\\boxed 5"."""
    i = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if i < 0:
        return None
    j = text.index("{", i) if "{" in text[i:i + 8] else -1
    if j < 0:  # "\boxed 5"
        m = re.match(r"\\(?:boxed|fbox)\s+([^\s$]+)", text[i:])
        return m.group(1) if m else None
    depth = 0
    for k in range(j, len(text)):
        depth += {"{": 1, "}": -1}.get(text[k], 0)
        if depth == 0:
            return text[j + 1:k]
    return None


def normalize_math(s: str) -> str:
    s = s.strip()
    for a, b in (("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\:", ""), ("\\left", ""), ("\\right", ""),
                 ("dfrac", "frac"), ("tfrac", "frac"), ("^\\circ", ""), ("^{\\circ}", ""), ("\\%", ""), ("%", ""),
                 ("\\$", ""), ("$", ""), ("\\displaystyle", "")):
        s = s.replace(a, b)
    s = re.sub(r"(\d)\s*\\(?:text|mbox|mathrm)\{\s*[a-zA-Z ]+\}(\^\d)?$", r"\1", s)  # units after a number
    s = re.sub(r"\\(?:text|mbox|mathrm)\{([^{}]*)\}", r"\1", s)
    if re.match(r"^[a-zA-Z]\s*=", s) and s.count("=") == 1:
        s = s.split("=", 1)[1]
    s = s.replace(" ", "").rstrip(".")
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\d)", r"\\sqrt{\1}", s)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s) or re.fullmatch(r"-?\d{1,3}(\{,\}\d{3})+(\.\d+)?", s):
        s = s.replace("{,}", "").replace(",", "")
    if re.fullmatch(r"-?\d+\.0+", s):
        s = s.split(".")[0]
    if s.startswith("0.") is False and re.fullmatch(r"-?\.\d+", s):
        s = s.replace(".", "0.", 1)
    return s


def math_equal(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return False
    na, nb = normalize_math(a), normalize_math(b)
    return na == nb or numbers_equal(na, nb)


def _load_math(name: str, split: str, n: int | None, seed: int) -> list[Example]:
    _test_only(name, split)
    exs = []
    for i, d in enumerate(request_docs(name)):
        gold = last_boxed(d["solution"])  # the `answer` field is sometimes garbled (spec of the data)
        exs.append(Example(f"{name}/{i}", f"{d['problem']}\n\n{MATH_INSTRUCTION}", d["solution"], gold,
                           {"level": d.get("level"), "type": d.get("type")}))
    return subset(exs, n, seed)


def score_math(ex: Example, output: str) -> Score:
    got = last_boxed(output)
    return Score(got, math_equal(got, ex.answer))


def _test_only(name: str, split: str) -> None:
    if split != "test":
        raise ValueError(f"{name} has only a 'test' split here (never train on it)")


TASKS: dict[str, Task] = {
    "gsm8k": Task("gsm8k", "math", ("test",), load_gsm8k, score_gsm8k, "GSM8K test (1319), '####' / last number"),
    "math": Task("math", "math", ("test",), lambda split="test", n=None, seed=0: _load_math("math", split, n, seed),
                 score_math, "MATH test (5000), last \\boxed{} normalised"),
    "math500": Task("math500", "math", ("test",),
                    lambda split="test", n=None, seed=0: _load_math("math500", split, n, seed), score_math,
                    "MATH-500, last \\boxed{} normalised"),
}
