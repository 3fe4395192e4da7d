"""The batch driver's own behaviour (the scheduler): slots, waiting, chunked prefill, cancellation, failures; and
the batched backend protocol on the fake backend. Every wait is on pass counts, never on time."""

from __future__ import annotations

import numpy as np
import pytest

from ortspec import (
    BatchBackend,
    BatchDriver,
    BatchRow,
    FinishReason,
    GenerationAborted,
    GenerationError,
    Options,
    PromptLookup,
    ProposerError,
    generate,
)
from ortspec.backends.base import BackendError
from ortspec.backends.fake import FakeBackend, FakeBatchBackend, FakeModel

MODEL = FakeModel(vocab_size=32, seed=3, markov=4.0)


def alone(prompt, options, proposer=None):
    return generate(FakeBackend(MODEL, 256), prompt, options, proposer)


def driver(slots=2, chunk=512, max_length=256):
    backend = FakeBatchBackend(MODEL, slots, max_length)
    return BatchDriver(backend, prefill_chunk=chunk), backend


class Recorder(list):
    def __call__(self, text, token_id, finish_reason):
        self.append((text, token_id, finish_reason))


class Oracle:
    """Drafts the model's greedy continuation: every draft token is accepted, so a pass commits several."""

    def propose(self, draft_context):
        context, width = draft_context.tokens, draft_context.width
        return MODEL.greedy(list(context), width)


class Raising:
    def propose(self, draft_context):
        raise RuntimeError("the drafter crashed")


def test_the_fake_batch_backend_is_a_batch_backend_with_each_row_as_alone():
    backend = FakeBatchBackend(MODEL, 3, 64)
    assert isinstance(backend, BatchBackend)
    single = FakeBackend(MODEL, 64)
    expected = single.decode_verify([1, 2, 3], 0)
    out = backend.run_pass([BatchRow(2, (1, 2, 3), 0), BatchRow(0, (5,), 0)])
    np.testing.assert_array_equal(out[0], expected)
    assert out[1].shape == (1, 32)
    assert [backend.current_len(s) for s in range(3)] == [1, 0, 3]
    backend.rewind(2, 1)
    out = backend.run_pass([BatchRow(2, (7, 8), 1)])
    single.rewind(1)
    np.testing.assert_array_equal(out[0], single.decode_verify([7, 8], 1))
    assert backend.rows_per_pass == [2, 1] and backend.tokens_per_pass == [4, 2] and backend.passes == 2


@pytest.mark.parametrize(
    "rows, message",
    [
        ([BatchRow(0, (1,), 1)], "position"),  # wrong position
        ([BatchRow(0, (40,), 2)], "outside the vocabulary"),
        ([BatchRow(0, (1,) * 7, 2)], "exceed the KV capacity"),
        ([BatchRow(0, (1,), 2), BatchRow(0, (1,), 2)], "two rows"),
        ([BatchRow(5, (1,), 0)], "slot 5"),
        ([], "at least one row"),
    ],
)
def test_a_bad_batch_raises_before_any_slot_changes(rows, message):
    backend = FakeBatchBackend(MODEL, 2, 8)
    backend.run_pass([BatchRow(0, (1, 2), 0)])
    with pytest.raises(BackendError, match=message):  # a good row first: it must not run either
        backend.run_pass([BatchRow(1, (3,), 0), *rows] if rows else [])
    assert [backend.current_len(s) for s in range(2)] == [2, 0]
    assert backend.passes == 1


def test_slots_are_reused_and_each_sequence_is_its_request_alone():
    d, backend = driver(slots=1)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    options = Options(max_tokens=6)
    sequences = [d.submit(p, options, PromptLookup()) for p in prompts]
    d.run()
    assert [s.slot for s in sequences] == [0, 0, 0]
    for prompt, sequence in zip(prompts, sequences, strict=True):
        assert sequence.done and sequence.error is None
        assert sequence.result().token_ids == alone(prompt, options).token_ids
    assert max(backend.rows_per_pass) == 1  # one slot: one row per pass


