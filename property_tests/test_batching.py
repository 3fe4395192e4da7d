"""Continuous batching changes nothing a sequence sees: for any batch composition, each request's output through
the ``BatchDriver`` equals that request decoded alone.

A batch is one model, a few slots and several requests (``scenarios`` of ``strategies.py``: greedy, seeded sampling
and penalties mixed; stops, EOS mid-block, context full; one in eight constrained by a fake grammar), each with its
own proposer and width policy, joining at a drawn pass, some cancelled at a drawn pass or after a drawn number of
delivered tokens, some streamed through a callback and some read through the iterator, prompts prefilled in chunks
of a drawn size under a drawn per-pass prompt-token budget (tiny ones, 1 to 3, included; or none), so prefilling
sequences sit passes out while the others decode: no pass folds in more prompt tokens than the budget, and every
decoding sequence has a row in every pass. Some requests share a prefix with an earlier one (its next turn: its
prompt, its output and new tokens; its prompt again or a part of it; only a few of its tokens, then others) and join
at a drawn later pass, so the driver's prefix reuse sends them to a slot that holds some of their KV, whatever that
slot held before; before every pass, each row's slot must hold exactly its own sequence's context up to the row's
position.

Each request is also decoded alone twice: with ``generate`` and no proposer (plain decoding, which the equivalence
suite proves equal to the reference) and with a ``Generation`` holding the same proposer and width policy. The
batched sequence must match the plain run's tokens, text, finish reason, matched stop, logprobs and streamed
deltas, and the lone speculative run's stats and failures (a proposer that raises, a row that is not finite)
exactly; a cancelled one must have delivered a prefix of the plain stream and report exactly that.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import attrs
from hypothesis import event, given, settings
from hypothesis import strategies as st

from ortspec import BatchDriver, BatchSequence, GenerateResult, Generation, GenerationError
from ortspec.backends.fake import FakeBackend, FakeBatchBackend, FakeModel
from ortspec.batch_driver import Phase
from property_tests.conftest import examples
from property_tests.strategies import (
    FaultyProposer,
    Scenario,
    fake_grammars,
    fake_models,
    proposers_for,
    scenarios,
    width_policies,
)

UNBOUNDED = 4096  # a scenario's capacity when it does not bound the context


class Delivered(NamedTuple):
    """One delivered token: ``finish_reason`` is what a callback was told (None for the iterator)."""

    text: str
    token_id: int
    finish_reason: object


@attrs.frozen
class Request:
    scenario: Scenario
    proposer: object  # a proposer, or ("faulty", at, fault): a fresh FaultyProposer for each run
    width: object
    join_at: int  # the driver's pass count at which it is submitted
    cancel: tuple[str, int] | None  # ("pass", n): at pass n; ("tokens", k): from the callback after k tokens
    callback: bool  # streamed through a callback (else read through the iterator)
    follows: str | None = None  # how its prompt shares an earlier request's (one of FOLLOW_UPS), or None
    _plain: dict = attrs.field(init=False, factory=dict, eq=False, repr=False)  # capacity -> ``plain``'s Outcome

    def make_proposer(self):
        if isinstance(self.proposer, tuple):
            _, at, fault = self.proposer
            return FaultyProposer(self.scenario.model, at, fault)
        return self.proposer

    def options(self):
        """The scenario's options with its capacity folded into ``max_context``: one backend serves every slot."""
        sc = self.scenario
        if sc.capacity >= UNBOUNDED:
            return sc.options
        limit = min(sc.capacity, sc.options.max_context or sc.capacity)
        return attrs.evolve(sc.options, max_context=limit)

    def plain(self, capacity: int) -> Outcome:
        """The request decoded alone with no proposer (``alone``), run once per capacity: a later request's
        prompt is drawn from it, and the property compares the batched sequence with it."""
        if capacity not in self._plain:
            self._plain[capacity] = alone(self, capacity, None)
        return self._plain[capacity]


@attrs.frozen
class Outcome:
    result: GenerateResult
    error: GenerationError | None
    stream: list


def alone(req: Request, capacity: int, proposer) -> Outcome:
    """The request decoded alone on a ``FakeBackend``, with ``proposer`` (None: plain)."""
    sc, stream = req.scenario, []
    backend = FakeBackend(sc.model, capacity)
    try:  # the prompt pass runs in the constructor
        run = Generation(backend, sc.prompt, req.options(), proposer, draft_width=req.width, detokenize=sc.detokenize)
        result = run.run(lambda text, token_id, finish: stream.append(Delivered(text, token_id, finish)))
    except GenerationError as exc:
        return Outcome(exc.partial, exc, stream)
    return Outcome(result, None, stream)


