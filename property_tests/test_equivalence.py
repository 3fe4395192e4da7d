"""The central property: greedy generation is the reference decoder, and speculative generation is greedy
generation, whatever the proposer, the width policy, the backend's pick path and the options.

The reference (``property_tests/reference.py``) shares no code with ``ortspec``; the greedy run goes through the
library's driver and core with no proposer; the speculative run goes through the same driver with a proposer,
on the logits path or the device-picks path. All three must agree on the tokens, the text, the finish reason, the
matched stop, the logprobs and the streamed deltas; the failures (non-finite rows, a proposer or a stream callback
that raises, corrupt picks) must surface as errors that carry exactly what was delivered before them.
"""

from __future__ import annotations

import copy
import math
from typing import NamedTuple

import attrs
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from ortspec import Generation, GenerationAborted, GenerationError, ProposerError, generate
from ortspec.backends.fake import FakeBackend, FakeModel
from ortspec.core import CostAwareWidth, FinishReason, FixedWidth, LookupOrDraft, Options, PromptLookup
from property_tests import edges
from property_tests.conftest import examples
from property_tests.reference import PickRules, ReferenceError, ReferenceRun, greedy_reference
from property_tests.strategies import (
    FaultyProposer,
    OracleProposer,
    Scenario,
    proposers_for,
    rules_as_sampling,
    scenarios,
    width_policies,
)


@attrs.frozen
class ObservedPolicy:
    """A width policy that logs every ``observe(proposed, accepted)`` the driver makes."""

    inner: object
    log: list

    def width(self) -> int:
        return self.inner.width()

    def observe(self, proposed: int, accepted: int) -> ObservedPolicy:
        self.log.append((proposed, accepted))
        return ObservedPolicy(self.inner.observe(proposed, accepted), self.log)


class TracingBackend(FakeBackend):
    """A FakeBackend that records the draft of every pass (``drafts[i]`` for pass ``i + 1``; the prompt pass
    verifies nothing)."""

    def __init__(self, model, max_length, *, picks_on_device=False, verify_drift=0.0):
        super().__init__(model, max_length, picks_on_device=picks_on_device, verify_drift=verify_drift)
        self.drafts: list[tuple[int, ...]] = []

    def _run(self, tokens, position, what):
        rows = super()._run(tokens, position, what)
        self.drafts.append(tuple(int(t) for t in tokens[1:]) if position else ())
        return rows


@attrs.frozen
class Run:
    result: object
    stream: list  # (pass number, token id, text, logprob) per commit
    drafts: list[tuple[int, ...]]

    @property
    def widths(self) -> list[int]:
        return [len(d) for d in self.drafts]


class Delivered(NamedTuple):
    """One call of a stream callback."""

    text: str
    token_id: int
    finish_reason: object


class Streamed(list):
    """A stream callback (``callback(text, token_id, finish_reason)``) that records each call as ``Delivered``."""

    def __call__(self, text: str, token_id: int, finish_reason: object) -> None:
        self.append(Delivered(text, token_id, finish_reason))


def run(sc: Scenario, proposer=None, width=1, *, picks=False, drift=0.0) -> Run:
    backend = TracingBackend(sc.model, sc.capacity, picks_on_device=picks, verify_drift=drift)
    stream = []
    generation = Generation(backend, sc.prompt, sc.options, proposer, draft_width=width, detokenize=sc.detokenize)
    for c in generation:
        stream.append((backend.passes, c.token_id, c.text, c.logprob))
    result = generation.result()
    # The KV trails the committed tokens by one, and no pass ever held a position that could not be committed.
    assert backend.current_len() == len(sc.prompt) + len(result.token_ids) - 1 or not result.token_ids
    limit = min(sc.options.max_context or sc.capacity, sc.capacity, len(sc.prompt) + sc.options.max_tokens)
    assert backend.peak_len <= limit - 1
    return Run(result, stream, backend.drafts)


def reference(sc: Scenario) -> ReferenceRun:
    o = sc.options
    return greedy_reference(
        sc.model.after, sc.prompt, max_tokens=o.max_tokens, eos_token_ids=o.eos_token_ids,
        stop_token_sequences=o.stop_token_sequences, stop_strings=o.stop_strings, max_context=o.max_context,
        capacity=sc.capacity, top_logprobs=o.top_logprobs, detokenize=sc.detokenize, rules=sc.rules,
    )  # fmt: skip


