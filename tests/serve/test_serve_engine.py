"""The engine loop on its own (no HTTP): continuous batching, leaving at once, exact outputs."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from refusion.bundled import BUNDLED
from refusion.decoding import ARParams
from refusion.model.checkpoint import load_model
from refusion.serve.engine import Engine, Event, Job
from refusion.serve.params import choose
from refusion.serve.schemas import parse_completion
from tests.helpers.reference_ar import generate_ar
from tests.helpers.serving import CFG, NO_MASK, bundled, solo, task_prompts

pytestmark = pytest.mark.usefixtures("one_thread")


class Collector:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.events: list[Event] = []
        self.done = threading.Event()
        self.steps_at_done: int | None = None  # the engine's step count when the job ended

    def __call__(self, ev: Event) -> None:  # on the engine thread
        self.events.append(ev)
        if ev.kind != "commit":
            self.steps_at_done = self.engine.steps
            self.done.set()

    @property
    def result(self):
        return self.events[-1].result


def job(engine, prompt, body, seed=None) -> tuple[Job, Collector]:
    c = choose(parse_completion({"prompt": "x", **body}), CFG, body["max_tokens"])
    col = Collector(engine)
    j = Job(prompt=prompt, choice=c, seed=seed, sink=col)
    engine.submit(j)
    return j, col


@pytest.fixture()
def engine(one_thread):
    model, _ = bundled()
    eng = Engine(model, max_running=8)
    eng.start()
    yield eng
    eng.stop()


def test_requests_join_a_running_batch_and_keep_their_solo_output(engine):
    _, tok = bundled()
    prompts = [tok.chat_prompt_ids(p) for p in task_prompts(2)]
    bodies = [{"max_tokens": 96}, {"max_tokens": 64, "decoder": "ar"},
              {"max_tokens": 64, "temperature": 0.9, "top_p": 0.9},
              {"max_tokens": 64, "decoder": "ar", "temperature": 0.9, "top_k": 30},
              {"max_tokens": 96, "draft_length": 4}]
    jobs = []
    for i, p in enumerate(prompts):
        jobs.append((p, bodies[i % len(bodies)], 5 + i, job(engine, p, bodies[i % len(bodies)], seed=5 + i)))
        time.sleep(0.02)  # arrive while the others are running
    for p, body, seed, (j, col) in jobs:
        assert col.done.wait(120)
        kind = col.events[-1].kind
        assert kind == "done", col.events[-1].message
        c = choose(parse_completion({"prompt": "x", **body}), CFG, body["max_tokens"])
        want = solo(p, c.decoder, c.params, seed=seed)
        got = col.result
        assert (got.tokens, got.positions) == (want.tokens, want.positions)
        # per-sequence widths take the steps they take alone; the cost policy sizes each step for its batch
        if c.spec.widths != "cost":
            assert (got.steps, got.forwards) == (want.steps, want.forwards)
        # the commits streamed are exactly the result, each once
        streamed = [(q, t) for ev in col.events if ev.kind == "commit" for q, t in zip(ev.positions, ev.tokens, strict=True)]
        assert sorted(streamed) == sorted(zip(want.positions, want.tokens, strict=True))
    # batching really happened: some step ran several sequences at once
    assert engine.steps < sum(col.result.forwards for *_, (_, col) in jobs)


def test_ar_runs_in_the_continuous_batch():
    c = choose(parse_completion({"prompt": "x", "decoder": "ar"}), CFG, 32)
    assert c.spec is not None and c.spec.draft_length == 0
    # sampled too: the `ar` decoder is the batch with no drafts (the seed's position-keyed uniforms)
    c = choose(parse_completion({"prompt": "x", "decoder": "ar", "temperature": 0.5, "top_p": 0.9}), CFG, 32)
    assert (c.spec.draft_length, c.spec.temperature, c.spec.top_p) == (0, 0.5, 0.9)


def test_a_model_without_a_mask_token_runs_ar_in_the_continuous_batch(one_thread):
    model = load_model(BUNDLED)  # (its own copy: the config loses its mask token)
    model.config = dataclasses.replace(model.config, mask_token_id=None)
    _, tok = bundled()
    prompts = [tok.chat_prompt_ids(p) for p in task_prompts(1)]
    bodies = [{"max_tokens": 48, "decoder": "ar"},
              {"max_tokens": 40, "decoder": "ar", "temperature": 0.9, "top_p": 0.9}]
    eng = Engine(model, max_running=8)
    eng.start()
    try:
        jobs = []
        for i, p in enumerate(prompts):
            body = bodies[i % 2]
            c = choose(parse_completion({"prompt": "x", **body}), NO_MASK, body["max_tokens"])
            assert c.decoder == "ar" and c.spec is not None  # (no static group)
            jobs.append((p, c, job(eng, p, body, seed=3 + i)[1]))
        for i, (p, c, col) in enumerate(jobs):
            assert col.done.wait(120) and col.events[-1].kind == "done", col.events[-1].message
            want = generate_ar(model, [p], ARParams(**c.params), eos_ids=model.config.eos_ids, seed=3 + i)[0]
            got = col.result
            assert (got.tokens, got.positions, got.steps, got.forwards, got.tokens_fed, got.finished) == \
                (want.tokens, want.positions, want.steps, want.forwards, want.tokens_fed, want.finished)
            streamed = [(q, t) for ev in col.events if ev.kind == "commit"
                        for q, t in zip(ev.positions, ev.tokens, strict=True)]
            assert sorted(streamed) == list(zip(want.positions, want.tokens, strict=True))
        assert eng.steps < sum(col.result.forwards for *_, col in jobs)  # rows shared steps
    finally:
        eng.stop()


def test_a_cancelled_sequence_leaves_before_the_next_step(engine):
    _, tok = bundled()
    long = tok.encode("red red red red red red")  # the bundled model rambles on this to the length limit
    j, col = job(engine, long, {"max_tokens": 400, "draft_length": 0})
    other, other_col = job(engine, long, {"max_tokens": 400, "draft_length": 0})
    while not any(ev.kind == "commit" for ev in col.events):
        time.sleep(0.005)
    steps = engine.steps
    engine.cancel(j)
    assert col.done.wait(10) and col.events[-1].cancelled
    # it was dropped at the next turn, before one more step (counted on the engine thread: the
    # other sequence keeps stepping while this thread waits for a core)
    assert col.steps_at_done - steps <= 1
    assert 0 < len(col.result.tokens) < 400
    engine.cancel(other)
    assert other_col.done.wait(10)
    deadline = time.time() + 5
    while engine.running and time.time() < deadline:
        time.sleep(0.005)
    assert engine.running == 0 and len(engine.batch) == 0


def test_static_groups_batch_compatible_requests(engine):
    _, tok = bundled()
    prompts = [tok.chat_prompt_ids(p) for p in task_prompts(2)]
    body = {"max_tokens": 64, "decoder": "refusion", "slot_size": 8}
    sizes = []
    engine.on_step = lambda n, s: sizes.append(n)
    cols = [job(engine, p, body)[1] for p in prompts]
    for p, col in zip(prompts, cols, strict=True):
        assert col.done.wait(120)
        c = choose(parse_completion({"prompt": "x", **body}), CFG, 64)
        assert col.result.tokens == solo(p, c.decoder, c.params).tokens
    assert max(sizes) > 1  # waiting requests with the same parameters ran in one decode() call
