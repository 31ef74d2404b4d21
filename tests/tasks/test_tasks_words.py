"""Word task families (sort, add, repeat) and the trainer's "tasks:..." data source."""

import importlib
import re
import subprocess
import sys

import pytest

from refusion.training.data import DataError, task_names, task_records
from refusion.tasks import _MODULES, all_tasks
from refusion.tasks.words import TASKS, load
from refusion.training.setup import setup
from refusion.training.step import train_step
from refusion.training.trainer import TrainConfig, load_train_config

pytestmark = pytest.mark.usefixtures("one_thread")


def test_names_do_not_clash_with_other_families():
    names = [n for mod in _MODULES for n in importlib.import_module(f"refusion.tasks.{mod}").TASKS]
    assert len(names) == len(set(names)) and set(TASKS) <= set(all_tasks())


@pytest.mark.parametrize("name", sorted(TASKS))
def test_gold_targets_score_correct(name):
    exs = load(name, "test", 200)
    assert all(TASKS[name].score(e, e.target).correct for e in exs)
    assert all(TASKS[name].score(e, "\n " + e.target.replace(" ", "  ") + "\n").correct for e in exs[:20])


def test_targets_are_what_the_prompt_asks_for():
    for e in load("sort", "test", 50):
        nums = [int(x) for x in e.prompt.removeprefix("Sort: ").split()]
        assert [int(x) for x in e.target.split()] == sorted(nums)
    for e in load("add", "test", 50):
        assert e.answer == sum(int(x) for x in e.prompt.removeprefix("Add: ").split(" + "))
        assert e.target.endswith(f"#### {e.answer}")
        for line in e.target.splitlines()[:-1]:  # "68 + 12: 8 + 2 = 10, 6 + 1 + 1 = 8, so 80"
            head, units, tens, result = re.fullmatch(r"(.*): (.*), (.*), so (\d+)", line).groups()
            a, b = map(int, head.split(" + "))
            assert int(result) == a + b < 100
            assert units == f"{a % 10} + {b % 10} = {a % 10 + b % 10}"
            carry = " + 1" if a % 10 + b % 10 >= 10 else ""
            assert tens == f"{a // 10} + {b // 10}{carry} = {(a + b) // 10}"
    for e in load("repeat", "test", 50):
        head, words = e.prompt.split(": ")
        k = int(head.split()[-2])
        want = " ".join([words] * k) if "each word" not in head else " ".join(w for w in words.split() for _ in range(k))
        assert " ".join(e.target.split()) == want


def test_wrong_answers_score_incorrect():
    s = load("sort", "test", 1)[0]
    nums = s.target.split()
    swapped = " ".join([nums[1], nums[0]] + nums[2:])
    assert not TASKS["sort"].score(s, swapped).correct
    assert not TASKS["sort"].score(s, " ".join(nums[:-1])).correct  # one number short
    assert not TASKS["sort"].score(s, s.target + " " + nums[-1]).correct  # one too many
    a = load("add", "test", 1)[0]
    assert not TASKS["add"].score(a, a.target.replace(f"#### {a.answer}", f"#### {a.answer + 1}")).correct
    assert TASKS["add"].score(a, f"#### {a.answer}").correct  # the final answer is what counts
    assert not TASKS["add"].score(a, "").correct
    r = load("repeat", "test", 1)[0]
    assert not TASKS["repeat"].score(r, r.target.rsplit(" ", 1)[0]).correct
    assert not TASKS["repeat"].score(r, r.target.replace(r.target.split()[0], "owlx", 1)).correct


# ---- the trainer's data source -----------------------------------------------------------


def test_task_names_parses_and_rejects_unknown_names():
    assert task_names("tasks:sort,add,repeat") == ["sort", "add", "repeat"]
    assert task_names("tasks: sort , arith") == ["sort", "arith"]
    assert task_names("synthetic") is None and task_names("data/train.jsonl") is None
    with pytest.raises(DataError, match=r"unknown task\(s\) nope, sorted.*known tasks: .*repeat") as e:
        task_names("tasks:sort,nope,sorted")
    assert "\n" not in str(e.value)
    with pytest.raises(DataError, match="at least one task"):
        task_names("tasks:")
    with pytest.raises(DataError, match="unknown task"):
        TrainConfig(data="tasks:sort,nope").validate()
    with pytest.raises(DataError, match="unknown task"):
        load_train_config(None, ["data=tasks:nope"])


def test_task_records_interleave_equal_shares():
    recs = task_records(["sort", "add", "repeat"], 10, seed=3)
    assert len(recs) == 10 and set(recs[0]) == {"query", "response"}
    assert [r["query"].split()[0] for r in recs[:6]] == ["Sort:", "Add:", "Repeat"] * 2
    sort = load("sort", "train", 4, seed=3)
    assert [r["query"] for r in recs[0::3]] == [e.prompt for e in sort]
    assert recs == task_records(["sort", "add", "repeat"], 10, seed=3)


def test_trainer_trains_on_a_task_mixture(tmp_path):
    cfg = TrainConfig(data="tasks:sort,repeat", synthetic_examples=48, out_dir=str(tmp_path), vocab_size=300,
                      model={"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2,
                             "num_kv_heads": 1}, batch_size=8, max_steps=2, warmup_steps=1, save_every=1000)
    run = setup(cfg)
    assert len(run.examples) == 48
    assert run.tokenizer.decode(run.examples[0].prompt).count("Sort: ") == 1
    rec = train_step(run)
    assert rec["loss"] > 0 and rec["step"] == 1


def test_cli_names_an_unknown_task_in_one_line(tmp_path):
    p = subprocess.run([sys.executable, "-m", "refusion.cli", "train", "--data", "tasks:sort,nope",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [p.stderr.strip()] and "unknown task(s) nope" in p.stderr