def assert_matches_reference(ref: ReferenceRun, greedy: Run) -> None:
    r = greedy.result
    assert list(r.token_ids) == ref.tokens
    assert r.text == ref.text
    assert (str(r.finish_reason) if r.finish_reason else None) == ref.finish_reason
    assert r.stop_matched == ref.stop_matched
    assert [text for _, _, text, _ in greedy.stream] == ref.deltas
    if ref.logprobs:
        assert len(r.logprobs) == len(ref.logprobs)
        for got, (token, logprob, top) in zip(r.logprobs, ref.logprobs, strict=True):
            assert got.token_id == token
            assert got.logprob == pytest.approx(logprob, abs=1e-9)
            assert [t for t, _ in got.top] == [t for t, _ in top]
            assert [v for _, v in got.top] == pytest.approx([v for _, v in top], abs=1e-9)
    else:
        assert r.logprobs is None


def assert_same_output(spec: Run, greedy: Run) -> None:
    a, b = spec.result, greedy.result
    assert a.token_ids == b.token_ids
    assert a.text == b.text
    assert a.finish_reason == b.finish_reason
    assert a.stop_matched == b.stop_matched
    assert a.logprobs == b.logprobs
    assert [c[1:] for c in spec.stream] == [c[1:] for c in greedy.stream]  # same deltas, token by token
    assert "".join(c[2] for c in spec.stream) == a.text


def check_stats(run: Run) -> None:
    s = run.result.stats
    assert 0 <= s.accepted_tokens <= s.proposed_tokens
    assert s.verification_steps <= s.steps == len(run.widths)  # one backend pass per step
    assert s.proposed_tokens == sum(run.widths)
    assert s.multi_token_accepts <= s.verification_steps
    assert s.tie_guard_stops <= s.steps
    assert len(run.result.token_ids) <= s.accepted_tokens + s.steps


def classify(sc: Scenario, spec: Run) -> list[str]:
    """Labels for the edge-coverage tally: which risky places this example reached."""
    r, s = spec.result, spec.result.stats
    labels = []
    if s.verification_steps:
        labels.append("ran a verify pass")
    if s.multi_token_accepts:
        labels.append("accepted several draft tokens in one pass")
    if spec.stream and r.finish_reason is not None:
        last_pass = spec.stream[-1][0]
        in_last = sum(1 for c in spec.stream if c[0] == last_pass)
        draft = spec.drafts[last_pass - 1]
        # Ended inside a block: the last pass verified a draft and its rules committed two or more of its
        # candidates, or stopped before all of its candidates (accepted drafts + bonus) were committed.
        greedy_next = OracleProposer(sc.model, sc.rules, len(sc.prompt)).continuation(
            sc.prompt + r.token_ids[: len(r.token_ids) - in_last], len(draft)
        )
        accepted = next((i for i, t in enumerate(draft) if i >= len(greedy_next) or t != greedy_next[i]), len(draft))
        if draft and (in_last >= 2 or in_last < accepted + 1):
            kind = {
                FinishReason.EOS_TOKEN: "eos",
                FinishReason.MAX_TOKENS: "max_tokens",
                FinishReason.CONTEXT_FULL: "context",
            }.get(r.finish_reason)
            if r.finish_reason is FinishReason.STOP_SEQUENCE:
                kind = "stop string" if isinstance(r.stop_matched, str) else "stop sequence"
            labels.append(f"ended inside a block: {kind}")
    if sc.rules.temperature > 0:
        labels.append("sampling")
    if sc.options.sampling.processes:
        labels.append("penalties or logit bias")
    if sc.model.vocab_size >= 256:
        labels.append("vocabulary >= 256")
    if max(spec.widths, default=0) > 12:
        labels.append("a pass verified more than 12 drafts")
    if sc.detokenizer == "sentencepiece":
        labels.append("non-concatenative detokenizer")
    if any("\ufffd" in t for t in [r.text]) or any(ord(ch) > 0x7F for ch in r.text):
        labels.append("non-ASCII text")
    if any(len(s) > 4 for s in sc.options.stop_strings):
        labels.append("stop string longer than 4 characters")
    return labels