FOLLOW_UPS = ("next turn", "next turn", "the same prompt", "a part of the prompt", "into the output", "a few tokens")


def follow_up(draw, model: FakeModel, earlier: Request) -> tuple[tuple[int, ...], str]:
    """A prompt sharing a prefix with ``earlier``'s, and how it shares it (one of ``FOLLOW_UPS``): the next turn
    (its prompt, its output alone, new tokens), its prompt again, a part of its prompt, its prompt and a part of its
    output then others, or only a few of its first tokens then others."""
    prompt = earlier.scenario.prompt
    output = earlier.plain(UNBOUNDED).result.token_ids
    new = st.lists(st.integers(0, model.vocab_size - 1), max_size=6)
    kind = draw(st.sampled_from(FOLLOW_UPS))
    if kind == "next turn":
        shared = prompt + output + tuple(draw(new))
    elif kind == "the same prompt":
        shared = prompt
    elif kind == "a part of the prompt":
        shared = prompt[: draw(st.integers(1, len(prompt)))]
    elif kind == "into the output":
        shared = prompt + output[: draw(st.integers(0, len(output)))] + tuple(draw(new))
    else:
        few = prompt[: draw(st.integers(0, min(3, len(prompt))))]
        shared = few + tuple(draw(st.lists(st.integers(0, model.vocab_size - 1), min_size=1, max_size=8)))
    return shared, kind


@st.composite
def batches(draw):
    """A model, a backend capacity, slots, a prefill chunk, a prefill budget and the requests."""
    model: FakeModel = draw(fake_models(nonfinite=draw(st.integers(0, 7)) == 0))
    n = draw(st.integers(1, 6))
    requests: list[Request] = []
    for _ in range(n):
        earlier = draw(st.sampled_from(requests)) if requests and draw(st.integers(0, 2)) == 0 else None
        prompt, follows = follow_up(draw, model, earlier) if earlier is not None else (None, None)
        sc = draw(scenarios(model=model, prompt=prompt))
        if draw(st.integers(0, 7)) == 0:  # structured output: a fake grammar masks every row
            grammar = draw(fake_grammars(model.vocab_size, sc.options.eos_token_ids))
            sc = attrs.evolve(sc, options=attrs.evolve(sc.options, grammar=grammar))
        if draw(st.integers(0, 9)) == 0:
            proposer = ("faulty", draw(st.integers(0, 6)), draw(st.sampled_from(["raise", "out_of_range"])))
        else:
            proposer = draw(proposers_for(model, sc.rules, len(sc.prompt)))
        cancel = draw(
            st.one_of(
                st.none(), st.none(), st.none(), st.tuples(st.just("pass"), st.integers(0, 30)),
                st.tuples(st.just("tokens"), st.integers(1, 40)),
            )
        )  # fmt: skip
        if earlier is None:
            join_at = draw(st.one_of(st.just(0), st.integers(0, 4), st.integers(0, 25)))
        else:  # often after the earlier one has finished and left its KV in a slot
            join_at = earlier.join_at + draw(st.one_of(st.integers(0, 8), st.integers(0, 90)))
        requests.append(Request(sc, proposer, draw(width_policies()), join_at, cancel, draw(st.booleans()), follows))
    # The slots' capacity: unbounded, or just above the longest prompt (so some requests meet it).
    longest = max(len(r.scenario.prompt) for r in requests)
    capacity = draw(st.sampled_from([UNBOUNDED, UNBOUNDED, longest + draw(st.integers(0, 12))]))
    slots = draw(st.integers(1, 4))
    chunk = draw(st.sampled_from([1, 2, 3, 5, 8, 16, 512]))
    budget = draw(st.sampled_from([None, None, 1, 2, 3, 4, 7, 16, 512]))
    # How the driver prices a plain step and a draft (widths only: never the output): as alone, or by a cost curve,
    # with draft rows running alone or beside the others (a ragged backend).
    steps = draw(st.lists(st.floats(0.0, 1.5), min_size=slots - 1, max_size=slots - 1))
    costs = draw(st.sampled_from([None, tuple(itertools.accumulate([0.0, 1.0, *steps]))]))
    return model, capacity, slots, Prefill(chunk, budget, draw(st.booleans())), requests, costs


