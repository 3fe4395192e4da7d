"""``BatchScheduler``: a BatchDriver owned by a pass thread, fed from other threads (on the fake batch backend).

Checked: requests submitted from several threads at once share passes and each gets what ``generate`` gives it
alone (greedy, seeded sampling, prompt lookup, stop sequences); cancel from another thread takes effect within one
pass and frees the slot; a deadline on the scheduler's clock ends a request between passes with its partial result;
a failed pass fails only the requests in it and the scheduler keeps serving; a listener that raises stops only its
request; ``close`` ends every request. Every wait is on an event or the scheduler's pass count, never on time.
"""

from __future__ import annotations

import threading

import pytest

from ortspec import FinishReason, GenerationError, Options, PromptLookup, generate
from ortspec.adapters.engine.scheduler import BatchScheduler, PassReport, ScheduledRequest, Submission
from ortspec.backends.base import BatchRow
from ortspec.backends.fake import FakeBackend, FakeBatchBackend, FakeModel
from ortspec.core.sampling import Sampling
from tests.support.gates import GATE_S, GatedBackend, ManualClock

MODEL = FakeModel(vocab_size=32, seed=3, markov=4.0)


def alone(prompt, options, proposer=None):
    return generate(FakeBackend(MODEL, 256), prompt, options, proposer)


@pytest.fixture
def gate():
    return GatedBackend(FakeBatchBackend(MODEL, 3, 256))


@pytest.fixture
def scheduler(gate):
    clock = ManualClock()
    reports: list[PassReport] = []
    s = BatchScheduler(gate, clock=clock, on_pass=reports.append)
    s.test_clock, s.reports = clock, reports  # type: ignore[attr-defined]
    yield s
    gate.open()
    s.close()


class Collected:
    """A request's ``on_commit`` and ``on_done``: the commits it was given, and ``ended`` set once it ended."""

    def __init__(self) -> None:
        self.commits: list = []
        self.ended = threading.Event()
        self.request: ScheduledRequest | None = None

    def on_commit(self, commit) -> None:
        self.commits.append(commit)

    def on_done(self, request) -> None:
        self.request = request
        self.ended.set()


def submit(scheduler, prompt, options, proposer=None, deadline=None, **kwargs) -> tuple[ScheduledRequest, Collected]:
    seen = Collected()
    submission = Submission(prompt, options, proposer, **kwargs)
    request = scheduler.submit(submission, on_commit=seen.on_commit, on_done=seen.on_done, deadline=deadline)
    return request, seen


def test_requests_from_several_threads_share_passes_and_each_is_its_request_alone(scheduler, gate):
    cases = [
        ([1, 2, 3], Options(max_tokens=12), None),
        ([4, 5, 4, 5, 4], Options(max_tokens=15), PromptLookup()),
        ([6, 7], Options(max_tokens=10, sampling=Sampling(temperature=0.9, top_p=0.9, seed=5)), None),
        ([8, 9, 10], Options(max_tokens=20, stop=[(3,)]), PromptLookup()),
        ([11, 12], Options(max_tokens=9), None),  # waits for a slot: three slots, five requests
    ]
    gate.hold()
    handles: list = [None] * len(cases)

    def send(i: int) -> None:
        prompt, options, proposer = cases[i]
        handles[i] = submit(scheduler, prompt, options, proposer, draft_width=4)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(GATE_S)
    gate.open()
    for (prompt, options, proposer), (request, seen) in zip(cases, handles, strict=True):
        assert seen.ended.wait(GATE_S) and request.done.is_set()
        want = alone(prompt, options, PromptLookup() if proposer else None)
        assert request.error is None and not request.cancelled
        assert request.result().token_ids == want.token_ids and request.result().finish_reason == want.finish_reason
        assert [c.token_id for c in seen.commits] == list(want.token_ids)
        assert "".join(c.text for c in seen.commits) == want.text
    assert max(scheduler.rows_per_pass) == 3  # every slot in one pass
    assert sum(scheduler.rows_per_pass.values()) == scheduler.passes == len(scheduler.reports)
    assert max(r.decoding for r in scheduler.reports) >= 2


