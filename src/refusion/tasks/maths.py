"""GSM8K, MATH (all 5000 test problems) and MATH-500, zero-shot for chat models.

GSM8K answers are read after the last "####" (else the last number); MATH answers from the last
\\boxed{} of the output, compared after the usual string normalisation (spaces, \\left/\\right, \\dfrac,
"\\frac12" and "1/2" -> "\\frac{1}{2}", "\\sqrt2", trailing units in \\text{}, degrees, percent,
dollars, "x =", thousands separators, trailing "." and ".0"), then numerically when both are plain numbers.
Equivalent forms that need algebra (0.5 vs \\frac{1}{2}, 2\\sqrt{2} vs \\sqrt{8}, reordered sets)
are counted wrong, as in the Minerva and Hendrycks scorers.
"""

from __future__ import annotations

import re

from refusion.tasks import Example, Score, Task
from refusion.tasks.common import extract_final_number, numbers_equal, subset
from refusion.tasks.sources import request_docs

GSM8K_INSTRUCTION = "Solve the problem step by step. End with the final answer on its own line as '#### <number>'."
MATH_INSTRUCTION = "Solve the problem step by step. Put the final answer in \\boxed{}."


# ---- GSM8K ---------------------------------------------------------------------------------


def gsm8k_prompt(question: str) -> str:
    """The user message of a GSM8K question (the benchmark's, and self-generated training data's)."""
    return f"{question}\n\n{GSM8K_INSTRUCTION}"


def load_gsm8k(split: str = "test", n: int | None = None, seed: int = 0) -> list[Example]:
    _test_only("gsm8k", split)
    exs = [Example(f"gsm8k/{i}", gsm8k_prompt(d["question"]), d["answer"],
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


def _arg_end(s: str, k: int) -> int:
    """End of one TeX argument starting at s[k]: a {group}, a \\command, or one character."""
    if s[k] == "{":
        depth = 0
        for e in range(k, len(s)):
            depth += {"{": 1, "}": -1}.get(s[e], 0)
            if depth == 0:
                return e + 1
        return len(s)
    if s[k] == "\\":
        m = re.match(r"\\[a-zA-Z]+", s[k:])
        return k + (m.end() if m else 2)
    return k + 1


def _brace_args(s: str, cmd: str, nargs: int) -> str:
    """Write `cmd`'s arguments in braces: "\\frac12", "\\frac 1{72}" -> "\\frac{1}{2}"; "\\sqrt2" -> "\\sqrt{2}"."""
    out, i = "", 0
    while (j := s.find(cmd, i)) >= 0:
        k = j + len(cmd)
        out += s[i:k]
        if cmd == "\\sqrt" and s.startswith("[", k):  # \sqrt[3]{x}: keep the index as written
            e = s.find("]", k)
            e = len(s) if e < 0 else e + 1
            out, k = out + s[k:e], e
        for _ in range(nargs):
            if k >= len(s):
                break
            e = _arg_end(s, k)
            arg = s[k + 1:e - 1] if s[k] == "{" and s[e - 1] == "}" else s[k:e]
            out += "{" + _brace_args(arg, cmd, nargs) + "}"  # nested fractions too
            k = e
        i = k
    return out + s[i:]


# A trailing unit in words after the answer: "10\text{ cm}", "18\text{ ways.}", "8\sqrt{3}\text { square inches}".
# Not \mathrm (\mathrm{i} is a number) and not one letter without MATH's leading space ("\text{m}" stays).
_UNIT = re.compile(r"^(.+?)\s*\\(?:text|textbf|mbox)\s*\{(?:\s+[A-Za-z][A-Za-z.\s]*|[A-Za-z][A-Za-z.\s]+)\}"
                   r"(?:\^\{?\d\}?)?\s*\.?$")


def normalize_math(s: str) -> str:
    """Canonical string form of a MATH answer (Minerva/Hendrycks-style string normalisation)."""
    s = s.strip()
    # Spacing and sizing commands, degrees, percent and dollar signs carry no value.
    for a, b in (("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\:", ""), ("\\left", ""), ("\\right", ""),
                 ("\\displaystyle", ""), ("dfrac", "frac"), ("tfrac", "frac"), ("^\\circ", ""), ("^{\\circ}", ""),
                 ("\\degree", ""), ("°", ""), ("\\%", ""), ("%", ""), ("\\$", ""), ("$", "")):
        s = s.replace(a, b)
    if m := _UNIT.match(s):  # units only when something precedes them: "\text{Evelyn}" is an answer
        s = m.group(1)
    s = re.sub(r"\\(?:text|textbf|mbox|mathrm)\s*\{([^{}]*)\}", r"\1", s)
    left, eq, right = s.partition("=")
    if eq and "=" not in right and len(left.strip()) <= 2:  # "x = 3" -> "3" (but keep "x^2+y^2=13")
        s = right
    s = re.sub(r"(?<!\\)\\ ", "", s)  # "\ " is a space; "\\ " (a matrix row break) is not
    s = re.sub(r"\s+", "", s).rstrip(".")
    s = _brace_args(_brace_args(s, "\\frac", 2), "\\sqrt", 1)
    if m := re.fullmatch(r"(-?\d+)/(\d+)", s):  # "1/2" -> "\frac{1}{2}"
        s = f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}"
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s) or re.fullmatch(r"-?\d{1,3}(\{,\}\d{3})+(\.\d+)?", s):
        s = s.replace("{,}", "").replace(",", "")  # thousands separators, only in a lone number
    if re.fullmatch(r"-?\d+\.0+", s):
        s = s.split(".")[0]
    if re.fullmatch(r"-?\.\d+", s):
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
