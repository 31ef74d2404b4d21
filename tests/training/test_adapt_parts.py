"""The parts of `refusion adapt` on hand-made cases: the domain mix, the held-out chat set and the check
that keeps training prompts off it, the model's own user turns (Magpie) and function requests (MBPP's
way), the choice of decoding settings."""

import gzip
import json
from pathlib import Path

import pytest

from refusion.model.checkpoint import load_model
from refusion.model.tokenizer import Tokenizer
from refusion.tasks.chat import load_chat
from refusion.tasks.maths import gsm8k_prompt
from refusion.tasks.sources import gsm8k_train_questions
from refusion.tasks.code import load_mbpp
from refusion.training.adapt import code_tasks, magpie, prompts
from refusion.training.adapt.held_out import HeldOut, held_out_chat, held_out_code, task_words
from refusion.training.adapt.measure import CANDIDATES, choose, choose_at_batch, held_out_examples, summarize, to_time
from refusion.training.adapt.prompts import choose_prompts, domain_counts, parse_mix, user_prompts
from refusion.training.adapt import recipe
from refusion.training.adapt.recipe import Budget, Options
from refusion.training.self_generate import load_prompts
from tests.helpers.tiny_causal_lm import make_causal_lm

ROOT = Path(__file__).parents[2]
KEPT = ROOT / "configs" / "smollm2-refusion-data.jsonl.gz"


def test_mix_and_counts():
    assert parse_mix("prose=1,maths=1,code=1") == {"prose": 1.0, "maths": 1.0, "code": 1.0}
    assert parse_mix("code=2, maths=0") == {"code": 2.0}
    assert domain_counts({"prose": 1.0, "maths": 1.0, "code": 1.0}, 3600) == {"prose": 1200, "maths": 1200, "code": 1200}
    assert domain_counts({"prose": 1.0, "maths": 1.0, "code": 1.0}, 7) == {"prose": 3, "maths": 2, "code": 2}
    assert domain_counts({"prose": 3.0, "code": 1.0}, 10) == {"prose": 8, "code": 2}  # 7.5 / 2.5: the tie goes first
    for bad in ("poetry=1", "code=-1", "code=x", "code=nan", "code=0", ""):
        with pytest.raises(ValueError, match="--mix"):
            parse_mix(bad)


def test_user_prompts_file_forms(tmp_path):
    (tmp_path / "a.txt").write_text("Write a haiku.\n\nName three rivers.\n")
    assert user_prompts(tmp_path / "a.txt") == ["Write a haiku.", "Name three rivers."]
    (tmp_path / "b.jsonl").write_text('{"query": "q1"}\n{"prompt": "q2"}\n')
    assert user_prompts(tmp_path / "b.jsonl") == ["q1", "q2"]
    (tmp_path / "c.jsonl").write_text('{"query": "q1"}\n{"other": 1}\n')  # not every line a prompt: plain text
    assert user_prompts(tmp_path / "c.jsonl") == ['{"query": "q1"}', '{"other": 1}']


def test_the_chat_set_is_many_kinds_of_unique_requests():
    exs = load_chat()
    assert len(exs) >= 50 and len({e.prompt for e in exs}) == len(exs) and len({e.id for e in exs}) == len(exs)
    assert len({e.meta["kind"] for e in exs}) >= 10
    assert [e.id for e in load_chat(n=5, seed=1)] == [e.id for e in load_chat(n=5, seed=1)] != [e.id for e in exs[:5]]


def test_the_measurement_takes_other_held_out_prompts_than_the_benchmark():
    bench = {e.id for e in held_out_examples("chat", 50)}  # benchmarks/adapt.py's default
    chosen = [e.id for e in held_out_examples("chat", Budget().measure_prompts, last=True)]
    assert len(chosen) == Budget().measure_prompts and not bench & set(chosen)
    assert [e.id for e in held_out_examples("chat", 3)] == [e.id for e in load_chat(n=3)]  # as refusion.tasks samples