def test_cancel_from_another_thread_frees_the_slot_within_one_pass(scheduler, gate):
    start = gate.hold()
    gate.allow(3)
    victim, victim_seen = submit(scheduler, [1, 2], Options(max_tokens=200))
    other, other_seen = submit(scheduler, [3, 4], Options(max_tokens=8))
    gate.wait_blocked_at(start + 3)
    threading.Thread(target=victim.cancel).start()
    assert scheduler.wait_until(lambda s: victim.cancelled, GATE_S)
    gate.allow(1)  # the pass in flight finishes; the victim is in no pass after it
    assert victim_seen.ended.wait(GATE_S)
    assert gate.passes <= start + 4 and victim.cancelled and victim.error is None
    partial = victim.result()
    assert partial.finish_reason is None and list(partial.token_ids) == [c.token_id for c in victim_seen.commits]
    gate.open()
    assert other_seen.ended.wait(GATE_S)
    assert other.result().token_ids == alone([3, 4], Options(max_tokens=8)).token_ids


def test_a_request_past_its_deadline_ends_between_passes_with_its_partial_result(scheduler, gate):
    start = gate.hold()
    gate.allow(3)
    clock = scheduler.test_clock
    late, seen = submit(scheduler, [1, 2], Options(max_tokens=200), deadline=clock() + 10)
    never, never_seen = submit(scheduler, [5], Options(max_tokens=3), deadline=clock() + 10)
    gate.wait_blocked_at(start + 3)
    clock.advance(11)
    gate.open()
    assert seen.ended.wait(GATE_S) and never_seen.ended.wait(GATE_S)
    assert late.timed_out and late.cancelled and gate.passes <= start + 4
    assert len(late.result().token_ids) == len(seen.commits) >= 3
    assert late.result().token_ids == alone([1, 2], Options(max_tokens=200)).token_ids[: len(seen.commits)]
    assert not never.timed_out and never.result().finish_reason is FinishReason.MAX_TOKENS  # done in 3 passes


def test_a_failed_pass_fails_only_its_requests_and_the_scheduler_goes_on(scheduler, gate):
    gate.fail_at = gate.passes + 3
    a, a_seen = submit(scheduler, [1, 2], Options(max_tokens=20))
    assert a_seen.ended.wait(GATE_S)
    assert isinstance(a.error, GenerationError) and "injected backend failure" in str(a.error)
    assert len(a.result().token_ids) == len(a_seen.commits) == 2  # what it committed before the failure
    b, b_seen = submit(scheduler, [3, 4], Options(max_tokens=6))
    assert b_seen.ended.wait(GATE_S) and b.error is None
    assert b.result().token_ids == alone([3, 4], Options(max_tokens=6)).token_ids


def test_a_listener_that_raises_stops_only_its_request(scheduler):
    def explode(commit) -> None:
        raise RuntimeError("the client's queue is gone")

    ok, ok_seen = submit(scheduler, [3, 4], Options(max_tokens=6))
    bad_ended = threading.Event()
    bad = scheduler.submit(
        Submission([1, 2], Options(max_tokens=50)), on_commit=explode, on_done=lambda r: bad_ended.set()
    )
    assert bad_ended.wait(GATE_S) and ok_seen.ended.wait(GATE_S)
    assert isinstance(bad.error, RuntimeError) and bad.cancelled
    assert ok.error is None and ok.result().token_ids == alone([3, 4], Options(max_tokens=6)).token_ids


def test_a_refused_submission_ends_with_its_value_error(scheduler):
    request, seen = submit(scheduler, [99], Options(max_tokens=3))  # outside the 32-token vocabulary
    assert seen.ended.wait(GATE_S)
    assert isinstance(request.error, ValueError) and request.result() is None


def test_close_ends_every_request_and_refuses_new_ones(gate):
    scheduler = BatchScheduler(gate)
    start = gate.hold()
    running, running_seen = submit(scheduler, [1, 2], Options(max_tokens=200))
    gate.wait_blocked_at(start)
    queued = [submit(scheduler, [3 + i], Options(max_tokens=5)) for i in range(4)]
    closer = threading.Thread(target=scheduler.close)
    closer.start()
    gate.open()
    closer.join(GATE_S)
    assert not closer.is_alive()
    for request, seen in [(running, running_seen), *queued]:
        assert seen.ended.is_set() and request.done.is_set() and request.cancelled
    with pytest.raises(RuntimeError, match="closed"):
        scheduler.submit(Submission([1], Options()))