def test_a_waiting_request_starts_in_the_pass_after_a_slot_frees():
    d, backend = driver(slots=2)
    short = d.submit([1, 2], Options(max_tokens=2))
    long = d.submit([3, 4], Options(max_tokens=10))
    late = d.submit([5, 6], Options(max_tokens=3))
    assert d.waiting == (short, long, late)
    d.step()  # the prompt passes of the first two; `late` waits
    assert d.running == (short, long) and d.waiting == (late,)
    d.step()  # `short` commits its second token and finishes: its slot frees
    assert short.done and short.result().finish_reason is FinishReason.MAX_TOKENS
    assert d.waiting == (late,)
    d.step()  # `late` takes the freed slot
    assert late.slot == short.slot and d.running == (long, late)
    d.run()
    assert late.result().token_ids == alone([5, 6], Options(max_tokens=3)).token_ids
    assert long.result().token_ids == alone([3, 4], Options(max_tokens=10)).token_ids


def test_a_long_prompt_is_prefilled_in_chunks_while_the_others_decode():
    d, backend = driver(slots=2, chunk=4)
    decoding = Recorder()
    first = d.submit([1, 2], Options(max_tokens=20), callback=decoding)
    d.step()
    assert len(decoding) == 1
    prompt = list(range(1, 19))  # 18 tokens: chunks of 4, 4, 4, 4, 2
    second = d.submit(prompt, Options(max_tokens=3))
    for n in range(5):
        d.step()
        assert len(decoding) == 2 + n  # the decoding sequence committed a token in every pass
        assert len(second.result().token_ids) == (1 if n == 4 else 0)  # the first token after the last chunk
    assert backend.rows_per_pass[1:6] == [2, 2, 2, 2, 2]
    assert backend.tokens_per_pass[1:6] == [5, 5, 5, 5, 3]  # a chunk and the decoding sequence's one token
    d.run()
    assert second.result().token_ids == alone(prompt, Options(max_tokens=3)).token_ids
    assert first.result().token_ids == alone([1, 2], Options(max_tokens=20)).token_ids
    assert second.result().stats.steps == alone(prompt, Options(max_tokens=3)).stats.steps  # a prompt is one step


class PassRows(FakeBatchBackend):
    """Records each pass as {sequence name: ("prefill", prompt tokens) or ("decoding", tokens)} (``names``: the
    name of each sequence, by its id), from the phase its sequence was in when the pass ran."""

    def __init__(self, slots):
        super().__init__(MODEL, slots, 256)
        self.driver: BatchDriver | None = None
        self.names: dict[int, str] = {}  # id(sequence) -> its name
        self.passes_rows: list[dict[str, tuple[str, int]]] = []

    def run_pass(self, rows):
        holder = {s.slot: s for s in self.driver.running}
        self.passes_rows.append(
            {self.names[id(holder[row.slot])]: (holder[row.slot].phase.value, len(row.tokens)) for row in rows}
        )
        return super().run_pass(rows)


def budgeted(slots, chunk, budget):
    backend = PassRows(slots)
    backend.driver = BatchDriver(backend, prefill_chunk=chunk, prefill_budget=budget)
    return backend.driver, backend


def submit_named(d, backend, name, prompt, options):
    sequence = d.submit(prompt, options)
    backend.names[id(sequence)] = name
    return sequence


def test_a_pass_folds_in_at_most_the_prefill_budget_first_come_first_and_every_decoding_row():
    d, backend = budgeted(slots=4, chunk=4, budget=5)
    prompts = {"a": [1, 2, 3], "b": list(range(1, 8)), "c": list(range(3, 9)), "d": list(range(2, 11))}
    options = {"a": Options(max_tokens=12), "b": Options(max_tokens=3), "c": Options(max_tokens=3)}
    sequences = {n: submit_named(d, backend, n, p, options.get(n, Options(max_tokens=2))) for n, p in prompts.items()}
    d.run()
    prefill = [{n: t for n, (phase, t) in rows.items() if phase == "prefill"} for rows in backend.passes_rows]
    # Chunks of min(4, what is left of the prompt, what is left of the 5 tokens), in the order they came:
    # a 3 + b 2; b 4 + c 1; b 1 + c 4; c 1 + d 4; d 4; d 1. A prefilling sequence granted nothing has no row.
    assert prefill[:6] == [
        {"a": 3, "b": 2},
        {"b": 4, "c": 1},
        {"b": 1, "c": 4},
        {"c": 1, "d": 4},
        {"d": 4},
        {"d": 1},
    ]
    for rows in backend.passes_rows:
        assert sum(t for phase, t in rows.values() if phase == "prefill") <= 5
    # Every sequence decoding before a pass has a row in it, whatever the budget: `a` decodes from pass 2 on.
    assert all(backend.passes_rows[i]["a"] == ("decoding", 1) for i in range(1, 6))
    for name, sequence in sequences.items():
        want = alone(prompts[name], options.get(name, Options(max_tokens=2)))
        assert sequence.result().token_ids == want.token_ids
        assert sequence.result().stats.steps == want.stats.steps  # a prompt is one step, however many chunks