def test_near_repeats_of_a_held_out_request_are_found():
    held = HeldOut(["What is photosynthesis?", "How do I clean a cast iron pan?"])
    assert held.repeats("what is photosynthesis")  # case and punctuation
    assert held.repeats("Could you tell me: how do I clean a cast iron pan? Thanks!")  # inside a longer prompt
    assert held.repeats("How do I clean a cast-iron pan properly")
    assert not held.repeats("What is the capital of France?")
    assert not held.repeats("How do I clean a bicycle chain?")  # two word pairs of five in common
    assert not held.repeats("")


def test_no_shipped_training_prompt_repeats_a_held_out_chat_request():
    held = held_out_chat()
    assert [q for q in gsm8k_train_questions() if held.repeats(q)] == []
    with gzip.open(KEPT, "rt", encoding="utf-8") as f:
        assert [r["query"] for r in map(json.loads, f) if held.repeats(r["query"])] == []  # (code prompts too)


def test_shipped_gsm8k_train_questions_are_asked_as_the_benchmark_asks():
    prompts = load_prompts("gsm8k-train", 3, seed=1)
    questions = set(gsm8k_train_questions())
    assert len(prompts) == 3 and all(p.source == "gsm8k-train" for p in prompts)
    assert all(p.query == gsm8k_prompt(p.query.split("\n\n")[0]) and p.query.split("\n\n")[0] in questions
               for p in prompts)


@pytest.mark.slow  # (reads every function of the standard library)
def test_kept_answers_are_those_of_the_recipes_sample():
    """The data stage starts from the kept answers: they answer exactly the recipe's seeded samples."""
    with gzip.open(KEPT, "rt", encoding="utf-8") as f:
        kept = {r["query"] for r in map(json.loads, f)}
    wanted = {p.query for p in load_prompts("gsm8k-train", 1200) + load_prompts("stdlib-functions", 1200)}
    assert kept == wanted and len(gsm8k_train_questions()) == 7473


# ---- Magpie ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = make_causal_lm(tmp_path_factory.mktemp("magpie") / "base", std=0.3)
    return load_model(d), Tokenizer.from_dir(d)


def test_user_prefix_is_the_template_up_to_the_users_message(tiny):
    _, tok = tiny
    ids = magpie.user_prefix_ids(tok)
    full = tok.chat_prompt_ids("Hello there")
    assert full[:len(ids)] == ids and tok.decode(full[len(ids):], skip_special_tokens=True).startswith("Hello there")
    tok_without = Tokenizer(tok.tok, {k: v for k, v in tok.config.items() if k != "chat_template"} | {
        "chat_template": "{{ messages[0]['content'] }}{{ messages[0]['content'] }}"})
    with pytest.raises(ValueError, match="does not show the user's message once"):
        magpie.user_prefix_ids(tok_without)


def test_sampled_turns_do_not_depend_on_batching_or_resuming(tiny, tmp_path):
    model, tok = tiny
    whole, parts = tmp_path / "whole.jsonl", tmp_path / "parts.jsonl"
    magpie.sample_user_turns(model, tok, whole, range(6), max_tokens=12, batch_size=6, progress=False)
    magpie.sample_user_turns(model, tok, parts, range(2), max_tokens=12, batch_size=2, progress=False)
    magpie.sample_user_turns(model, tok, parts, range(6), max_tokens=12, batch_size=3, progress=False)
    a = sorted(whole.read_text().splitlines())
    assert a == sorted(parts.read_text().splitlines()) and len(a) == 6
    assert len({json.loads(x)["text"] for x in a}) > 1  # each row its own seed


def test_kept_turns_are_finished_acceptable_and_new(tmp_path):
    recs = [(3, "How do I bake bread at home?", True), (1, "how do i bake BREAD at home", True),
            (0, "Explain how tides work, please.", True), (2, "Tell me about the history of tea", False),
            (4, "Hi", True), (5, "What is <|im_start|> for in a chat?", True)]
    path = tmp_path / "turns.jsonl"
    path.write_text("".join(json.dumps({"seed": s, "text": t, "finished": f}) + "\n" for s, t, f in recs) + '{"se')
    assert magpie.kept_user_turns(path, ["<|im_start|>"]) == ["Explain how tides work, please.",
                                                              "how do i bake BREAD at home"]
    assert path.read_text().count("\n") == len(recs)  # the torn last line (a kill) is gone


