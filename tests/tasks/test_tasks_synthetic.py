"""Synthetic task families (and, for determinism and disjoint splits, the word tasks): determinism, disjoint splits, gold scores correct, wrong answers do not."""

import json

import pytest

from refusion.training.data import synthetic_records
from refusion.tasks import Example, all_tasks, get_task, words
from refusion.tasks.synthetic import TASKS, extract_code, extract_final_number, extract_letter, load, mixture


GENERATED = sorted([*TASKS, *words.TASKS])  # every generated family: these and the word tasks


@pytest.mark.parametrize("name", GENERATED)
def test_deterministic_and_seeded(name):
    load = get_task(name).load
    a, b, c = load("test", 20, seed=0), load("test", 20, seed=0), load("test", 20, seed=1)
    assert [(e.prompt, e.target, e.answer) for e in a] == [(e.prompt, e.target, e.answer) for e in b]
    assert [e.prompt for e in a] != [e.prompt for e in c]
    assert [e.id for e in a] == [f"{name}/test/{i}" for i in range(20)]


@pytest.mark.parametrize("name", GENERATED)
def test_train_and_test_never_overlap(name):
    load = get_task(name).load
    train = {e.prompt for seed in (0, 1) for e in load("train", 3000, seed=seed)}
    test = [e.prompt for e in load("test", 300)]
    assert len(set(test)) == len(test) and not train & set(test)


def test_a_generated_split_refuses_more_examples_than_it_supplies_before_generating_any():
    from refusion.tasks import get_task
    from refusion.tasks import synthetic, words
    from refusion.tasks.common import MAX_GENERATED

    sizes = {**synthetic.TEST_SIZES, **words.TEST_SIZES}
    assert set(sizes) == set(synthetic.TASKS) | set(words.TASKS)
    for name, size in sizes.items():
        with pytest.raises(ValueError, match=f"task '{name}' supplies at most {size} distinct test examples; "
                                             f"n {size + 1} asks for more"):
            get_task(name).load("test", n=size + 1)
        with pytest.raises(ValueError, match=f"at most {MAX_GENERATED} train examples"):
            get_task(name).load("train", n=10**12)  # (would take days and terabytes to generate)
    # the smallest family supplies the size it declares
    exs = load("code", "test", synthetic.TEST_SIZES["code"])
    assert len({e.prompt for e in exs}) == synthetic.TEST_SIZES["code"]


@pytest.mark.parametrize("name", ["arith", "choice", "table"])
def test_gold_targets_score_correct(name):
    exs = load(name, "test", 200)
    assert all(TASKS[name].score(e, e.target).correct for e in exs)


def test_code_gold_passes_and_wrong_code_fails():
    exs = load("code", "test", 30)
    scores = TASKS["code"].score_many(exs, [e.target for e in exs])
    assert all(s.correct for s in scores)
    # a function that returns the wrong constant, and another example's function, fail the hidden tests
    wrong = [f"def {e.meta['entry_point']}(*a):\n    return None" for e in exs]
    assert not any(s.correct for s in TASKS["code"].score_many(exs, wrong))
    shifted = [exs[(i + 1) % len(exs)].target for i in range(len(exs))]
    assert sum(s.correct for s in TASKS["code"].score_many(exs, shifted)) == 0
    fenced = "Here it is:\n```python\n" + exs[0].target + "\n```\nDone."
    assert TASKS["code"].score(exs[0], fenced).correct


def test_wrong_answers_score_incorrect():
    (a,) = load("arith", "test", 1)
    assert not TASKS["arith"].score(a, a.target.replace(f"#### {a.answer}", f"#### {a.answer + 1}")).correct
    (c,) = load("choice", "test", 1)
    other = next(x for x in "ABCD" if x != c.answer)
    assert not TASKS["choice"].score(c, f"Answer: {other}").correct
    t = next(e for e in load("table", "test", 20) if e.meta["format"] == "text")
    lines = t.target.splitlines()
    bad = "\n".join(lines[:-1] + [lines[-1] + "1"])  # one wrong number in the last row
    assert not TASKS["table"].score(t, bad).correct
    assert TASKS["table"].score(t, "\n\n" + t.target.replace(" = ", "  =  ") + "\n").correct  # whitespace only
    j = next(e for e in load("table", "test", 40) if e.meta["format"] == "json")
    assert TASKS["table"].score(j, json.dumps(json.loads(j.target), indent=2)).correct
    assert not TASKS["table"].score(j, "[1, 2").correct


def test_extraction_edge_cases():
    assert extract_final_number("so 3 + 4 = 7.\n#### 1,234") == "1234"
    assert extract_final_number("no marker, the answer is 42.") == "42"
    assert extract_final_number("nothing") is None
    assert extract_letter("The largest is 41.\nAnswer: b") == "B"
    assert extract_letter("I think the answer is C") == "C"
    assert extract_letter("none here") is None
    assert extract_code("```python\ndef f():\n    return 1\n```") == "def f():\n    return 1"
    assert extract_code("def f():\n    return 1") == "def f():\n    return 1"


def test_mixture_interleaves_tasks_and_feeds_training():
    m = mixture("train", 10)
    assert [r["task"] for r in m[:4]] == ["arith", "code", "choice", "table"] and len(m) == 10
    recs = synthetic_records(8)
    assert recs == [{"query": r["query"], "response": r["response"]} for r in mixture("train", 8)]


def test_registry_lists_the_synthetic_tasks():
    tasks = all_tasks()
    assert {"arith", "code", "choice", "table"} <= set(tasks)
    assert {tasks[n].kind for n in ("arith", "code", "choice", "table")} == {"math", "code", "multiple_choice",
                                                                             "structured"}
    with pytest.raises(ValueError, match="splits 'train' and 'test'"):
        load("arith", "dev")
    assert isinstance(load("arith", "test", 1)[0], Example)