def test_without_a_prefill_budget_every_prefilling_sequence_gets_its_chunk_and_a_budget_of_one_still_progresses():
    d, backend = budgeted(slots=3, chunk=4, budget=None)
    prompts = {"a": list(range(1, 11)), "b": [4, 5, 6], "c": list(range(2, 8))}
    for name, prompt in prompts.items():
        submit_named(d, backend, name, prompt, Options(max_tokens=2))
    d.step()
    assert backend.passes_rows[0] == {"a": ("prefill", 4), "b": ("prefill", 3), "c": ("prefill", 4)}
    d, backend = budgeted(slots=2, chunk=4, budget=1)  # the oldest prefilling sequence gets a token every pass
    first = submit_named(d, backend, "a", [1, 2, 3], Options(max_tokens=4))
    second = submit_named(d, backend, "b", [4, 5], Options(max_tokens=2))
    d.run()
    assert backend.passes_rows[:5] == [
        {"a": ("prefill", 1)},
        {"a": ("prefill", 1)},
        {"a": ("prefill", 1)},
        {"a": ("decoding", 1), "b": ("prefill", 1)},
        {"a": ("decoding", 1), "b": ("prefill", 1)},
    ]
    assert first.result().token_ids == alone([1, 2, 3], Options(max_tokens=4)).token_ids
    assert second.result().token_ids == alone([4, 5], Options(max_tokens=2)).token_ids


def test_a_fresh_driver_has_the_same_settings_and_knows_nothing_of_the_slots():
    backend = FakeBatchBackend(MODEL, 2, 256)
    d = BatchDriver(backend, prefill_chunk=3, prefill_budget=2, decode_costs=(0.0, 1.0, 1.5), prefix_reuse=False)
    d.submit([1, 2, 3], Options(max_tokens=2)).wait()
    assert d.resident_tokens(0) != ()
    new = d.fresh()
    assert (new.prefill_chunk, new.prefill_budget, new.decode_costs, new.prefix_reuse) == (3, 2, (0.0, 1.0, 1.5), False)
    assert new.resident_tokens(0) == () and new.passes == 0 and not new.running and not new.waiting


@pytest.mark.parametrize("budget", [0, -3, True, 2.5, "512"])
def test_a_bad_prefill_budget_is_refused_naming_it(budget):
    with pytest.raises(ValueError, match="prefill_budget"):
        BatchDriver(FakeBatchBackend(MODEL, 1, 16), prefill_budget=budget)


def test_cancellation_takes_effect_before_the_next_pass_and_frees_the_slot():
    d, backend = driver(slots=1)
    streamed = Recorder()
    running = d.submit([1, 2, 3], Options(max_tokens=30), callback=streamed)
    waiting = d.submit([4, 5], Options(max_tokens=2))
    d.step()
    d.step()
    running.cancel()
    d.step()  # `running` is dropped before this pass; `waiting` takes the slot
    assert running.done and running.cancelled and waiting.slot == 0
    assert backend.rows_per_pass[-1] == 1 and len(streamed) == 2
    result = running.result()
    assert result.finish_reason is None and list(result.token_ids) == [t for _, t, _ in streamed]
    assert result.token_ids == alone([1, 2, 3], Options(max_tokens=30)).token_ids[:2]
    d.run()
    assert waiting.result().finish_reason is FinishReason.MAX_TOKENS