def test_choose_keeps_every_answer_then_ties_within_three_percent_on_every_domain_go_to_tokens_per_forward():
    def rows(name, identical, speeds, tpfs):
        return [dict(threads=1, batch_size=1, name=name, bench=b, identical=i, n=10, tps_vs_ar=v, tpf=t)
                for b, i, v, t in zip(("chat", "gsm8k"), identical, speeds, tpfs, strict=True)]

    summary = (rows("a", (10, 10), (2.0, 2.1), (2.5, 2.6)) + rows("b", (10, 10), (1.95, 2.2), (3.0, 3.1))
               + rows("c", (9, 10), (3.0, 3.0), (4.0, 4.0)) + rows("d", (10, 10), (1.5, 1.5), (5.0, 5.0)))
    assert choose(summary, 1) == "b"  # c changed an answer; b is within 3% of a on every domain; b drafts further
    assert choose(summary, 1, {"a", "c", "d"}) == "a"
    assert choose(summary, 2) is None and choose(rows("c", (9, 10), (3.0, 3.0), (4.0, 4.0)), 1) is None
    # e's slowest domain ties a's (1.96x against 2.0x), but e is 5% slower on gsm8k: slower, not a tie
    slower = rows("a", (10, 10), (2.0, 2.1), (2.5, 2.6)) + rows("e", (10, 10), (1.96, 1.99), (3.0, 3.1))
    assert choose(slower, 1) == "a"
    assert choose(slower + rows("f", (10, 10), (1.95, 2.05), (3.5, 3.5)), 1) == "f"  # within 3% on both


def test_summaries_compare_outputs_with_the_base_ar_at_the_same_batch_or_the_reference():
    def row(batch, name, outputs, forwards, seconds):
        return dict(threads=1, batch_size=batch, name=name, bench="chat", outputs=outputs, forwards=forwards,
                    seconds=seconds)

    rows = [row(1, "base ar", [[1, 2], [3]], 3, 3.0), row(2, "base ar", [[1, 2], [4]], 3, 1.0),
            row(1, "spec", [[1, 2], [3]], 1, 1.0), row(2, "spec", [[1, 2], [4]], 2, 2.0)]
    own = {(s["name"], s["batch_size"]): s for s in summarize(rows)}
    assert own["spec", 1] == dict(threads=1, batch_size=1, name="spec", bench="chat", n=2, identical=2, tokens=3,
                                  tpf=3.0, tps=3.0, tps_vs_ar=3.0)
    assert own["spec", 2]["identical"] == 2 and own["spec", 2]["tpf"] == 1.5 and own["spec", 2]["tps_vs_ar"] == 0.5
    ref = {(s["name"], s["batch_size"]): s for s in summarize(rows, reference=(1, 1))}
    assert ref["spec", 2]["identical"] == ref["base ar", 2]["identical"] == 1  # batch 2's second output differs
    assert ref["spec", 2]["tps_vs_ar"] == 0.5  # speed still against AR at its own batch
    assert summarize(rows[2:])[0]["identical"] is None and summarize(rows[2:])[0]["tps_vs_ar"] is None


