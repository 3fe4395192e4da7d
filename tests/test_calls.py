"""Calls on an Engine's one scheduler: ``generate``, ``stream``, ``generate_stream``, ``start`` and ``generate_many``
from many threads (``adapters/engine/calls.py``), on the tiny random model.

Checked: calls from many threads share passes (a pass holds every slot's row: the scheduler's ``rows_per_pass``)
and each gets exactly what the same call gives alone (tokens, text, finish reason, stop, the callback's
``(text, token_id, finish_reason)`` triples); more calls than slots wait for one; an abandoned ``stream`` (closed or
dropped) is in no pass after the current one; a callback that raises stops only its own call, with the partial it
delivered; ``close`` while busy ends the calls with their partial results and refuses later ones; the errors raised
before anything is queued; the scheduler starts on first use. Every wait is on the gate (the batch backend's passes,
held by the test) or the scheduler's counts, never on time.
"""

from __future__ import annotations

import gc
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ortspec import ArgumentError, BackendConfig, Engine, EngineClosed, GenerationAborted, GenerationError
from tests.support.gates import GATE_S, GatedBackend

SLOTS = 4
PROMPTS = ["a b a b a b a b", "the cat sat on the mat", "hello world", "def f(x): return x", list(range(5, 30))]
OPTIONS = [
    dict(max_tokens=12),
    dict(max_tokens=16, speculative="prompt-lookup", draft_width=4),
    dict(max_tokens=10, temperature=0.8, top_p=0.9, seed=7, speculative="auto"),
    dict(max_tokens=9, stop=["b a"], repetition_penalty=1.3, ignore_eos=True),
    dict(max_tokens=8, top_logprobs=2),
]
METHODS = ("generate", "stream", "generate_stream")


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return Engine.from_dir(tiny_model_dir, BackendConfig(threads=1))


@pytest.fixture
def batched(tiny_model_dir):
    """An Engine with ``SLOTS`` slots whose batch backend's passes go through a gate (open); its shared passes
    started by one call (so the tests count from there)."""
    engine = Engine.from_dir(tiny_model_dir, BackendConfig(threads=1), batch_slots=SLOTS)
    engine.measurements.batch_decode_costs()  # measured on the bare backend (once per model; kept on disk)
    engine.batch = GatedBackend(engine.batch)  # before the scheduler starts: it drives the gated backend
    engine.generate("hi", max_tokens=1)
    yield engine
    engine.batch.open()
    engine.close()


def call(engine, method, prompt, options):
    """What ``method`` gives: the result (generate), the chunks (stream), or the callback's triples and the result
    (generate_stream)."""
    if method == "generate":
        return outcome(engine.generate(prompt, **options))
    if method == "stream":
        return list(engine.stream(prompt, **options))
    seen: list = []
    result = engine.generate_stream(prompt, lambda *args: seen.append(args), **options)
    return seen, outcome(result)


class Close(tuple):
    """Numbers equal to within 1e-4 (logprobs: a float32 row's last bits depend on how many rows the pass's matrix
    products hold, docs/exactness.md; the tokens picked must be the same)."""

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, tuple)
            and len(self) == len(other)
            and all(abs(a - b) <= 1e-4 for a, b in zip(self, other, strict=True))
        )

    __hash__ = tuple.__hash__


def outcome(result):
    """What a call must give alone (logprobs as ``Close`` values beside their exact token ids)."""
    logprobs = None
    if result.logprobs is not None:
        ids = [(lp.token_id, [t for t, _ in lp.top]) for lp in result.logprobs]
        logprobs = (ids, Close(v for lp in result.logprobs for v in (lp.logprob, *(x for _, x in lp.top))))
    return result.token_ids, result.text, result.finish_reason, result.stop_matched, logprobs, result.seed