def test_cancelling_a_waiting_request_or_from_a_callback():
    d, _ = driver(slots=1)
    seen = Recorder()

    def stop_after_three(text, token_id, finish_reason):
        seen(text, token_id, finish_reason)
        if len(seen) == 3:
            streaming.cancel()

    streaming = d.submit([1, 2, 3], Options(max_tokens=30), Oracle(), draft_width=4, callback=stop_after_three)
    never = d.submit([4, 5], Options(max_tokens=5))
    never.cancel()
    d.run()
    assert never.done and never.slot is None and never.result().token_ids == ()
    # the third token came from a pass that committed five: nothing after it is delivered
    assert len(seen) == 3 and len(streaming.result().token_ids) == 3
    assert streaming.result().finish_reason is None


def test_a_failing_proposer_fails_only_its_sequence():
    d, _ = driver(slots=2)
    options = Options(max_tokens=8)
    failing = d.submit([1, 2, 3], options, Raising())
    fine = d.submit([4, 5, 6], options, PromptLookup())
    after = d.submit([7, 8], options)
    d.run()
    assert isinstance(failing.error, GenerationError) and isinstance(failing.error.__cause__, ProposerError)
    assert failing.result() is failing.error.partial
    assert failing.result().token_ids == alone([1, 2, 3], options).token_ids[:1]  # the prompt pass's token
    with pytest.raises(GenerationError):
        failing.wait()
    assert fine.wait().token_ids == alone([4, 5, 6], options).token_ids
    assert after.slot == failing.slot and after.wait().token_ids == alone([7, 8], options).token_ids


class FailingPass(FakeBatchBackend):
    def __init__(self, fail_at):
        super().__init__(MODEL, 2, 256)
        self.fail_at, self.calls = fail_at, 0

    def run_pass(self, rows):
        self.calls += 1
        if self.calls == self.fail_at:
            raise BackendError("the device went away")
        return super().run_pass(rows)


def test_a_backend_failure_fails_the_sequences_of_that_pass():
    backend = FailingPass(fail_at=3)
    d = BatchDriver(backend)
    a = d.submit([1, 2], Options(max_tokens=10))
    b = d.submit([3, 4], Options(max_tokens=10))
    c = d.submit([5, 6], Options(max_tokens=4))  # waits: it is not in the failing pass
    d.run()
    for failed in (a, b):
        assert isinstance(failed.error.__cause__, BackendError)
        assert len(failed.result().token_ids) == 2  # the prompt pass and one step
    assert c.error is None and c.result().token_ids == alone([5, 6], Options(max_tokens=4)).token_ids


def test_a_raising_callback_aborts_only_its_sequence_and_step_inside_a_pass_is_refused():
    d, _ = driver(slots=2)

    def reenter(text, token_id, finish_reason):
        d.step()

    aborted = d.submit([1, 2], Options(max_tokens=5), callback=reenter)
    other = d.submit([3, 4], Options(max_tokens=5))
    d.run()
    assert isinstance(aborted.error, GenerationAborted) and isinstance(aborted.error.__cause__, RuntimeError)
    assert len(aborted.result().token_ids) == 1  # the token whose callback raised counts as delivered
    assert other.result().token_ids == alone([3, 4], Options(max_tokens=5)).token_ids


def test_iterating_a_sequence_runs_the_passes_of_all():
    d, backend = driver(slots=2)
    reader = d.submit([1, 2, 3], Options(max_tokens=6), PromptLookup())
    other = d.submit([4, 5], Options(max_tokens=30))
    tokens = [c.token_id for c in reader]
    assert tuple(tokens) == alone([1, 2, 3], Options(max_tokens=6)).token_ids
    assert reader.done and not other.done and len(other.result().token_ids) == backend.passes
    assert other.wait().token_ids == alone([4, 5], Options(max_tokens=30)).token_ids


def test_a_prompt_that_fills_the_context_ends_at_once_and_bad_input_is_refused():
    d, backend = driver(slots=1, max_length=4)
    full = d.submit([1, 2, 3, 4], Options(max_tokens=5))
    assert full.done and full.result().finish_reason is FinishReason.CONTEXT_FULL and d.waiting == ()
    with pytest.raises(ValueError, match="prompt"):
        d.submit([1, 2, 3, 4, 5], Options())
    with pytest.raises(ValueError, match="prefill_chunk"):
        BatchDriver(backend, prefill_chunk=0)
    assert not d.step() and backend.passes == 0