@pytest.mark.parametrize("alike", [True, False])
@pytest.mark.parametrize("holds", ["speculative", None])
def test_a_setting_slower_than_ar_at_batch_8_gives_way_to_one_that_decodes_it_otherwise(alike, holds):
    """On a CPU (alike) the settings that differ only in forks and width prices decode a batch alike, so
    one of them slower than AR there rules out the others; elsewhere each is timed in its turn."""
    speed = {"speculative +lookup +fork price 0.25": 2.2, "speculative +lookup +fork": 2.0, "speculative +lookup": 1.8,
             "speculative +lookup +fork price 0.05": 1.6, "speculative +lookup +fork price 0.02": 1.5,
             "speculative": 1.3}
    assert set(speed) == set(CANDIDATES)
    summary = [dict(threads=1, batch_size=1, name=n, bench=d, n=4, identical=4, tpf=x, tps_vs_ar=x)
               for n, x in speed.items() for d in ("chat", "gsm8k")]
    timed, lines = [], []

    def at_batch(name):
        timed.append(name)
        return [dict(bench="chat", tps_vs_ar=1.1 if name == holds else 0.9)]

    got = choose_at_batch(summary, set(CANDIDATES), 1, 8, at_batch, alike=alike, log=lines.append)
    in_turn = sorted(speed, key=speed.get, reverse=True)
    assert timed == (["speculative +lookup +fork price 0.25", "speculative"] if alike else in_turn)
    assert got == holds or (holds is None and got == "speculative +lookup +fork price 0.25")
    if alike:
        assert "'speculative'" not in lines[0]  # (it decodes a batch otherwise)
        assert all(repr(n) in lines[0] for n in speed if "lookup" in n) and "alike there" in lines[0]
        assert "the next setting is tried" in lines[0]


def test_a_resumed_measurement_times_a_domains_rows_together():
    """Rows of one batch and domain are compared with each other, so a resume that lacks one of them
    times the others again in the same process; complete groups and other processes' spare rows stay."""
    def row(bs, name, d, process):
        return dict(threads=1, batch_size=bs, name=name, bench=d, process=process)

    rows = [row(1, "base ar", "chat", "old"), row(1, "a", "chat", "old"), row(1, "b", "chat", "old"),
            row(1, "base ar", "maths", "old"), row(1, "a", "maths", "old"),
            row(1, "x", "maths", "old"),  # (a setting no longer wanted)
            row(8, "base ar", "chat", "now")]
    wanted = [(1, n, d) for d in ("chat", "maths") for n in ("base ar", "a", "b")] + [(8, "base ar", "chat"),
                                                                                      (8, "a", "chat")]
    kept, todo = to_time(rows, wanted, threads=1, process="now")
    assert todo == [(1, "base ar", "maths"), (1, "a", "maths"), (1, "b", "maths"), (8, "a", "chat")]
    assert kept == [r for r in rows if r["bench"] == "chat" or r["name"] == "x"]
    assert to_time(rows, wanted[:3], threads=1, process="now") == (rows, [])  # complete: nothing timed again
    assert to_time(rows, wanted[:3], threads=2, process="now")[1] == wanted[:3]  # other threads: other rows


def test_a_function_request_is_its_first_line_when_that_reads_as_one_task():
    ok = "Write a function to find the largest of three numbers."
    assert code_tasks.statement(ok + "\nThe numbers are given as a list.", finished=False) == ok
    assert code_tasks.statement("  " + ok + "  ", finished=True) == ok
    assert code_tasks.statement(ok, finished=False) is None  # cut off: the line may go on
    assert code_tasks.statement("Write a function to sort it", finished=True) is None  # no full stop
    assert code_tasks.statement("Write a python function to call `sorted` on a list.", finished=True) is None
    assert code_tasks.statement("Write a function to.", finished=True) is None  # too short to be a task


def test_tests_are_the_assert_lines_a_continuation_starts_with():
    text = (" largest(1, 2, 3) == 3\nassert largest(5, 4, 3) == 5\nassert largest(0, 0, 0) == 0\n"
            "assert largest(9, 1, 1) == 9\n")
    assert code_tasks.tests_of(text, finished=False) == ["assert largest(1, 2, 3) == 3", "assert largest(5, 4, 3) == 5",
                                         "assert largest(0, 0, 0) == 0"]  # three at most
    assert code_tasks.tests_of(" f(1) == 2\nprint(f(1))\nassert f(2) == 3", True) == ["assert f(1) == 2"]
    assert code_tasks.tests_of(" f(1 == 2\nassert f(2) == 3", True) == []  # not Python: no tests
    assert code_tasks.tests_of("ion_error()", True) == []  # "assertion_error()" is not an assert
    assert code_tasks.tests_of(" f(1) == 2; x = 1", True) == []  # one assert statement a line
    # a cut continuation's last line may be a cut assert ("assert f" parses): an ended one's is whole
    assert code_tasks.tests_of(" f(1) == 2\nassert f", finished=False) == ["assert f(1) == 2"]
    assert code_tasks.tests_of(" f(1) == 2\nassert f(2) == 3", finished=True) == ["assert f(1) == 2", "assert f(2) == 3"]