def run_at_once(engine, calls):
    """Every ``(method, prompt, options)`` of ``calls`` from its own thread, all queued before any of them runs a
    pass (the gate is held until the scheduler has them all); their answers, in order."""
    gate, scheduler = engine.batch, engine.scheduler
    got: list = [None] * len(calls)

    def one(i: int) -> None:
        try:
            got[i] = call(engine, *calls[i])
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            got[i] = exc

    gate.hold()
    before = scheduler.submitted
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    assert scheduler.wait_until(lambda s: s.submitted == before + len(calls), GATE_S)
    gate.open()
    for t in threads:
        t.join(GATE_S)
    return got


def test_calls_from_many_threads_share_passes_and_each_is_the_call_alone(plain, batched):
    calls = [(METHODS[i % 3], PROMPTS[i % len(PROMPTS)], OPTIONS[i % len(OPTIONS)]) for i in range(SLOTS + 2)]
    got = run_at_once(batched, calls)
    assert got == [call(plain, *c) for c in calls]
    scheduler = batched.scheduler
    assert max(scheduler.rows_per_pass) == SLOTS  # one pass for every slot; two calls waited for a slot
    assert scheduler.ended == scheduler.submitted


def test_generate_many_shares_the_passes_with_other_threads(plain, batched):
    gate = batched.batch
    held_at = gate.hold()
    others = threading.Thread(target=lambda: batched.generate(PROMPTS[0], max_tokens=30, ignore_eos=True))
    others.start()
    gate.wait_blocked_at(held_at)  # its first pass waits at the gate
    gate.open()
    many = batched.generate_many(PROMPTS[1:], **OPTIONS[0])
    others.join(GATE_S)
    assert [outcome(r) for r in many] == [outcome(plain.generate(p, **OPTIONS[0])) for p in PROMPTS[1:]]


@pytest.mark.parametrize("abandon", ["close", "drop"])
def test_an_abandoned_stream_is_in_no_pass_after_the_current_one(plain, batched, abandon):
    gate, scheduler = batched.batch, batched.scheduler
    want = "".join(plain.stream(PROMPTS[0], max_tokens=60, ignore_eos=True))
    held_at = gate.hold()
    gate.allow(2)  # the prompt pass (its first token is text) and one decode
    chunks = batched.stream(PROMPTS[0], max_tokens=60, ignore_eos=True)
    first = next(chunks)
    gate.wait_blocked_at(held_at + 2)  # the third pass, with its row, waits at the gate
    if abandon == "close":
        chunks.close()
    else:
        del chunks
        gc.collect()
    gate.open()
    assert scheduler.wait_until(lambda s: s.ended == s.submitted, GATE_S)
    assert gate.passes == held_at + 3 and want.startswith(first)
    assert "".join(batched.stream(PROMPTS[0], max_tokens=60, ignore_eos=True)) == want  # the slot is free again


def test_a_callback_that_raises_stops_only_its_call_with_the_partial_the_lone_path_reports(plain, batched):
    options = dict(max_tokens=30, speculative="prompt-lookup", draft_width=4, ignore_eos=True)

    def aborted(engine, stop_at: int):
        seen: list = []

        def callback(text, token_id, finish_reason):
            seen.append((text, token_id, finish_reason))
            if len(seen) == stop_at:
                raise KeyError("enough")

        with pytest.raises(GenerationAborted) as info:
            engine.generate_stream(PROMPTS[0], callback, **options)
        assert isinstance(info.value.__cause__, KeyError)
        return seen, outcome(info.value.partial)

    results: list = []
    other = threading.Thread(target=lambda: results.append(batched.generate(PROMPTS[1], **OPTIONS[1])))
    other.start()
    for stop_at in (1, 3, 7):  # 3 and 7 fall inside multi-token passes
        assert aborted(batched, stop_at) == aborted(plain, stop_at)
    other.join(GATE_S)
    assert outcome(results[0]) == outcome(plain.generate(PROMPTS[1], **OPTIONS[1]))

    def interrupt(text, token_id, finish_reason):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # not an abort: it propagates, and its request is cancelled
        batched.generate_stream(PROMPTS[0], interrupt, **options)
    scheduler = batched.scheduler
    assert scheduler.wait_until(lambda s: s.ended == s.submitted, GATE_S)
    assert call(batched, "generate", PROMPTS[0], options) == call(plain, "generate", PROMPTS[0], options)