def test_an_interrupt_in_a_callback_leaves_every_slot_rewound_and_the_driver_usable():
    d, _ = driver(slots=2)
    options = Options(max_tokens=6)
    calls = Recorder()

    def interrupt_once(text, token_id, finish_reason):
        calls(text, token_id, finish_reason)
        if len(calls) == 2:
            raise KeyboardInterrupt

    interrupted = d.submit([1, 2], options, callback=interrupt_once)
    other = d.submit([3, 4], options, Oracle(), draft_width=3)
    with pytest.raises(KeyboardInterrupt):
        d.run()
    d.run()  # the same driver goes on from where the pass left off
    assert other.result().token_ids == alone([3, 4], options).token_ids
    assert interrupted.result().token_ids == alone([1, 2], options).token_ids
    assert [t for _, t, _ in calls] == list(alone([1, 2], options).token_ids)
    assert not d.running and not d.waiting


# -- pricing a step by the pass it joins (core.width.mean_row_cost, marginal_row_cost, pass_cost, PricedWidth) -------

# A pass of n one-token rows costs 1 + 0.1 (n - 1) steps; a verify pass (alone) 1.0 + 0.05 k.
DECODE_COSTS = tuple([0.0] + [1.0 + 0.1 * (n - 1) for n in range(1, 9)])
PASS_COSTS = tuple(1.0 + 0.05 * k for k in range(9))


def test_marginal_row_cost_and_the_cost_aware_width_under_load():
    from ortspec.core import CostAwareWidth, PricedWidth, marginal_row_cost

    assert marginal_row_cost(DECODE_COSTS, 0) == marginal_row_cost(DECODE_COSTS, 1) == 1.0
    assert marginal_row_cost(DECODE_COSTS, 4) == pytest.approx(0.1)
    assert marginal_row_cost(DECODE_COSTS, 100) == pytest.approx(0.1)  # past the curve: its last step
    assert marginal_row_cost((0.0, 1.0, 0.5), 2) == 0.01  # a noisy curve never makes a row free
    policy = CostAwareWidth(PASS_COSTS, successes=6.0, trials=10.0)  # acceptance 0.6
    assert isinstance(policy, PricedWidth)
    assert policy.width() == policy.width_at(1.0) > 0  # alone, drafts at 0.6 pay
    assert policy.width_at(0.1) == 0  # a row costs a tenth: a pass of its own for ~2.4 tokens does not pay
    confident = CostAwareWidth(PASS_COSTS, successes=99.0, trials=100.0)
    assert confident.width_at(0.1) == 0  # even near-sure drafts: 8.6 tokens per 1.4 steps < 10 plain rows
    assert confident.width_at(0.2) == 8  # but 8.6 per 1.4 > 5 plain rows at a fifth of a step each
    # While at width 0 it probes, less often when a plain step is cheap: the same share of time either way.
    idle = CostAwareWidth(PASS_COSTS, successes=0.0, trials=10.0)
    assert idle.probe_interval(1.0) == idle.probe_every
    assert idle.probe_interval(0.1) > 10 * idle.probe_every
    assert attrs_evolve(idle, idle_steps=idle.probe_every - 1).width_at(1.0) == idle.probe_width
    assert attrs_evolve(idle, idle_steps=idle.probe_every - 1).width_at(0.1) == 0


