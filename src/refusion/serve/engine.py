"""The engine loop: one thread owns the model and runs every decode.

Requests from the HTTP layer are `Job`s. The loop takes new jobs between steps:

- jobs whose decoder record says they can (`Decoder.batch`: speculative ones, and ar ones, since
  the `ar` decoder is the batch with no drafts, on any model) join one
  `SpeculativeBatch` (continuous batching): each `step()` is one forward
  for every running sequence; a job that arrives joins at the next step, a finished one leaves in
  the step that finishes it, a cancelled one (client gone, stop string found) is dropped before the
  next step, its cache freed at once. Every row of the batch's cache is as long as the longest
  prompt + gen_length in it plus the widest step (budget.py), so a job joins only while that stays
  within `max_row_tokens`; one that does not waits, and the jobs behind it wait too (first come,
  first served), until the batch has drained enough.
- the other jobs (refusion, refusion-l2r, mdm, mdm-threshold, any other registered decoder) have
  no step-wise interface; they run through `decode()` in static groups of waiting jobs
  with the same decoder and parameters, each group in its own turn between two speculative steps. A
  group's rows do not influence each other (every decoder's batch-k output equals its batch-1
  output; sampled rows are grouped only where a row's draws depend on its seed alone, `Decoder.seeds_per_row`),
  so a job's output is what `decode()` gives it alone. A group is abandoned early only when every
  job in it is cancelled.

A job may also ask for its prompt's logprobs (`score`: OpenAI's echo with logprobs): one causal
forward on this thread (decoding.scoring) before it decodes, sent as a "prompt" event. A job with
max_tokens 0 does only that, without taking a row.

Everything a job learns comes back through its `sink`, called on this thread: it must not block
(the HTTP layer hands events to its event loop with call_soon_threadsafe). Nothing a job does can
stop the loop: an error in adding it fails that job; when a batched step or a decode() group
fails, its jobs are decoded again one at a time, so only the one that fails alone gets the error
(a 500) and the others finish with their own output.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from refusion.decoding import SpeculativeBatch, decode, registry
from refusion.decoding.common import DecodeResult
from refusion.decoding.controls import Logprobs
from refusion.decoding.grammar import GrammarError
from refusion.decoding.scoring import prompt_logprobs
from refusion.model.transformer import Transformer
from refusion.serve.params import DecoderChoice

log = logging.getLogger("refusion.serve")


@dataclass
class Event:
    """commit: positions/tokens just committed, `step` the job's forward that committed them, and
    their `logprobs` where the job's controls ask. prompt: the prompt's `logprobs` (of its tokens
    after the first). done: the final result (`cancelled` when it was stopped early). error:
    `message`."""

    kind: str
    positions: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    step: int = 0
    result: DecodeResult | None = None
    cancelled: bool = False
    message: str = ""
    status: int = 500  # error: the HTTP status, where it still can be sent (400: the request's fault)
    logprobs: Logprobs | None = None


def failed(e: Exception) -> Event:
    """The error event of a job whose decode raised e: a 400 where its grammar failed, else a 500."""
    if isinstance(e, GrammarError):
        return Event("error", message=str(e), status=400)
    return Event("error", message=f"decoding failed: {type(e).__name__}: {e}")


@dataclass
class Job:
    prompt: list[int]
    choice: DecoderChoice
    seed: int | None
    sink: Callable[[Event], None]
    id: int = field(default_factory=itertools.count().__next__)
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    steps: int = 0  # forwards this job has taken part in (speculative) / of its decode() group (static)
    closed: bool = False  # a done or error event was sent; nothing more follows
    sent: set[int] = field(default_factory=set)  # positions whose commits were sent
    score: int | None = None  # the prompt's logprobs with this many alternatives (None: not asked)

    @property
    def answers(self) -> bool:
        """Whether it decodes (max_tokens 0 asks only for the prompt's logprobs)."""
        return self.choice.gen_length > 0


class QueueFull(Exception):
    pass


class Engine:
    def __init__(self, model: Transformer, eos_ids: list[int] | None = None, max_running: int = 64,
                 max_queue: int = 256, static_batch: int = 16, on_step: Callable[[int, float], None] | None = None,
                 batch_factory: Callable[..., Any] = SpeculativeBatch, max_row_tokens: int | None = None) -> None:
        self.model = model
        self.eos_ids = list(eos_ids if eos_ids is not None else model.config.eos_ids)
        self.max_running, self.max_queue, self.static_batch = max_running, max_queue, static_batch
        self.max_row_tokens = max_row_tokens  # None: no limit on the batch's rows
        self.on_step = on_step  # metrics hook: (sequences in the step, seconds)
        self.batch_factory = batch_factory
        self.batch = self._new_batch()
        self.live: dict[int, Job] = {}  # sequence id in self.batch -> job
        self.waiting: deque[Job] = deque()
        self.cancels: list[Job] = []
        self.cond = threading.Condition()
        self.stopping = False
        self.thread: threading.Thread | None = None
        self.static_running = 0
        self.steps = 0

    def _new_batch(self):
        return self.batch_factory(self.model, eos_ids=self.eos_ids, max_rows=self.max_running,
                                  max_row_tokens=self.max_row_tokens)

    # ---- called from other threads --------------------------------------------------------

    def submit(self, *jobs: Job) -> None:
        """Queue a request's jobs (one per choice), all or none."""
        with self.cond:
            if len(self.waiting) + len(jobs) > self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} sequences waiting)")
            self.waiting.extend(jobs)
            self.cond.notify()

    def cancel(self, job: Job) -> None:
        """Stop a job (client gone, stop string reached). It leaves before the next step."""
        with self.cond:
            if not job.cancelled and not job.closed:
                job.cancelled = True
                self.cancels.append(job)
                self.cond.notify()

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def running(self) -> int:
        return len(self.live) + self.static_running

    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="refusion-engine", daemon=True)
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()
        if self.thread is not None:
            self.thread.join(timeout)

    # ---- the loop ---------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not (self.stopping or self.waiting or self.cancels or len(self.batch)):
                    self.cond.wait()
                if self.stopping:
                    break
                cancels, self.cancels = self.cancels, []
                admitted, static = self._take_waiting()
            try:
                self._turn(cancels, admitted, static)
            except Exception:  # the loop itself must never die; fail what it was holding
                log.exception("engine turn failed")
                self._fail_all("internal error in the engine loop")
        self._fail_all("the server is shutting down")
        for job in list(self.waiting):
            self._emit(job, Event("error", message="the server is shutting down"))

    def _take_waiting(self) -> tuple[list[Job], list[Job]]:
        """Under the lock: speculative jobs that fit in the batch, and one static group (or none)."""
        admitted, rest = [], deque()
        static: list[Job] = []
        longest = max((_extent(j) for j in self.live.values()), default=0)
        widest = max((j.choice.spec.max_width for j in self.live.values()), default=0)
        full = False  # a speculative job had to wait: the ones behind it wait too
        while self.waiting:
            job = self.waiting.popleft()
            if job.cancelled:
                self._emit(job, Event("done", result=DecodeResult(prompt=job.prompt), cancelled=True))
            elif not job.answers:
                admitted.append(job)  # scored in the turn, without a row
            elif job.choice.spec is not None:
                grown = max(longest, _extent(job)), max(widest, job.choice.spec.max_width)
                full = full or len(self.live) + len(admitted) >= self.max_running or (
                    self.max_row_tokens is not None and sum(grown) + 1 > self.max_row_tokens)
                if full:
                    rest.append(job)
                else:
                    admitted.append(job)
                    longest, widest = grown
            elif not static:
                static.append(job)
            elif len(static) < self.static_batch and _same_group(static[0], job):
                static.append(job)
            else:
                rest.append(job)
        self.waiting = rest
        self.static_running = len(static)
        return admitted, static

    def _turn(self, cancels: list[Job], admitted: list[Job], static: list[Job]) -> None:
        for job in cancels:
            sid = next((s for s, j in self.live.items() if j is job), None)
            if sid is not None:
                del self.live[sid]
                res = self.batch.cancel(sid) or DecodeResult(prompt=job.prompt)
                self._emit(job, Event("done", result=res, cancelled=True))
        if cancels and not len(self.batch) and not admitted:
            self.batch = self._new_batch()  # its cache goes with it (see _step)
        for job in admitted:
            if job.score is not None and not self._score(job):
                continue
            if not job.answers:
                self._emit(job, Event("done", result=DecodeResult(prompt=job.prompt, finished=False)))
                continue
            try:
                sid = self._add(self.batch, job)
            except Exception as e:  # a request the decoder refuses fails alone
                log.warning("job %d refused by the decoder: %s", job.id, e)
                self._emit(job, Event("error", message=f"the decoder refused this request: {e}"))
                continue
            self.live[sid] = job
        if len(self.batch):
            self._step()
        if static:
            try:
                self._run_static(static)
            finally:
                self.static_running = 0

    def _add(self, batch, job: Job) -> int:
        kw = {"controls": job.choice.controls} if job.choice.controls is not None else {}
        return batch.add(job.prompt, job.choice.spec, seed=job.seed, on_commit=self._committer(job), **kw)

    def _score(self, job: Job) -> bool:
        """Send the job's prompt logprobs; False (and the job failed) when the forward fails."""
        try:
            lp = prompt_logprobs(self.model, job.prompt, top=job.score or 0)
        except Exception as e:
            log.exception("job %d: scoring its prompt failed", job.id)
            self._emit(job, Event("error", message=f"scoring the prompt failed: {type(e).__name__}: {e}"))
            return False
        self._emit(job, Event("prompt", logprobs=lp))
        return True

    def _step(self) -> None:
        t0 = time.perf_counter()
        n = len(self.batch)
        try:
            finished = self.batch.step()
        except Exception:
            # A failed step cannot say which sequence broke it, and leaves the batch in an unknown
            # state. The batch is rebuilt and each of its jobs is decoded again alone: decoding is
            # deterministic given the seed, so the healthy ones finish with the same output (their
            # commits already sent are not sent twice), and only the culprit fails.
            log.exception("speculative step failed; retrying its %d sequences one at a time", n)
            jobs, self.live = list(self.live.values()), {}
            self.batch = self._new_batch()
            for job in jobs:
                self._solo_speculative(job)
            return
        self.steps += 1
        for job in self.live.values():
            job.steps += 1
        for sid, res in finished:
            job = self.live.pop(sid, None)
            if job is not None:
                self._emit(job, Event("done", result=res))
        if not len(self.batch):
            # the batch keeps its cache at the size of its busiest moment; an empty batch is
            # replaced, so a burst's memory goes back once the burst is over
            self.batch = self._new_batch()
        if self.on_step is not None:
            self.on_step(n, time.perf_counter() - t0)

    def _solo_speculative(self, job: Job) -> None:
        if job.cancelled:
            self._emit(job, Event("done", result=DecodeResult(prompt=job.prompt), cancelled=True))
            return
        job.steps = 0
        batch = self._new_batch()
        try:
            sid = self._add(batch, job)
            while len(batch):
                if job.cancelled:
                    res = batch.cancel(sid) or DecodeResult(prompt=job.prompt)
                    self._emit(job, Event("done", result=res, cancelled=True))
                    return
                for _, res in batch.step():
                    self._emit(job, Event("done", result=res))
                job.steps += 1
        except Exception as e:
            log.exception("job %d failed alone", job.id)
            self._emit(job, failed(e))

    def _committer(self, job: Job) -> Callable[..., None]:
        """on_commit for one job; positions it has already sent (before a retry) are not sent again."""
        def on_commit(positions: list[int], tokens: list[int], logprobs: Logprobs | None = None) -> None:
            keep = [i for i, q in enumerate(positions) if q not in job.sent]
            if keep:
                job.sent.update(positions[i] for i in keep)
                if logprobs is not None and len(keep) < len(positions):
                    logprobs = Logprobs([logprobs.chosen[i] for i in keep], [logprobs.top[i] for i in keep])
                self._emit(job, Event("commit", [positions[i] for i in keep], [tokens[i] for i in keep],
                                      step=job.steps, logprobs=logprobs))
        return on_commit

    def _run_static(self, jobs: list[Job]) -> None:
        """One decode() call for a group of compatible jobs. If it fails and the group has several
        jobs, each is decoded again alone, so only the one that fails alone gets the error."""
        t0 = time.perf_counter()
        try:
            results = self._decode(jobs)
        except _Abandon:
            for job in jobs:
                self._emit(job, Event("done", result=DecodeResult(prompt=job.prompt), cancelled=True))
            return
        except Exception as e:
            log.exception("decode() failed for a group of %d", len(jobs))
            if len(jobs) > 1:
                for job in jobs:
                    self._run_static([job])
                return
            self._emit(jobs[0], failed(e))
            return
        for job, res in zip(jobs, results):
            self._emit(job, Event("done", result=res, cancelled=job.cancelled))
        if self.on_step is not None:
            self.on_step(len(jobs), time.perf_counter() - t0)

    def _decode(self, jobs: list[Job]) -> list[DecodeResult]:
        choice = jobs[0].choice
        # a commit's step is the group's forward pass that made it, counted by a hook on the model
        forwards = [0]
        hook = self.model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
        senders = [self._committer(j) for j in jobs]

        def on_commit(row: int, positions: list[int], tokens: list[int]) -> None:
            jobs[row].steps = forwards[0] - 1
            senders[row](positions, tokens)
            if all(j.cancelled for j in jobs):
                raise _Abandon

        try:
            return decode(self.model, [j.prompt for j in jobs], choice.decoder, eos_ids=self.eos_ids,
                          seed=jobs[0].seed, on_commit=on_commit, **choice.params)
        finally:
            hook.remove()

    def _fail_all(self, message: str) -> None:
        jobs, self.live = list(self.live.values()), {}
        self.batch = self._new_batch()
        for job in jobs:
            self._emit(job, Event("error", message=message))

    def _emit(self, job: Job, ev: Event) -> None:
        if job.closed:
            return
        if ev.kind in ("done", "error"):
            job.closed = True
        try:
            job.sink(ev)
        except Exception:  # a broken sink loses its own request only
            log.exception("job %d: delivering an event failed", job.id)
            job.cancelled = True


class _Abandon(Exception):
    """Raised inside decode()'s callback to drop a static group whose clients have all gone."""


def _extent(job: Job) -> int:
    """Positions the job's answer may reach: prompt + gen_length."""
    return len(job.prompt) + job.choice.gen_length


def _same_group(a: Job, b: Job) -> bool:
    """May b run in one decode() call with a? Same decoder and parameters; sampled rows only where
    each row's draws depend on its seed alone (`Decoder.seeds_per_row`), with the same seed."""
    if a.choice.decoder != b.choice.decoder or a.choice.params != b.choice.params:
        return False
    if a.choice.temperature == 0:
        return True
    return registry.get(a.choice.decoder).seeds_per_row and a.seed == b.seed