def submit(driver: BatchDriver, req: Request, stream: list) -> BatchSequence:
    sc = req.scenario
    callback = None
    if req.callback:

        def callback(text, token_id, finish_reason):
            stream.append(Delivered(text, token_id, finish_reason))
            if req.cancel is not None and req.cancel[0] == "tokens" and len(stream) >= req.cancel[1]:
                sequence.cancel()

    sequence = driver.submit(
        sc.prompt, req.options(), req.make_proposer(), draft_width=req.width, detokenize=sc.detokenize,
        callback=callback,
    )  # fmt: skip
    return sequence


class Prefill(NamedTuple):
    """How the driver prefills: ``chunk`` (``prefill_chunk``) and ``budget`` (``prefill_budget``), on a backend
    whose passes run draft rows beside the others or not (``ragged``: how drafts are priced)."""

    chunk: int
    budget: int | None
    ragged: bool = False


class PhaseTracingBackend(FakeBatchBackend):
    """Records, for each pass, the phases of the sequences running in it, and checks that each row's slot holds
    exactly the KV of its own sequence's context up to the row's position (reused from an earlier sequence or
    not), that the pass folds in at most the prefill budget's prompt tokens, and that every decoding sequence has
    a row in it. ``sat_out``: passes in which a prefilling sequence had no row."""

    driver: BatchDriver

    def __init__(self, model, slots, max_length, ragged=False):
        super().__init__(model, slots, max_length, ragged_rows=ragged)
        self.phases: list[set[Phase]] = []
        self.sat_out = 0

    def run_pass(self, rows):
        running = self.driver.running
        self.phases.append({s.phase for s in running})
        holder = {s.slot: s for s in running}
        for row in rows:
            context = holder[row.slot].state.context_tokens
            assert self.slot_backend(row.slot).resident_tokens() == context[: row.position]
        in_pass = {row.slot for row in rows}
        assert all(s.slot in in_pass for s in running if s.phase is Phase.DECODING)
        prompt_tokens = sum(len(row.tokens) for row in rows if holder[row.slot].phase is Phase.PREFILL)
        budget = self.driver.prefill_budget
        assert budget is None or prompt_tokens <= budget
        self.sat_out += any(s.slot not in in_pass for s in running if s.phase is Phase.PREFILL)
        return super().run_pass(rows)


def run_batch(
    model, capacity, slots, prefill: Prefill, requests, decode_costs=None
) -> tuple[list[Outcome], PhaseTracingBackend, BatchDriver]:
    """Submit each request at its tick, cancel at its tick, run until every sequence is done (a tick is one call
    of ``step``, which runs a pass unless the driver is idle)."""
    backend = PhaseTracingBackend(model, slots, capacity, prefill.ragged)
    driver = backend.driver = BatchDriver(
        backend, prefill_chunk=prefill.chunk, prefill_budget=prefill.budget, decode_costs=decode_costs
    )
    sequences: dict[int, BatchSequence] = {}
    streams: dict[int, list] = {i: [] for i in range(len(requests))}
    tick = 0
    while True:
        for i, req in enumerate(requests):
            if i not in sequences and req.join_at <= tick:
                sequences[i] = submit(driver, req, streams[i])
            if i in sequences and req.cancel == ("pass", tick - req.join_at):
                sequences[i].cancel()
        if not driver.step() and len(sequences) == len(requests):
            break
        tick += 1
    outcomes = []
    for i, req in enumerate(requests):
        sequence = sequences[i]
        assert sequence.done
        if not req.callback:  # read the iterator's buffer (the sequence is done: no pass runs)
            try:
                streams[i].extend(Delivered(c.text, c.token_id, None) for c in sequence)
            except GenerationError as exc:
                assert exc is sequence.error
        outcomes.append(Outcome(sequence.result(), sequence.error, streams[i]))
    return outcomes, backend, driver


def same_output(got: GenerateResult, want: GenerateResult) -> None:
    assert got.token_ids == want.token_ids
    assert got.text == want.text
    assert got.finish_reason == want.finish_reason
    assert got.stop_matched == want.stop_matched
    assert got.logprobs == want.logprobs


def comparable(stream: list, callback: bool) -> list:
    """A stream as the iterator would show it (no finish reasons) unless read through a callback."""
    return list(stream) if callback else [Delivered(d.text, d.token_id, None) for d in stream]


