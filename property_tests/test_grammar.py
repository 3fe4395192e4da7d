"""Structured outputs are exact under speculation: constrained speculative output == constrained plain output.

A scenario (``strategies.scenarios``: greedy, penalties, seeded sampling; every way of ending) gets a fake grammar
(``tests/support/grammars.py``: a small deterministic automaton over the fake vocabulary, with states that allow one
token, a few, most of the vocabulary or none, and accepting states) in its options. Then:

- constrained plain decoding is the reference decoder run on the model masked by the grammar (every token the
  grammar forbids after the generated tokens at -inf, EOS allowed only where the grammar accepts): the mask is part
  of the processed row, and nothing else changes, until the grammar is complete, where the generation ends;
- constrained speculative decoding, with any proposer (the unconstrained oracle, whose drafts the grammar mostly
  forbids; a constrained oracle, whose drafts are mostly right; noisy, adversarial, prompt lookup; the grammar's
  forced tokens in front of any of them) and any width policy, equals constrained plain decoding: tokens, text,
  finish reason, matched stop, logprobs and streamed deltas;
- the output obeys the grammar, ends with ``grammar_complete`` exactly when the grammar is complete there, and ends
  at an EOS only where the grammar accepts.
"""

from __future__ import annotations

import attrs
import numpy as np
from hypothesis import event, given, settings
from hypothesis import strategies as st

from ortspec import Generation
from ortspec.backends.fake import FakeBackend
from ortspec.core import DraftContext, FinishReason, FixedWidth
from ortspec.core.forced import ForcedTokens
from property_tests.conftest import examples
from property_tests.reference import greedy_reference
from property_tests.strategies import Scenario, fake_grammars, proposers_for, scenarios, width_policies
from tests.support.grammars import FakeGrammar


@attrs.frozen
class MaskedModel:
    """The model after a context, masked as constrained decoding masks it: the reference's ``ModelState``."""

    inner: object
    grammar: FakeGrammar
    eos: frozenset[int]
    state: int | None  # the grammar's state after the generated tokens (None: they broke it)

    def logits(self) -> np.ndarray:
        row = np.array(self.inner.logits(), copy=True)
        if self.state is None:
            return row
        allowed = np.zeros(row.shape[0], dtype=bool)
        for token, _ in self.grammar.transitions[self.state]:
            allowed[token] = True
        for token in self.eos:
            allowed[token] = self.state in self.grammar.accepting
        row[~allowed] = -np.inf
        return row

    def then(self, token: int) -> MaskedModel:
        state = None if self.state is None else self.grammar.step(self.state, token)
        return MaskedModel(self.inner.then(token), self.grammar, self.eos, state)


@attrs.frozen
class ConstrainedOracle:
    """Drafts the constrained plain output (known in advance), or nothing off its path."""

    prompt: tuple[int, ...]
    output: tuple[int, ...]

    def propose(self, draft_context: DraftContext) -> tuple[int, ...]:
        context, width = draft_context.tokens, draft_context.width
        done = tuple(context)[len(self.prompt) :]
        if tuple(context)[: len(self.prompt)] != self.prompt or self.output[: len(done)] != done:
            return ()
        return self.output[len(done) : len(done) + width]


def run(sc: Scenario, proposer=None, width=1):
    backend = FakeBackend(sc.model, sc.capacity)
    stream = []
    generation = Generation(backend, sc.prompt, sc.options, proposer, draft_width=width, detokenize=sc.detokenize)
    for c in generation:
        stream.append((c.token_id, c.text, c.logprob))
    return generation.result(), stream


def reference_tokens(sc: Scenario, grammar: FakeGrammar):
    o = sc.options
    return greedy_reference(
        lambda ctx: MaskedModel(sc.model.after(ctx), grammar, o.eos_token_ids, 0),
        sc.prompt, max_tokens=o.max_tokens, eos_token_ids=o.eos_token_ids,
        stop_token_sequences=o.stop_token_sequences, stop_strings=o.stop_strings, max_context=o.max_context,
        capacity=sc.capacity, top_logprobs=0, detokenize=sc.detokenize, rules=sc.rules,
    )  # fmt: skip


def check_constrained(sc: Scenario, data) -> None:
    grammar = data.draw(fake_grammars(sc.model.vocab_size, sc.options.eos_token_ids), label="grammar")
    sc = attrs.evolve(sc, options=attrs.evolve(sc.options, grammar=grammar))
    plain, plain_stream = run(sc)  # every row has a finite allowed token, or the grammar accepts (EOS or the end)

    # The output obeys the grammar; the grammar's ending rules.
    tokens = plain.token_ids
    body = tokens[:-1] if plain.finish_reason is FinishReason.EOS_TOKEN else tokens
    assert grammar.obeys(body)
    end_state = grammar.state_after(body)
    if plain.finish_reason is FinishReason.EOS_TOKEN:
        assert end_state in grammar.accepting
    complete = end_state in grammar.accepting and not grammar.transitions[end_state]
    assert (plain.finish_reason is FinishReason.GRAMMAR_COMPLETE) == (
        complete and plain.finish_reason not in (FinishReason.EOS_TOKEN, FinishReason.STOP_SEQUENCE)
    )

    # Constrained plain decoding is the reference decoder on the masked model (until the grammar completes).
    if complete and plain.finish_reason is not FinishReason.EOS_TOKEN:
        # The grammar ended the generation at its last token, as a limit does (a partial character is flushed and
        # a stop string it completes still ends it): the reference knows no grammar, so it decodes as many tokens.
        if tokens:
            shorter = attrs.evolve(sc, options=attrs.evolve(sc.options, max_tokens=len(tokens)))
            ref = reference_tokens(shorter, grammar)
            assert list(tokens) == ref.tokens
            if plain.finish_reason is not FinishReason.GRAMMAR_COMPLETE:
                assert plain.text == ref.text
                assert str(plain.finish_reason) == ref.finish_reason
    else:
        ref = reference_tokens(sc, grammar)
        assert list(tokens) == ref.tokens
        assert plain.text == ref.text
        assert str(plain.finish_reason) == ref.finish_reason

    # Speculative == plain, whatever the proposer drafts.
    kind = data.draw(st.sampled_from(["constrained oracle", "other", "forced + oracle", "forced + other"]))
    inner = ConstrainedOracle(sc.prompt, tokens) if "oracle" in kind else None
    if inner is None:
        inner = data.draw(proposers_for(sc.model, sc.rules, len(sc.prompt)), label="proposer")
    proposer = ForcedTokens(grammar, len(sc.prompt), inner) if kind.startswith("forced") else inner
    width = data.draw(width_policies(), label="width")
    spec, spec_stream = run(sc, proposer, FixedWidth(width) if isinstance(width, int) else width)
    assert spec.token_ids == plain.token_ids
    assert spec.text == plain.text
    assert spec.finish_reason == plain.finish_reason
    assert spec.stop_matched == plain.stop_matched
    assert spec.logprobs == plain.logprobs
    assert spec_stream == plain_stream
    assert spec.stats.steps <= plain.stats.steps + spec.stats.tie_guard_stops
    event(f"constrained: {plain.finish_reason}")
    if spec.stats.multi_token_accepts:
        event("constrained: accepted several draft tokens in one pass")


@settings(max_examples=examples(100))
@given(scenarios(mode="greedy"), st.data())
def test_constrained_greedy_speculative_equals_constrained_plain(sc, data):
    check_constrained(sc, data)


@settings(max_examples=examples(100))
@given(scenarios(mode="sampling"), st.data())
def test_constrained_sampling_speculative_equals_constrained_plain(sc, data):
    check_constrained(sc, data)