def check_equivalence(sc: Scenario, data) -> None:
    """The property for one scenario: reference == greedy == speculative, and the edge tally."""
    proposer = data.draw(proposers_for(sc.model, sc.rules, len(sc.prompt)), label="proposer")
    width = data.draw(width_policies(), label="width")
    picks = sc.options.top_logprobs == 0 and data.draw(st.booleans(), label="device picks")
    observations: list[tuple[int, int]] = []
    ref = reference(sc)
    greedy = run(sc)
    spec = run(sc, proposer, ObservedPolicy(FixedWidth(width) if isinstance(width, int) else width, observations),
               picks=picks)  # fmt: skip

    assert_matches_reference(ref, greedy)
    assert_same_output(spec, greedy)
    check_stats(greedy)
    check_stats(spec)
    assert greedy.result.stats.proposed_tokens == 0
    # The width policy is told the truth: each step's draft size and how many of its drafts were committed.
    s = spec.result.stats
    assert [p for p, _ in observations] == spec.widths[1:]
    assert sum(a for _, a in observations) == s.accepted_tokens
    assert all(0 <= a <= p for p, a in observations)
    # Never more target passes than greedy (a tie-guard stop that commits nothing costs one pass).
    assert spec.result.stats.steps <= greedy.result.stats.steps + spec.result.stats.tie_guard_stops
    if isinstance(proposer, OracleProposer) and isinstance(width, int) and sc.options.tie_margin == 0:
        # Oracle drafts are all accepted, except where a stop rule ended the block.
        assert spec.result.stats.proposed_tokens - spec.result.stats.accepted_tokens <= width

    labels = classify(sc, spec) + (["device picks path"] if picks else [])
    for label in labels:
        event(label)
    edges.record(labels)


def _equivalence_test(mode: str, end: str, n: int):
    """The property over scenarios of pick ``mode`` that plant ``end`` (so every kind of ending gets its share),
    ``n`` examples in the ci profile."""

    @settings(max_examples=examples(n))
    @given(scenarios(end=end, mode=mode), st.data())
    def test(sc, data):
        check_equivalence(sc, data)

    test.__doc__ = f"speculative == plain == reference ({mode}), generations planted to end by {end}"
    return test


# 2,550 examples per mode; the limits end a block less often (the last block must be drafted whole), so they get
# more. With the tiny-budget tests below, each mode runs 3,000 examples, what fits the README test command's 15
# minutes (HYPOTHESIS_PROFILE=full: twice as many; thorough: 20x; the quick profile's 5% already catches every
# mutant of scripts/mutation_check.py that the property suite is run against).
_SHARE = {"stop_string": 420, "stop_sequence": 420, "eos": 360, "max_tokens": 510, "context": 660, "free": 180}
for _mode in ("greedy", "sampling"):
    for _end, _n in _SHARE.items():
        globals()[f"test_{_mode}_equivalence_ending_by_{_end}"] = _equivalence_test(_mode, _end, _n)


# Budgets of 1-3 tokens, with the scenario's rule planted within them (the scenario decodes only that much).
@settings(max_examples=examples(450))
@given(scenarios(mode="greedy", max_new=(1, 3)), st.data())
def test_greedy_equivalence_with_tiny_budgets(sc, data):
    check_tiny_budget(sc, data)


@settings(max_examples=examples(450))
@given(scenarios(mode="sampling", max_new=(1, 3)), st.data())
def test_sampling_equivalence_with_tiny_budgets(sc, data):
    check_tiny_budget(sc, data)


def check_tiny_budget(sc, data):
    assert 1 <= sc.options.max_tokens <= 3
    proposer = data.draw(proposers_for(sc.model, sc.rules, len(sc.prompt)), label="proposer")
    width = data.draw(width_policies(), label="width")
    greedy = run(sc)
    assert_matches_reference(reference(sc), greedy)
    assert_same_output(run(sc, proposer, width, picks=sc.options.top_logprobs == 0), greedy)


def _expect_failure(sc: Scenario, action) -> tuple[GenerationError, list]:
    """Run ``action(backend, on_commit)`` on a fresh backend; return the GenerationError and what was streamed."""
    backend = FakeBackend(sc.model, sc.capacity)
    streamed = Streamed()
    with pytest.raises(GenerationError) as info:
        action(backend, streamed)
    # Whatever failed, the same backend serves the next generation correctly.
    again = generate(backend, sc.prompt, sc.options, detokenize=sc.detokenize)
    assert list(again.token_ids) == reference(sc).tokens
    return info.value, streamed