def test_close_while_busy_ends_every_call_with_its_partial_and_refuses_new_ones(plain, batched):
    gate, scheduler = batched.batch, batched.scheduler
    options = dict(max_tokens=40, ignore_eos=True)
    errors: list = [None] * 3

    def one(i: int) -> None:
        try:
            batched.generate(PROMPTS[i], **options) if i != 1 else list(batched.stream(PROMPTS[i], **options))
        except GenerationError as exc:
            errors[i] = exc

    held_at, before = gate.hold(), scheduler.submitted
    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    assert scheduler.wait_until(lambda s: s.submitted == before + 3, GATE_S)
    gate.allow(3)
    gate.wait_blocked_at(held_at + 3)
    closer = threading.Thread(target=batched.close)
    closer.start()
    assert scheduler.wait_until(lambda s: s.closed, GATE_S)
    gate.open()  # the pass it is in ends; then every call is cancelled
    closer.join(GATE_S)
    for t in threads:
        t.join(GATE_S)
    for i, error in enumerate(errors):
        assert isinstance(error, GenerationError) and isinstance(error.__cause__, EngineClosed)
        want, partial = plain.generate(PROMPTS[i], **options).token_ids, error.partial.token_ids
        assert len(partial) < len(want) and want[: len(partial)] == partial
    for method in (batched.generate, batched.start, lambda p, **o: next(batched.stream(p, **o))):
        with pytest.raises(EngineClosed):
            method("hi", max_tokens=2)
    batched.close()  # idempotent


def test_start_is_a_request_like_the_others_and_bad_input_is_refused_before_anything_is_queued(plain, batched):
    scheduler = batched.scheduler
    before = scheduler.submitted
    started = batched.start(PROMPTS[2], **OPTIONS[0])
    assert outcome(started.run()) == outcome(plain.generate(PROMPTS[2], **OPTIONS[0]))
    assert scheduler.submitted == before + 1
    for bad, argument in [
        (dict(max_tokens=-1), "max_tokens"),
        (dict(speculative="shared-kv"), "speculative"),  # no drafter
        (dict(speculative="nonsense"), "speculative"),
    ]:
        for method in METHODS:
            with pytest.raises(ArgumentError) as info:
                call(batched, method, "hi", bad)
            assert info.value.argument == argument
    with pytest.raises(ArgumentError):
        batched.generate("", max_tokens=2)
    assert scheduler.submitted == before + 1


def test_the_scheduler_starts_on_first_use_and_one_slot_runs_calls_one_at_a_time(plain, tiny_model_dir):
    one = Engine.from_dir(tiny_model_dir, BackendConfig(threads=1), batch_slots=1)
    assert one._scheduler is None and one.batch.slots == 1
    got = one.generate_many(PROMPTS, **OPTIONS[1])
    assert [outcome(r) for r in got] == [outcome(plain.generate(p, **OPTIONS[1])) for p in PROMPTS]
    assert set(one.scheduler.rows_per_pass) == {1}  # one slot: one row per pass
    one.close()


def test_an_engine_is_a_context_manager_that_closes(tiny_model_dir):
    with Engine.from_dir(tiny_model_dir, BackendConfig(threads=1), batch_slots=2) as engine:
        text = engine.generate("hi", max_tokens=3).text
    assert engine.scheduler.closed and isinstance(text, str)
    with pytest.raises(EngineClosed):
        engine.generate_many(["hi"], max_tokens=2)


CALLS = st.tuples(st.sampled_from(METHODS), st.integers(0, len(PROMPTS) - 1), st.integers(0, len(OPTIONS) - 1))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(CALLS, min_size=1, max_size=SLOTS + 3))
def test_any_mix_of_concurrent_calls_is_each_call_alone(plain, batched, mix):
    calls = [(method, PROMPTS[p], OPTIONS[o]) for method, p, o in mix]
    assert run_at_once(batched, calls) == [call(plain, *c) for c in calls]