def check_request(req: Request, got: Outcome, capacity: int, priced: bool) -> list[str]:
    """The property for one request; returns labels for the tally. ``priced``: the driver priced plain steps by
    a cost curve, so the request's widths (and so its stats, and where a faulty proposer fails) are not those of
    the request alone; its output still is."""
    cached = got.result.cached_prompt_tokens
    assert 0 <= cached < len(req.scenario.prompt)  # the last prompt token is always run: its row picks a token
    labels = [f"a prompt reused a slot's KV ({req.follows or 'unrelated'})"] if cached else []
    plain = req.plain(capacity)
    if priced:
        return [*labels, *check_against_plain(req, got, plain)]
    spec = alone(req, capacity, req.make_proposer())
    # Speculation alone is plain decoding (the equivalence suite's property), up to a proposer's own failure.
    if spec.error is None:
        same_output(spec.result, plain.result)
    if req.cancel is not None and got.error is None and got.result.finish_reason is None:
        # Cancelled before it finished: it delivered a prefix of the stream, and reports exactly that.
        delivered = got.stream
        assert comparable(spec.stream, req.callback)[: len(delivered)] == delivered
        assert list(got.result.token_ids) == [d.token_id for d in delivered]
        assert got.result.text == "".join(d.text for d in delivered)
        if req.cancel[0] == "tokens" and req.callback:  # cancelled from its callback: nothing after that token
            assert len(delivered) == req.cancel[1]
        return [*labels, "cancelled before the end"]
    assert (got.error is None) == (spec.error is None), (got.error, spec.error)
    same_output(got.result, spec.result)
    assert got.result.stats == spec.result.stats  # the same steps, drafts and acceptance as alone
    assert got.stream == comparable(spec.stream, req.callback)
    assert "".join(d.text for d in got.stream) == got.result.text
    if got.error is not None:
        assert type(got.error.__cause__) is type(spec.error.__cause__)
        return [*labels, "failed like alone"]
    same_output(got.result, plain.result)
    assert got.stream == comparable(plain.stream, req.callback)
    return [*labels, f"ended by {got.result.finish_reason}"]


def check_against_plain(req: Request, got: Outcome, plain: Outcome) -> list[str]:
    """Whatever the widths: the output is plain decoding's; a cancelled or failed sequence delivered (and reports)
    a prefix of it."""
    want = comparable(plain.stream, req.callback)
    if got.result.finish_reason is None:  # cancelled, its proposer failed, or the core failed as it does alone
        assert got.error is None or isinstance(req.proposer, tuple) or plain.error is not None, got.error
        assert want[: len(got.stream)] == got.stream
        assert list(got.result.token_ids) == list(plain.result.token_ids)[: len(got.result.token_ids)]
        return ["priced: stopped before the end"]
    assert got.error is None
    same_output(got.result, plain.result)
    assert got.stream == want
    return [f"priced: ended by {got.result.finish_reason}"]


@settings(max_examples=examples(300))
@given(batches())
def test_each_sequence_of_a_batch_is_its_request_decoded_alone(batch):
    model, capacity, slots, prefill, requests, decode_costs = batch
    outcomes, backend, driver = run_batch(model, capacity, slots, prefill, requests, decode_costs)
    labels = set()
    for req, got in zip(requests, outcomes, strict=True):
        labels.update(check_request(req, got, capacity, decode_costs is not None))
    # One row per running sequence, never more rows than slots; every slot is free at the end.
    assert max(backend.rows_per_pass, default=0) <= slots
    assert not driver.running and not driver.waiting
    if len(requests) > slots:
        labels.add("more requests than slots")
    if max(backend.rows_per_pass, default=0) >= 2:
        labels.add("a pass carried several rows")
    if any(len(r.scenario.prompt) > prefill.chunk for r in requests):
        labels.add("a prompt prefilled in chunks")
    if backend.sat_out:
        labels.add("a prefilling sequence sat a pass out (the prefill budget was spent)")
    if any({Phase.PREFILL, Phase.DECODING} <= phases for phases in backend.phases):
        labels.add("a prompt chunk and a decoding sequence in one pass")
    if any(r.scenario.options.sampling.temperature > 0 for r in requests) and any(
        r.scenario.options.sampling.temperature == 0 for r in requests
    ):
        labels.add("greedy and sampling in one batch")
    for label in sorted(labels):
        event(label)