def test_a_plain_row_costs_its_share_of_the_pass_and_a_batched_draft_its_rows():
    from ortspec.core import CostAwareWidth, mean_row_cost, pass_cost

    assert mean_row_cost(DECODE_COSTS, 1) == mean_row_cost(DECODE_COSTS, 0) == 1.0
    assert mean_row_cost(DECODE_COSTS, 4) == pytest.approx(1.3 / 4)  # its share of the pass
    assert mean_row_cost(DECODE_COSTS, 16) == pytest.approx((1.7 + 8 * 0.1) / 16)  # past the curve: its last step
    assert mean_row_cost((0.0, 1.0, 0.5), 2) == 0.25 and mean_row_cost((0.0, 1.0, 1.0), 2) == 0.5
    # a draft row alone costs its own pass; beside the others, its rows: at most 1 + k at the plain row's share
    assert pass_cost(PASS_COSTS, 0, 0.2) == pytest.approx(0.2)
    assert pass_cost(PASS_COSTS, 4, 0.2) == PASS_COSTS[4]
    assert pass_cost(PASS_COSTS, 4, 0.2, token_cost=0.1) == pytest.approx(0.2 + 4 * 0.1)
    assert pass_cost(PASS_COSTS, 8, 0.5, token_cost=0.2) == PASS_COSTS[8]  # never more than a pass of its own
    assert pass_cost(PASS_COSTS, 4, 1.0, token_cost=0.1) == PASS_COSTS[4]  # alone: the pass is the row's
    sure = CostAwareWidth(PASS_COSTS, successes=9.0, trials=10.0)  # acceptance 0.9
    share, row = mean_row_cost(DECODE_COSTS, 8), 0.1
    assert sure.width_at(share) == 0  # a pass of its own for ~6 tokens costs more than 6 plain rows' share
    assert 0 < sure.width_at(share, row) < 8  # beside the others: ~3.4 tokens for 0.51 of a step at 3


def test_beside_a_full_batch_drafts_run_where_the_backend_batches_them_and_outputs_do_not_change():
    """Beside seven decoding sequences a sure drafter drafts on a backend that runs draft rows in the batch (each
    draft token one more row) and stays plain where each draft row would be a pass of its own; the outputs are
    each request's alone either way."""
    from ortspec.core import CostAwareWidth

    options = Options(max_tokens=24)
    copying = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    policy = CostAwareWidth(PASS_COSTS, successes=9.0, trials=10.0)

    def first_widths(ragged: bool) -> list[int]:
        drv = BatchDriver(FakeBatchBackend(MODEL, 8, 256, ragged_rows=ragged), decode_costs=DECODE_COSTS)
        assert drv.batched_drafts is ragged
        first = drv.submit(copying, options, Oracle(), draft_width=policy)
        rest = [drv.submit([9, 8, i], Options(max_tokens=40)) for i in range(7)]
        widths = []
        while drv.step():
            if first.phase.value == "decoding" and all(s.phase.value == "decoding" for s in rest):
                widths.append(first._context.width if first._context is not None else 0)
        assert first.result().token_ids == alone(copying, options).token_ids
        for i, sequence in enumerate(rest):
            assert sequence.result().token_ids == alone([9, 8, i], Options(max_tokens=40)).token_ids
        return widths

    batched, alone_priced = first_widths(ragged=True), first_widths(ragged=False)
    assert len(batched) >= 3 and any(w > 0 for w in batched[:3])
    assert len(alone_priced) >= 3 and alone_priced[:3] == [0, 0, 0]


def attrs_evolve(value, **changes):
    import attrs

    return attrs.evolve(value, **changes)


def test_speculation_fades_as_the_batch_fills_and_outputs_do_not_change():
    """A sequence that speculates alone stops drafting while seven others decode beside it (each of its verify
    passes would cost a pass of its own), and drafts again once they are done; every output is its own alone."""
    from ortspec.core import CostAwareWidth

    options = Options(max_tokens=40)
    copying = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    policy = CostAwareWidth(PASS_COSTS)

    def widths_beside(others: int, priced: bool) -> list[int]:
        backend = FakeBatchBackend(MODEL, 8, 256)
        drv = BatchDriver(backend, decode_costs=DECODE_COSTS if priced else None)
        first = drv.submit(copying, options, Oracle(), draft_width=policy)
        rest = [drv.submit([9, 8, i], Options(max_tokens=12)) for i in range(others)]
        widths = []  # the draft width of each of its decoding passes
        while True:
            decoding = first.phase.value == "decoding"
            if not drv.step():
                break
            if decoding:
                asked = first._context  # the draft context of its row in the pass (None: not asked, width 0)
                widths.append(asked.width if asked is not None else 0)
        assert first.result().token_ids == alone(copying, options).token_ids
        for i, sequence in enumerate(rest):
            assert sequence.result().token_ids == alone([9, 8, i], Options(max_tokens=12)).token_ids
        return widths

    assert all(w > 0 for w in widths_beside(0, priced=True)[:3])  # alone: drafts
    crowded = widths_beside(7, priced=True)
    assert crowded[:5] == [0] * 5  # beside seven decoding sequences: plain rows in the batched pass
    assert any(w > 0 for w in crowded[12:])  # the others finished: it drafts again
    assert all(w > 0 for w in widths_beside(7, priced=False)[:3])  # unpriced: it drafts as alone


