"""Suffix drafting never changes an output: whatever the suffix cache was fed before (the request's own plain
continuation, or that continuation perturbed, random junk, huge repeats; capped small so that it evicts), a
request with ``SuffixProposer`` gives exactly what plain decoding gives it, greedy and seeded sampling, alone
(``Generation``) and batched (``BatchDriver``, where finished requests feed the cache the later ones start with,
as an Engine's ``SuffixCache`` does)."""

from __future__ import annotations

import attrs
from hypothesis import event, given, settings
from hypothesis import strategies as st

from ortspec import BatchDriver, GenerationError, generate
from ortspec.backends.fake import FakeBackend, FakeBatchBackend, FakeModel
from ortspec.core import DraftRule, SuffixProposer, SuffixSnapshot
from property_tests.conftest import examples
from property_tests.strategies import Scenario, fake_models, scenarios, width_policies

FEEDS = ("the plain continuation", "perturbed", "junk", "huge repeat", "another prompt's")


def plain(sc: Scenario):
    try:
        return generate(FakeBackend(sc.model, sc.capacity), sc.prompt, sc.options, detokenize=sc.detokenize), None
    except GenerationError as exc:
        return exc.partial, exc


@st.composite
def fed_snapshot(draw, sc: Scenario) -> SuffixSnapshot:
    """A snapshot fed documents of the kinds in ``FEEDS`` (the plain continuation, right or wrong), capped small."""
    vocab = sc.model.vocab_size
    continuation = list(plain(sc)[0].token_ids)
    snapshot = SuffixSnapshot(max_tokens=draw(st.sampled_from([8, 40, 400, 65536])))
    for _ in range(draw(st.integers(0, 5))):
        kind = draw(st.sampled_from(FEEDS))
        event(f"fed: {kind}")
        doc = [*sc.prompt[-draw(st.integers(0, 8)) :]]
        if kind == "the plain continuation":
            doc += continuation
        elif kind == "perturbed" and continuation:
            at = draw(st.integers(0, len(continuation) - 1))
            wrong = (continuation[at] + draw(st.integers(1, vocab - 1))) % vocab
            doc += [*continuation[:at], wrong, *continuation[at + 1 :]]
        elif kind == "huge repeat":
            doc += draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=3)) * draw(st.integers(50, 300))
        else:  # junk, or the continuation of another prompt
            doc = draw(st.lists(st.integers(0, vocab - 1), max_size=60))
        snapshot = snapshot.with_document(doc)
    return snapshot


def rules():
    return st.builds(
        DraftRule,
        anchor=st.integers(1, 4),
        occurrences=st.integers(1, 40),
        max_match=st.integers(1, 40),
        spec_factor=st.sampled_from([0.5, 1.0, 2.0, 8.0]),
        min_prob=st.sampled_from([0.0, 0.1, 0.5, 1.0]),
        max_draft=st.integers(1, 16),
        resync_back=st.integers(0, 8),
        resync_match=st.integers(1, 8),
        resync_reach=st.integers(0, 40),
        branches=st.integers(1, 4),
    )


def same(got, want) -> None:
    assert got.token_ids == want.token_ids
    assert got.text == want.text
    assert got.finish_reason == want.finish_reason
    assert got.stop_matched == want.stop_matched
    assert got.logprobs == want.logprobs


@settings(max_examples=examples(100))
@given(st.data())
def test_a_request_alone_gives_its_plain_output_whatever_the_cache_holds(data):
    sc: Scenario = data.draw(scenarios(), label="scenario")
    snapshot = data.draw(fed_snapshot(sc), label="snapshot")
    proposer = SuffixProposer(data.draw(rules(), label="rule"), cache=snapshot)
    want, want_error = plain(sc)
    backend = FakeBackend(sc.model, sc.capacity)
    try:
        got = generate(backend, sc.prompt, sc.options, proposer, draft_width=data.draw(width_policies()),
                       detokenize=sc.detokenize)  # fmt: skip
    except GenerationError as exc:
        assert want_error is not None and type(exc.__cause__) is type(want_error.__cause__)
        got = exc.partial
    else:
        assert want_error is None
    same(got, want)
    event(f"accepted draft tokens: {'some' if got.stats.accepted_tokens else 'none'}")


@settings(max_examples=examples(40))
@given(st.data())
def test_batched_requests_give_their_plain_outputs_while_finished_ones_feed_the_cache(data):
    model: FakeModel = data.draw(fake_models(), label="model")
    first = data.draw(scenarios(model=model), label="first")
    cell = [data.draw(fed_snapshot(first), label="snapshot")]  # the cache: the newest snapshot
    recorded = []

    def record(state) -> None:  # what Engine.record_output does
        recorded.append(tuple(state.generated_tokens))
        cell[0] = cell[0].with_document([*state.prompt_tokens[-8:], *state.generated_tokens])

    requests = [first]
    for _ in range(data.draw(st.integers(0, 4))):  # often the same prompt again (its output is then in the cache)
        again = data.draw(st.booleans())
        requests.append(data.draw(scenarios(model=model, prompt=first.prompt if again else None), label="request"))
    rule = data.draw(rules(), label="rule")
    driver = BatchDriver(FakeBatchBackend(model, slots=data.draw(st.integers(1, 3)), max_length=4096))
    submitted = []
    for sc in requests:
        options = attrs.evolve(sc.options, max_context=min(sc.capacity, sc.options.max_context or sc.capacity))
        proposer = SuffixProposer(rule, cache=cell[0])  # the snapshot as the request starts
        sequence = driver.submit(sc.prompt, options, proposer, draft_width=data.draw(width_policies()),
                                 detokenize=sc.detokenize, on_finish=record)  # fmt: skip
        submitted.append((sc, options, sequence))
        for _ in range(data.draw(st.integers(0, 30))):  # the next request joins a few passes later
            driver.step()
    driver.run()
    finished = []
    for sc, options, sequence in submitted:
        want_run = attrs.evolve(sc, options=options, capacity=4096)
        want, want_error = plain(want_run)
        assert (sequence.error is None) == (want_error is None)
        got = sequence.result() if sequence.error is None else sequence.error.partial
        same(got, want)
        if sequence.error is None and sequence.state.finished and got.token_ids:
            finished.append(got.token_ids)
    assert sorted(recorded) == sorted(finished)
