"""Answer extraction and normalisation on hand-written outputs (no download)."""

import pytest

from refusion.tasks import Example
from refusion.tasks.common import extract_code, extract_final_number, extract_letter, subset
from refusion.tasks.maths import last_boxed, math_equal, normalize_math, score_gsm8k
from refusion.tasks.code import program_for
from refusion.tasks.sandbox import run_python


def test_gsm8k_numbers():
    ex = Example("g", "", None, "1234")
    assert score_gsm8k(ex, "so she pays $1,234.\n#### 1,234").correct
    assert score_gsm8k(ex, "The answer is 1234.0").correct
    assert not score_gsm8k(ex, "#### 1235\nor maybe 1234").correct  # the #### line wins over later numbers
    assert extract_final_number("nothing here") is None


@pytest.mark.parametrize("text,boxed", [
    ("so \\boxed{5}.", "5"),
    ("first \\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
    ("nested \\boxed{\\sqrt{x^{2}}}", "\\sqrt{x^{2}}"),
    ("\\fbox{7}", "7"),
    ("$\\boxed 9$", "9"),
    ("no box", None),
    ("\\boxed{unclosed", None),
])
def test_last_boxed(text, boxed):
    assert last_boxed(text) == boxed


@pytest.mark.parametrize("a,b,same", [
    ("\\dfrac{1}{2}", "\\frac12", True),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})", True),
    ("10\\text{ cm}", "10", True),
    ("90^\\circ", "90", True),
    ("\\$5.00", "5", True),
    ("x = 3", "3", True),
    ("1,000", "1000", True),
    ("5.", "5", True),
    ("0.5", "\\frac{1}{2}", False),  # needs algebra: counted wrong, as in the Minerva scorer
    ("2", "3", False),
    ("\\text{(B)}", "(B)", True),
    ("\\frac{68}{3}\\text{ pounds}", "\\frac{68}{3}", True),  # units after a non-number too
    ("18\\text{ ways.}", "18", True),
    ("8\\sqrt{3} \\text { square inches}", "8\\sqrt3", True),
    ("\\frac 9{20}", "\\frac{9}{20}", True),  # unbraced arguments, as MATH solutions often write them
    ("\\frac{\\sqrt6}3", "\\frac{\\sqrt{6}}{3}", True),
    ("\\frac\\pi4", "\\frac{\\pi}{4}", True),
    ("1/2", "\\frac12", True),
    ("1+\\sqrt 2,\\ 1-\\sqrt 2", "1+\\sqrt{2},1-\\sqrt{2}", True),
    ("\\text{Evelyn}", "Evelyn", True),  # a word alone is the answer, not a unit
    ("3+4\\mathrm{i}", "3+4", False),  # \\mathrm{i} is a number, never a unit
    ("x^2 + y^2 = 13", "13", False),  # only a lone "x =" is dropped
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", True),
    ("50\\%", "50", True),
    ("12{,}000", "12000", True),
    ("\\frac{1}{3}", "\\frac{1}{4}", False),
])
def test_math_normalisation(a, b, same):
    assert math_equal(a, b) is same, (normalize_math(a), normalize_math(b))


def test_letters_and_code_extraction():
    assert extract_letter("Answer: c") == "C"
    assert extract_letter("The answer is (B).") == "B"
    assert extract_letter("D. because the others are wrong") == "D"
    assert extract_letter("Answer: E", "ABCDE") == "E" and extract_letter("Answer: E") is None
    assert extract_code("text\n```python\nx = 1\n```\nmore ```y```") == "x = 1"
    assert extract_code("```\ny = 2\n```") == "y = 2"
    assert extract_code("    return x\n") == "    return x"  # a bare body keeps its indentation


def passes(program_and_tests: tuple[str, str]) -> bool:
    code, tests = program_and_tests
    return run_python(code, tests=tests).passed


def test_humaneval_program_accepts_a_bare_body_or_a_whole_function():
    ex = Example("HumanEval/x", "", None, {"prompt": "def add(a, b):\n    \"\"\"Add.\"\"\"\n",
                                           "test": "def check(f):\n    assert f(2, 3) == 5\n", "entry_point": "add"})
    assert passes(program_for(ex, "    return a + b\n"))
    assert passes(program_for(ex, "```python\ndef add(a, b):\n    return a + b\n```"))
    assert not passes(program_for(ex, "    return a - b\n"))
    mbpp = Example("mbpp/1", "", None, {"tests": ["assert sq(3) == 9"], "setup": ""})
    assert passes(program_for(mbpp, "def sq(x):\n    return x * x"))
    assert not passes(program_for(mbpp, "def sq(x):\n    return x + x"))


def test_humaneval_program_keeps_the_prompts_helpers():
    # HumanEval prompts sometimes define helpers and imports; a model that rewrites only the entry point
    # still has them.
    prompt = "from typing import List\n\ndef double(x):\n    return 2 * x\n\ndef f(xs: List[int]):\n    \"\"\"Doc.\"\"\"\n"
    ex = Example("HumanEval/y", "", None, {"prompt": prompt, "entry_point": "f",
                                           "test": "def check(g):\n    assert g([1, 2]) == [2, 4]\n"})
    assert passes(program_for(ex, "```python\ndef f(xs: List[int]):\n    return [double(x) for x in xs]\n```"))
    assert not passes(program_for(ex, "def f_other(xs):\n    return xs\n"))  # not the entry point


def test_subset_is_seeded():
    exs = [Example(str(i), "", None, i) for i in range(50)]
    assert subset(exs, None, 0) == exs
    a, b = subset(exs, 10, 1), subset(exs, 10, 1)
    assert a == b and a != subset(exs, 10, 2) and len({e.id for e in a}) == 10