# -- prefix reuse per slot ----------------------------------------------------------------------------------------


def second_turn(first, prompt, new=(11, 12)):
    """The next turn of a conversation: its first turn's prompt and output, then new text."""
    return [*prompt, *first.result().token_ids, *new]


def assert_record_is_true(d, backend, slot):
    """What the driver remembers of a free slot is what the slot holds at its first positions."""
    record = d.resident_tokens(slot)
    assert backend.slot_backend(slot).resident_tokens()[: len(record)] == record
    return record


def test_the_next_turn_goes_to_its_first_turns_slot_and_prefills_only_its_new_tokens():
    options = Options(max_tokens=6)
    runs = {}
    for reuse in (True, False):
        backend = FakeBatchBackend(MODEL, 3, 256)
        d = BatchDriver(backend, prefix_reuse=reuse)
        first = d.submit([1, 2, 3, 4, 5], options)
        other = d.submit([9, 8, 7], Options(max_tokens=4))
        d.run()
        assert (first.slot, other.slot) == (0, 1)
        before = sum(backend.tokens_per_pass)
        nxt = d.submit(second_turn(first, [1, 2, 3, 4, 5]), options)
        new = d.submit([20, 21], options)  # shares nothing: the empty slot, not a conversation that may continue
        d.run()
        assert nxt.result().token_ids == alone(second_turn(first, [1, 2, 3, 4, 5]), options).token_ids
        assert new.result().token_ids == alone([20, 21], options).token_ids
        runs[reuse] = (nxt, new, sum(backend.tokens_per_pass) - before)
    (nxt, new, fed), (plain_nxt, plain_new, plain_fed) = runs[True], runs[False]
    assert (nxt.slot, new.slot) == (0, 2)
    assert (plain_nxt.slot, plain_new.slot) == (0, 1)  # without reuse: the lowest free slots
    reused = 5 + 6 - 1  # the first turn's context but its last token, whose KV was never written
    assert nxt.result().cached_prompt_tokens == reused and plain_nxt.result().cached_prompt_tokens == 0
    assert new.result().cached_prompt_tokens == 0
    assert plain_fed - fed == reused  # the backend was fed exactly the reused tokens fewer
    assert nxt.result().stats == plain_nxt.result().stats


def test_a_new_conversation_takes_an_empty_slot_then_on_ties_the_least_recently_released():
    d, backend = driver(slots=3)
    early = d.submit([1, 2], Options(max_tokens=6))
    late = d.submit([3, 4, 5, 6, 7], Options(max_tokens=3))  # finishes (and frees slot 1) three passes earlier
    d.run()
    assert (early.slot, late.slot) == (0, 1)
    assert len(assert_record_is_true(d, backend, 0)) == len(assert_record_is_true(d, backend, 1)) == 7
    first = d.submit([20, 21, 22], Options(max_tokens=2))
    d.step()
    assert first.slot == 2 and d.resident_tokens(2) == ()  # an empty slot before any conversation; in use now
    d.run()
    assert assert_record_is_true(d, backend, 2) == (20, 21, 22, first.result().token_ids[0])
    # neither shares a token with any slot: the first loses least in slot 2 (4 positions against 7), the second
    # ties between slots 0 and 1 and takes the one released first
    second = d.submit([23, 24, 25], Options(max_tokens=2))
    third = d.submit([26, 27, 28], Options(max_tokens=2))
    d.run()
    assert (second.slot, third.slot) == (2, 1)
    with pytest.raises(ValueError, match="slot"):
        d.resident_tokens(3)


def test_a_prompt_that_is_all_resident_reuses_all_but_its_last_token():
    d, backend = driver(slots=1)
    options = Options(max_tokens=5)
    first = d.submit([1, 2, 3, 4], options)
    d.run()
    resident = d.resident_tokens(0)
    for prompt in (list(resident), [1, 2, 3, 4], [1, 2], [1]):
        again = d.submit(prompt, options)
        d.run()
        assert again.result().token_ids == alone(prompt, options).token_ids
        assert again.result().cached_prompt_tokens == len(prompt) - 1
        resident = assert_record_is_true(d, backend, 0)
    assert first.result().token_ids == alone([1, 2, 3, 4], options).token_ids