class ResetFails(FakeBatchBackend):
    """``reset`` raises once: the driver's own step raises (not a failed pass), as a bug in it would."""

    broken = True

    def reset(self, slot: int) -> None:
        if self.broken:
            self.broken = False
            raise RuntimeError("reset broke")
        super().reset(slot)


def test_when_the_driver_itself_raises_its_requests_fail_and_the_scheduler_goes_on():
    scheduler = BatchScheduler(ResetFails(MODEL, 2, 256))
    try:
        first, first_seen = submit(scheduler, [1, 2], Options(max_tokens=5))
        assert first_seen.ended.wait(GATE_S) and isinstance(first.error, RuntimeError)
        second, second_seen = submit(scheduler, [3, 4], Options(max_tokens=5))
        assert second_seen.ended.wait(GATE_S) and second.error is None
        assert second.result().token_ids == alone([3, 4], Options(max_tokens=5)).token_ids
    finally:
        scheduler.close()


def test_the_prefill_budget_reaches_the_driver():
    backend = FakeBatchBackend(MODEL, 2, 256)
    scheduler = BatchScheduler(backend, prefill_chunk=8, prefill_budget=2)
    try:
        request, seen = submit(scheduler, [1, 2, 3, 4, 5], Options(max_tokens=2))
        assert seen.ended.wait(GATE_S) and request.error is None
        assert backend.tokens_per_pass == [2, 2, 1, 1]  # the prompt in chunks of at most 2, then one decode
        assert request.result().token_ids == alone([1, 2, 3, 4, 5], Options(max_tokens=2)).token_ids
    finally:
        scheduler.close()


def test_a_finished_request_reports_its_final_state_once_and_a_cancelled_one_never(scheduler, gate):
    finished: list = []
    done, seen = submit(scheduler, [1, 2, 3], Options(max_tokens=6), on_finish=finished.append)
    assert seen.ended.wait(GATE_S)
    gate.hold()
    cancelled, seen2 = submit(scheduler, [4, 5], Options(max_tokens=50), on_finish=finished.append)
    cancelled.cancel()
    gate.open()
    assert seen2.ended.wait(GATE_S)
    assert [tuple(s.generated_tokens) for s in finished] == [done.result().token_ids]
    assert finished[0].finished and finished[0].prompt_tokens == (1, 2, 3)


def test_exclusive_waits_for_the_running_holds_the_slots_and_the_driver_forgets_what_they_held():
    """A measurement holds the slots (``exclusive``): requests running then finish first, none is admitted while
    it holds them, and what it left in a slot is never reused as a request's prefix afterwards."""
    backend = FakeBatchBackend(MODEL, 1, 256)
    s = BatchScheduler(backend, prefix_reuse=True)
    try:
        prompt, options = [1, 2, 3, 4, 5, 6], Options(max_tokens=6)
        want = alone(prompt, options).token_ids
        first = Collected()
        s.submit(Submission(prompt, options), on_commit=first.on_commit, on_done=first.on_done)
        assert s.wait_until(lambda sch: sch.passes >= 1, timeout_s=GATE_S)  # it holds the slot
        with s.exclusive():
            assert first.ended.is_set()  # the running request finished before the slots were handed over
            passes, waiting = s.passes, Collected()
            s.submit(Submission(prompt, options), on_commit=waiting.on_commit, on_done=waiting.on_done)
            backend.reset(0)  # the measurement's own tokens in the slot, where the prompt's prefix was
            backend.run_pass([BatchRow(0, (9, 9, 9, 9, 9), 0)])
            assert s.passes == passes and not waiting.ended.is_set()  # nothing ran meanwhile
        assert waiting.ended.wait(GATE_S)
        result = waiting.request.result()
        assert result.token_ids == want and result.cached_prompt_tokens == 0
    finally:
        s.close()
