"""MBPP (500 test problems) and HumanEval (164), scored by running their tests in the sandbox."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable

from refusion.tasks import Example, Score, Task
from refusion.tasks.common import extract_code, subset
from refusion.tasks.sources import request_docs


def load_mbpp(split: str = "test", n: int | None = None, seed: int = 0) -> list[Example]:
    if split != "test":
        raise ValueError("mbpp has only a 'test' split here")
    exs = []
    for d in request_docs("mbpp"):
        tests = ast.literal_eval(d["test_list"]) if isinstance(d["test_list"], str) else d["test_list"]
        prompt = mbpp_prompt(d["text"], tests)
        exs.append(Example(f"mbpp/{d['task_id']}", prompt, d["code"].replace("\r\n", "\n"),
                           {"tests": tests, "setup": d.get("test_setup_code") or ""}))
    return subset(exs, n, seed)


MBPP_TESTS = "\nYour code should pass these tests:\n\n"


def mbpp_prompt(statement: str, tests: list[str]) -> str:
    """The user message of an MBPP task: its statement, then its asserts (MBPP's, and self-generated
    training data's)."""
    return statement + MBPP_TESTS + "\n".join(tests)


def complete_function_prompt(code: str) -> str:
    """The user message asking to complete a function (a signature and its docstring): HumanEval's,
    and self-generated training data's."""
    return f"Complete the following Python function.\n```python\n{code}```"


def load_humaneval(split: str = "test", n: int | None = None, seed: int = 0) -> list[Example]:
    if split != "test":
        raise ValueError("humaneval has only a 'test' split here")
    exs = []
    for d in request_docs("humaneval"):
        exs.append(Example(d["task_id"], complete_function_prompt(d["prompt"]), d["prompt"] + d["canonical_solution"],
                           {"prompt": d["prompt"], "test": d["test"], "entry_point": d["entry_point"]}))
    return subset(exs, n, seed)


def program_for(ex: Example, output: str) -> tuple[str, str]:
    """(program, tests) for a sample: the model's code, and the task's tests that run after it."""
    code = extract_code(output)
    if "entry_point" in ex.answer:  # HumanEval
        # A bare body continues the given signature. A whole function still gets the prompt first: it
        # brings the imports and helper functions some problems define there (the docstring-only
        # definition in the prompt is valid Python and the model's own definition replaces it).
        defines = re.search(rf"^\s*def\s+{re.escape(ex.answer['entry_point'])}\s*\(", code, re.M)
        code = ex.answer["prompt"] + ("\n\n" if defines else "") + code
        return code + "\n", f"{ex.answer['test']}\n\ncheck({ex.answer['entry_point']})\n"
    return code + "\n", "\n".join([ex.answer["setup"], *ex.answer["tests"]]) + "\n"


def sandbox_scorers(program: Callable[[Example, str], tuple[str, str]], timeout_s: float
                    ) -> tuple[Callable[[Example, str], Score], Callable[[list[Example], list[str]], list[Score]]]:
    """(score, score_many) for a code task: a sample is correct when the task's tests, run in the sandbox
    after the model's code (program(example, output) gives both), run to their end without failing; an
    answer that exits early fails whatever its exit status. score_many runs in parallel."""
    def score(ex: Example, output: str) -> Score:
        from refusion.tasks.sandbox import run_python

        code, tests = program(ex, output)
        return Score(extract_code(output), run_python(code, timeout_s=timeout_s, tests=tests).passed)

    def score_many(examples: list[Example], outputs: list[str]) -> list[Score]:
        from refusion.tasks.sandbox import run_many

        pairs = [program(ex, out) for ex, out in zip(examples, outputs, strict=True)]
        results = run_many([c for c, _ in pairs], timeout_s=timeout_s, tests=[t for _, t in pairs])
        return [Score(extract_code(out), r.passed) for out, r in zip(outputs, results, strict=True)]

    return score, score_many


score_code, score_code_many = sandbox_scorers(program_for, timeout_s=10)


TASKS: dict[str, Task] = {
    "mbpp": Task("mbpp", "code", ("test",), load_mbpp, score_code, "MBPP test (500), its asserts", score_code_many),
    "humaneval": Task("humaneval", "code", ("test",), load_humaneval, score_code, "HumanEval (164), check()",
                      score_code_many),
}