def test_a_cancelled_sequence_leaves_a_true_record_in_prefill_or_decoding():
    d, backend = driver(slots=2, chunk=3)
    prompt = list(range(1, 12))
    prefilling = d.submit(prompt, Options(max_tokens=5))
    decoding = d.submit([5, 6], Options(max_tokens=30), Oracle(), draft_width=3)
    d.step()
    d.step()
    prefilling.cancel()
    decoding.cancel()
    d.step()
    assert not d.running
    assert assert_record_is_true(d, backend, 0) == tuple(prompt[:6])  # two chunks of 3 were in
    record = assert_record_is_true(d, backend, 1)
    assert len(record) > 2 and record == tuple(decoding.state.context_tokens)[:-1]  # its pending token is not in
    # the next requests reuse them and still decode exactly what they would alone
    for base, slot in ((prompt, 0), (list(decoding.state.context_tokens), 1)):
        follow = d.submit([*base, 30], Options(max_tokens=4))
        d.run()
        assert follow.slot == slot and follow.result().cached_prompt_tokens == (6 if slot == 0 else len(base) - 1)
        assert follow.result().token_ids == alone([*base, 30], Options(max_tokens=4)).token_ids


def test_a_failed_sequence_leaves_a_true_record_and_a_foreign_failure_an_empty_one():
    options = Options(max_tokens=10)
    backend = FailingPass(fail_at=3)  # a BackendError: the slots are as they were
    d = BatchDriver(backend)
    failed = d.submit([1, 2, 3], options)
    d.run()
    assert isinstance(failed.error.__cause__, BackendError)
    assert assert_record_is_true(d, backend, 0) == (1, 2, 3, *failed.result().token_ids[:-1])
    follow = d.submit([*[1, 2, 3], *failed.result().token_ids, 7], options)
    d.run()
    assert follow.slot == 0 and follow.result().cached_prompt_tokens == 4
    assert follow.result().token_ids == alone([1, 2, 3, *failed.result().token_ids, 7], options).token_ids

    scrambling = ScramblingPass()
    d = BatchDriver(scrambling)
    failed = d.submit([1, 2, 3], options)
    d.run()
    assert isinstance(failed.error, GenerationError) and not isinstance(failed.error.__cause__, BackendError)
    assert d.resident_tokens(0) == ()  # what the slot holds is unknown: nothing is reused
    follow = d.submit([1, 2, 3, *failed.result().token_ids], options)
    d.run()
    assert follow.result().cached_prompt_tokens == 0
    assert follow.result().token_ids == alone([1, 2, 3, *failed.result().token_ids], options).token_ids


def test_a_failing_proposer_leaves_a_true_record():
    d, backend = driver(slots=1)
    failing = d.submit([1, 2, 3], Options(max_tokens=8), Raising())
    d.run()
    assert assert_record_is_true(d, backend, 0) == (1, 2, 3)  # the prompt pass ran; its token is pending
    follow = d.submit([1, 2, 3, *failing.result().token_ids, 4], Options(max_tokens=3))
    d.run()
    assert follow.result().cached_prompt_tokens == 3


class ScramblingPass(FakeBatchBackend):
    """Its third pass overwrites every slot's KV with other tokens, then raises something that is not a
    ``BackendError`` (a backend breaking its contract)."""

    def __init__(self):
        super().__init__(MODEL, 1, 256)
        self.calls = 0

    def run_pass(self, rows):
        self.calls += 1
        if self.calls == 3:
            for slot in range(self.slots):
                held = self.current_len(slot)
                self.reset(slot)
                super().run_pass([BatchRow(slot, (0,) * held, 0)])
            raise RuntimeError("the device wrote garbage")
        return super().run_pass(rows)


def test_prefix_reuse_is_a_bool():
    with pytest.raises(ValueError, match="prefix_reuse"):
        BatchDriver(FakeBatchBackend(MODEL, 1), prefix_reuse=1)