def _assert_partial(error: GenerationError, streamed: list, ref: ReferenceRun) -> None:
    """The error carries exactly what was delivered: a prefix of the reference, token for token and text."""
    partial = error.partial
    finished = len(streamed) == len(ref.tokens)  # the failure came after the last token was delivered
    assert (str(partial.finish_reason) if partial.finish_reason else None) == (ref.finish_reason if finished else None)
    assert list(partial.token_ids) == [c.token_id for c in streamed] == ref.tokens[: len(streamed)]
    assert partial.text == "".join(c.text for c in streamed) == "".join(ref.deltas[: len(streamed)])


@settings(max_examples=examples(180))
@given(scenarios(), st.integers(0, 6), st.sampled_from(["raise", "out_of_range", "negative", "not_int"]), st.data())
def test_a_faulty_proposer_stops_generation_with_what_was_delivered(sc, at, fault, data):
    ref = reference(sc)
    proposer = FaultyProposer(sc.model, at, fault)
    width = data.draw(st.integers(1, 8), label="width")
    try:
        result = generate(FakeBackend(sc.model, sc.capacity), sc.prompt, sc.options, proposer, draft_width=width,
                          detokenize=sc.detokenize)  # fmt: skip
    except GenerationError as exc:
        assert isinstance(exc.__cause__, ProposerError)
        assert len(proposer.calls) == at + 1  # it failed at the first bad proposal
        error, streamed = _expect_failure(
            sc, lambda b, cb: generate(b, sc.prompt, sc.options, FaultyProposer(sc.model, at, fault),
                                       draft_width=width, callback=cb, detokenize=sc.detokenize),
        )  # fmt: skip
        _assert_partial(error, streamed, ref)
        event("proposer fault surfaced")
    else:  # the generation ended before the proposer was asked a bad time
        assert len(proposer.calls) <= at
        assert list(result.token_ids) == ref.tokens


@settings(max_examples=examples(180))
@given(scenarios(), st.integers(0, 20), st.data())
def test_a_raising_callback_stops_generation_with_what_was_delivered(sc, at, data):
    ref = reference(sc)
    proposer = data.draw(proposers_for(sc.model, sc.rules, len(sc.prompt)), label="proposer")
    if len(ref.tokens) <= at:
        return

    def action(backend, record):
        def callback(text, token_id, finish_reason):
            record(text, token_id, finish_reason)
            if len(record) > at:
                raise KeyError("the consumer went away")

        generate(backend, sc.prompt, sc.options, proposer, draft_width=8, callback=callback,
                 detokenize=sc.detokenize)  # fmt: skip

    error, streamed = _expect_failure(sc, action)
    assert isinstance(error, GenerationAborted) and isinstance(error.__cause__, KeyError)
    assert len(streamed) == at + 1
    _assert_partial(error, streamed, ref)


class CorruptPicksBackend(FakeBackend):
    """A device-picks backend whose ``fault``-th picks pass returns an id outside the vocabulary or a NaN
    margin (a broken kernel)."""

    def __init__(self, model, max_length, fault_at, kind):
        super().__init__(model, max_length, picks_on_device=True)
        self.fault_at, self.kind, self.picks_calls = fault_at, kind, 0

    def verify_picks(self, tokens, base):
        picks, margins = super().verify_picks(tokens, base)
        self.picks_calls += 1
        if self.picks_calls == self.fault_at:
            if self.kind == "id":
                picks[0] = self.vocab_size + 7
            else:
                margins[0] = np.nan
        return picks, margins


@settings(max_examples=examples(120))
@given(scenarios(mode="greedy"), st.integers(1, 5), st.sampled_from(["id", "nan"]))
def test_corrupt_device_picks_never_become_tokens(sc, fault_at, kind):
    # Device picks are argmax picks: plain greedy rules (no penalties), no logprobs.
    plain = attrs.evolve(sc.options, sampling=rules_as_sampling(PickRules()), top_logprobs=0)
    sc = attrs.evolve(sc, options=plain, rules=PickRules())
    ref = reference(sc)
    backend = CorruptPicksBackend(sc.model, sc.capacity, fault_at, kind)
    streamed = Streamed()
    try:
        oracle = OracleProposer(sc.model, sc.rules, len(sc.prompt))
        result = generate(backend, sc.prompt, sc.options, oracle, draft_width=4, callback=streamed,
                          detokenize=sc.detokenize)  # fmt: skip
    except GenerationError as exc:
        assert isinstance(exc.__cause__, ValueError)
        assert ("outside the vocabulary" if kind == "id" else "not finite") in str(exc.__cause__)
        assert backend.picks_calls == fault_at
        _assert_partial(exc, streamed, ref)
    else:
        assert backend.picks_calls < fault_at
        assert list(result.token_ids) == ref.tokens