def test_held_out_code_tasks_are_found_without_the_words_every_request_shares():
    held = held_out_code()
    first = load_mbpp()[0].prompt.split("\n")[0]
    assert held.repeats(task_words(first)) and held.repeats(task_words(first.replace("function", "python function")))
    assert task_words("Write a python function to count the vowels.") == "count the vowels."
    assert task_words("write a function that counts the vowels.") == "counts the vowels."
    assert not held.repeats(task_words("Write a python function to compute the volume of a torus given both radii."))
    # without the shared words dropped, two unrelated short requests would look alike
    mbpp_like = "Write a python function to find the maximum of a list of numbers."
    asked = "Write a python function to find the minimum."
    assert HeldOut([mbpp_like]).repeats(asked) and not HeldOut([task_words(mbpp_like)]).repeats(task_words(asked))


def test_function_requests_come_with_tests_in_mbpp_s_form_and_resume_to_the_same(tiny, tmp_path, monkeypatch):
    model, tok = tiny
    monkeypatch.setattr(code_tasks, "statement", lambda text, finished: text.strip()[:40] + ".")
    monkeypatch.setattr(code_tasks, "tests_of", lambda text, finished: ["assert f(" + str(len(text)) + ") == 1"])
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    whole, dropped = code_tasks.code_tasks(model, tok, 4, HeldOut([]), a, 4, lambda m: None, 1, progress=False)
    assert dropped == 0 and 1 <= len(whole) <= 4
    for made in whole:
        line, tests = made.split(code_tasks.MBPP_TESTS)
        assert line.startswith(code_tasks.LEADS) and tests.startswith("assert f(")
    code_tasks.code_tasks(model, tok, 2, HeldOut([]), b, 3, lambda m: None, 1, progress=False)
    again, _ = code_tasks.code_tasks(model, tok, 4, HeldOut([]), b, 2, lambda m: None, 1, progress=False)
    assert again == whole  # the samples are the seeds', whatever the batch or the stops
    requests = [json.loads(x) for x in (a / "code_requests.jsonl").read_text().splitlines()]
    assert {r["text"].startswith(code_tasks.LEADS[r["seed"] % 2]) for r in requests} == {True}


def test_code_prompts_are_half_functions_half_requests_in_mbpp_s_form(tiny, tmp_path, monkeypatch):
    model, tok = tiny
    monkeypatch.setattr(code_tasks, "statement", lambda text, finished: text.strip()[:40] + ".")
    monkeypatch.setattr(code_tasks, "tests_of", lambda text, finished: ["assert f(1) == 1"])
    monkeypatch.setattr(prompts, "held_out_code", lambda: HeldOut([]))  # (the tiny model's words are random)
    opts = Options(prompts=5, mix={"code": 1.0})
    chosen, stats = choose_prompts(model, tok, opts, [], 10**6, tmp_path, 4, lambda m: None, 1, progress=False)
    assert [p.source for p in chosen] == ["code"] * 5 and stats["held_out_repeats_dropped"] == 0
    asked = [p.query for p in chosen]
    assert [q.startswith("Complete the following Python function.") for q in asked] == [True] * 3 + [False] * 2
    assert all(q.endswith(code_tasks.MBPP_TESTS + "assert f(1) == 1") for q in asked[3:])


@pytest.mark.parametrize("emulated, dtype", [(True, "float32"), (False, "bfloat16")])
def test_training_runs_in_bfloat16_only_where_the_machine_multiplies_in_it(monkeypatch, emulated, dtype):
    import torch

    from refusion.training import setup

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(setup, "cpu_bf16_is_emulated", lambda: emulated)
    assert recipe.train_dtype() == dtype
    assert f'dtype="{dtype}"' in recipe.train_overrides("m", "d.jsonl", "out", 2048, Budget())