@settings(max_examples=examples(240))
@given(scenarios(nonfinite=True), st.data())
def test_non_finite_rows_are_refused_at_the_same_token(sc, data):
    """A row that is not finite where its pick is made is never turned into a token, on any path: greedy,
    speculative (logits or device picks) and the reference all stop at the same token."""
    proposer = data.draw(proposers_for(sc.model, sc.rules, len(sc.prompt)), label="proposer")
    picks = sc.options.top_logprobs == 0 and data.draw(st.booleans(), label="device picks")
    try:
        reference(sc)
    except ReferenceError as exc:
        ref_error = exc
    else:
        assert_same_output(run(sc, proposer, 8, picks=picks), run(sc))
        return
    event("non-finite row reached")
    for prop in (None, proposer):
        backend = FakeBackend(sc.model, sc.capacity, picks_on_device=picks)
        streamed = Streamed()
        with pytest.raises(GenerationError, match="not finite") as info:
            generate(backend, sc.prompt, sc.options, prop, draft_width=8, callback=streamed,
                     detokenize=sc.detokenize)  # fmt: skip
        assert list(info.value.partial.token_ids) == ref_error.run.tokens == [c.token_id for c in streamed]


@given(fake_models_and_empty=st.integers(2, 64))
def test_an_empty_prompt_is_refused(fake_models_and_empty):

    backend = FakeBackend(FakeModel(vocab_size=fake_models_and_empty))
    with pytest.raises(ValueError, match="prompt_tokens is empty"):
        generate(backend, [], Options(max_tokens=4))
    with pytest.raises(ReferenceError):
        greedy_reference(backend.model.after, [], max_tokens=4)
    assert backend.passes == 0


def test_property_sanity_lookup_accepts_on_repetitive_model():
    """The suite must exercise acceptance, not only rejection: a repetitive model accepts most lookups."""

    model = FakeModel(vocab_size=8, seed=3, markov=6.0, noise=0.05)
    sc = Scenario(model, (1, 2, 3, 1, 2), Options(max_tokens=60), None, 4096, "free", 0)
    result = run(sc, PromptLookup(), 8).result
    assert result.stats.accepted_tokens > 30
    assert result.stats.steps < 30
    assert not math.isnan(result.stats.acceptance_rate)


@settings(max_examples=examples(180))
@given(width_policies(), st.lists(st.tuples(st.integers(0, 32), st.integers(0, 32)), max_size=40))
def test_width_policies_are_deterministic_and_in_range(policy, observations):
    """The same observations give the same widths, from an independent copy of the policy too; observing leaves
    the value it is called on unchanged; a width is never negative."""
    if isinstance(policy, int):
        return
    copy_of_start = copy.deepcopy(policy)
    assert copy_of_start is not policy and copy_of_start == policy

    def walk(start):
        widths, current = [], start
        for proposed, accepted in observations:
            widths.append(current.width())
            current = current.observe(proposed, min(accepted, proposed))
        return widths, current

    widths, end = walk(policy)
    assert all(w >= 0 for w in widths), widths
    assert policy == copy_of_start, "observe changed the policy it was called on"
    assert walk(copy_of_start) == (widths, end)
    assert walk(policy) == (widths, end)


@settings(max_examples=examples(240))
@given(scenarios(), st.sampled_from([1e-4, 1e-3, 1e-2, 0.1]), st.data())
def test_the_tie_guard_keeps_a_drifting_backend_exact(sc, drift, data):
    """On a backend whose multi-token verify rows are off by up to ``drift`` per logit (as batch-dependent kernels
    are), a tie guard wider than twice the drift keeps speculative output equal to greedy output: a pick whose
    margin exceeds 2 x drift is the exact row's argmax too, and narrower ones are re-decided by 1-token passes.
    (The tokens are exact; logprobs from drifted rows are off by up to the drift, so they are not asked for.)"""
    gap = data.draw(st.sampled_from([0.0, drift / 2, drift * 1.5, drift * 3]), label="near-tie gap")
    model = attrs.evolve(sc.model, tie_rate=0.5, near_tie_gap=gap)
    options = attrs.evolve(sc.options, tie_margin=2.2 * drift + 1e-5, top_logprobs=0)
    sc = attrs.evolve(sc, model=model, options=options)
    proposer = data.draw(proposers_for(model, sc.rules, len(sc.prompt)), label="proposer")
    picks = data.draw(st.booleans(), label="device picks")
    greedy = run(sc, drift=drift)  # plain steps are 1-token passes: exact
    assert_matches_reference(reference(sc), greedy)
    spec = run(sc, proposer, data.draw(width_policies(), label="width"), picks=picks, drift=drift)
    assert_same_output(spec, greedy)
    if spec.result.stats.tie_guard_stops:
        event("the tie guard stopped a block")
    unguarded = run(attrs.evolve(sc, options=attrs.evolve(sc.options, tie_margin=0.0)), proposer, 8, drift=drift)
    if unguarded.result.token_ids != greedy.result.token_ids:
        event("without the guard the drift changed the output")


@settings(max_examples=examples(150))
@given(scenarios(), st.data())
def test_prefix_reuse_changes_nothing(sc, data):
    """A generation that reuses the KV of the previous sequence on the same backend (``cached_prefix`` from its
    ``resident_tokens()``, after it finished, was abandoned part way, or failed) emits exactly what a fresh one
    does; ``resident_tokens()`` is always true of the backend."""
    from ortspec import Generation
    from ortspec.core.proposers import Proposer  # noqa: F401 - the protocol FaultyProposer follows

    backend = FakeBackend(sc.model, sc.capacity)
    how = data.draw(st.sampled_from(["finished", "abandoned", "failed"]), label="first sequence")
    proposer = FaultyProposer(sc.model, data.draw(st.integers(0, 3)), "raise") if how == "failed" else None
    oracle = OracleProposer(sc.model, sc.rules, len(sc.prompt))
    first = Generation(backend, sc.prompt, sc.options, proposer or oracle, draft_width=4,
                       detokenize=sc.detokenize)  # fmt: skip
    try:
        for i, _ in enumerate(first):
            if how == "abandoned" and i == data.draw(st.integers(0, 5), label="abandon at"):
                break
    except GenerationError:
        pass
    resident = first.resident_tokens()
    assert backend.resident_tokens()[: len(resident)] == resident
    # The next prompt shares a prefix of any length with what the backend holds.
    keep = data.draw(st.integers(0, len(resident)), label="shared prefix")
    tail = data.draw(st.lists(st.integers(0, sc.model.vocab_size - 1), min_size=0 if keep else 1, max_size=8))
    prompt2 = tuple(resident[:keep]) + tuple(tail)
    if len(prompt2) > min(sc.capacity, sc.options.max_context or sc.capacity):
        return
    cached = next((i for i, (a, b) in enumerate(zip(resident, prompt2, strict=False)) if a != b),
                  min(len(resident), len(prompt2)))  # fmt: skip
    second = Generation(backend, prompt2, sc.options, OracleProposer(sc.model, sc.rules, len(prompt2)), draft_width=4,
                        detokenize=sc.detokenize, cached_prefix=cached)  # fmt: skip
    got = second.run()
    want = generate(FakeBackend(sc.model, sc.capacity), prompt2, sc.options, detokenize=sc.detokenize)
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert got.cached_prompt_tokens == min(cached, len(prompt2) - 1)


class FakeSharedKvDrafter:
    """A proposer that reads the target through its backend, as a shared-KV draft head does (``HiddenStates``):
    at every call it checks the driver's promise (the context names the slot holding its state, ``OneSlot``'s 0; the
    KV holds every context token but the last; the last pass computed the position whose hidden state predicted the
    last token) and drafts from what it read: ``good`` drafts the true continuation, ``bad`` drafts ids made from the
    hidden state, ``adversarial`` drafts the resident tokens backwards (plausible-looking garbage), sometimes more
    than the width."""

    def __init__(self, backend: FakeBackend, oracle: OracleProposer, kind: str) -> None:
        self.backend, self.oracle, self.kind, self.calls = backend, oracle, kind, 0

    def propose(self, draft_context):
        context, width = draft_context.tokens, draft_context.width
        self.calls += 1
        assert draft_context.slot == 0
        kv = self.backend.current_len()
        assert kv == len(context) - 1
        hidden = self.backend.hidden_at(kv - 1)
        model = self.backend.model
        h = model.seed
        for t in context[:kv]:
            h = model.context_hash(h, int(t))
        assert np.array_equal(hidden, model.hidden(h, self.backend.hidden_size))
        if self.kind == "good":
            return self.oracle.continuation(context, width)
        if self.kind == "bad":
            return [int(i) % model.vocab_size for i in np.argsort(hidden)[:width]]
        return list(self.backend.resident_tokens()[::-1][: width + 2])


@settings(max_examples=examples(300))
@given(scenarios(), st.sampled_from(["good", "bad", "adversarial"]), st.data())
def test_a_drafter_that_reads_the_target_keeps_the_output_exact(sc, kind, data):
    """The proposer seam for drafters that read the target's hidden state and KV: whatever they draft, the output
    is plain decoding's, and the driver keeps its promise about the backend at every proposal."""
    backend = TracingBackend(sc.model, sc.capacity, picks_on_device=data.draw(st.booleans(), label="picks"))
    drafter = FakeSharedKvDrafter(backend, OracleProposer(sc.model, sc.rules, len(sc.prompt)), kind)
    width = data.draw(width_policies(), label="width")
    streamed = []
    spec = generate(backend, sc.prompt, sc.options, drafter, draft_width=width,
                    callback=lambda text, *_: streamed.append(text), detokenize=sc.detokenize)  # fmt: skip
    plain = run(sc)
    assert (spec.token_ids, spec.text, spec.finish_reason, spec.stop_matched) == (
        plain.result.token_ids, plain.result.text, plain.result.finish_reason, plain.result.stop_matched,
    )  # fmt: skip
    assert streamed == [c[2] for c in plain.stream]
    if drafter.calls:
        event(f"shared-kv drafter ({kind}) was asked")


@settings(max_examples=examples(180))
@given(scenarios(), st.sampled_from(["good", "bad", "adversarial"]), st.data())
def test_auto_lookup_or_drafter_keeps_the_output_exact(sc, kind, data):
    """``speculative="auto"``'s proposer (``LookupOrDraft``: prompt lookup or the drafter, whichever has earned more,
    otherwise, each source with its own learning width policy, priced or not, its lookup starved or not, so that a
    strong match learns in the drafter's shadow) drafts whatever its sources and policies say; the output is plain
    decoding's, and the drafter still finds the driver's promise kept."""
    backend = TracingBackend(sc.model, sc.capacity, picks_on_device=data.draw(st.booleans(), label="picks"))
    drafter = FakeSharedKvDrafter(backend, OracleProposer(sc.model, sc.rules, len(sc.prompt)), kind)
    ngram = data.draw(st.integers(1, 4), label="ngram")
    auto = LookupOrDraft(
        PromptLookup(ngram=ngram, max_draft=data.draw(st.integers(1, 16), label="max_draft")),
        drafter,
        strong_ngram=data.draw(st.integers(1, ngram + 1), label="strong_ngram"),
    )
    starved = None
    if data.draw(st.booleans(), label="priced"):
        costs = data.draw(st.lists(st.floats(0.5, 4.0), min_size=1, max_size=16), label="costs")
        lookup_policy = CostAwareWidth((1.0, *costs))
        drafter_policy = CostAwareWidth((1.0, *costs), draft_cost=data.draw(st.floats(0.0, 0.5), label="draft_cost"))
        if data.draw(st.booleans(), label="lookup starved"):  # the drafter wins every choice until lookup learns
            for _ in range(8):
                lookup_policy, drafter_policy = lookup_policy.observe(4, 0), drafter_policy.observe(4, 4)
            starved = lookup_policy
        auto = auto.priced(lookup_policy, drafter_policy)
    width = FixedWidth(data.draw(st.integers(1, 16), label="width"))
    generation = Generation(backend, sc.prompt, sc.options, auto, draft_width=width, detokenize=sc.detokenize)
    spec = generation.run()
    auto = generation.proposer
    plain = run(sc)
    assert (spec.token_ids, spec.text, spec.finish_reason, spec.stop_matched) == (
        plain.result.token_ids, plain.result.text, plain.result.finish_reason, plain.result.stop_matched,
    )  # fmt: skip
    if auto.lookup_drafts and auto.drafter_drafts:
        event("auto: both sources drafted")
    if starved is not None and not auto.lookup_drafts and auto.lookup_policy.trials != starved.trials:
        event("auto: a strong match learned only from the drafter's passes (its shadow)")
