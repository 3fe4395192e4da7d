"""Stateful test of the backend protocol: any sequence of decode / verify / rewind / reset calls on
``FakeBackend`` behaves like a trivially correct reference (a list of tokens and the model's full-context
logits), and every call that breaks the contract raises without changing the cache."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ortspec.backends.base import BackendError
from ortspec.backends.fake import FakeBackend, FakeModel
from property_tests.conftest import examples

VOCAB = 12
CAPACITY = 24
MODEL = FakeModel(vocab_size=VOCAB, seed=7, markov=1.0, noise=1.0, tie_rate=0.2)
tokens_st = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)


class BackendProtocol(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.backend = FakeBackend(MODEL, max_length=CAPACITY)
        self.reference: list[int] = []

    def expected_rows(self, tokens):
        context = list(self.reference)
        rows = []
        for t in tokens:
            context.append(t)
            rows.append(MODEL.logits_for(context))
        return np.stack(rows)

    @rule(tokens=tokens_st)
    def decode(self, tokens):
        if len(self.reference) + len(tokens) > CAPACITY:
            with pytest.raises(BackendError):
                self.backend.decode(tokens, len(self.reference))
            return
        expected = self.expected_rows(tokens)[-1]
        got = self.backend.decode(tokens, len(self.reference))
        np.testing.assert_array_equal(got, expected)
        self.reference.extend(tokens)

    @rule(tokens=tokens_st)
    def verify(self, tokens):
        if len(self.reference) + len(tokens) > CAPACITY:
            with pytest.raises(BackendError):
                self.backend.decode_verify(tokens, len(self.reference))
            return
        expected = self.expected_rows(tokens)
        got = self.backend.decode_verify(tokens, len(self.reference))
        np.testing.assert_array_equal(got, expected)
        self.reference.extend(tokens)

    @rule(data=st.data())
    def rewind(self, data):
        length = data.draw(st.integers(0, len(self.reference)))
        self.backend.rewind(length)
        del self.reference[length:]

    @rule()
    def reset(self):
        self.backend.reset()
        self.reference.clear()

    @rule(offset=st.sampled_from([-2, -1, 1, 3]), tokens=tokens_st)
    def wrong_position(self, offset, tokens):
        with pytest.raises(BackendError):
            self.backend.decode(tokens, len(self.reference) + offset)

    @rule(bad=st.sampled_from([-1, VOCAB, VOCAB + 100]))
    def bad_token(self, bad):
        with pytest.raises(BackendError):
            self.backend.decode_verify([0, bad], len(self.reference))

    @rule(extra=st.integers(1, 3))
    def bad_rewind(self, extra):
        with pytest.raises(BackendError):
            self.backend.rewind(len(self.reference) + extra)

    @rule()
    def empty_pass(self):
        with pytest.raises(BackendError):
            self.backend.decode([], len(self.reference))

    @precondition(lambda self: len(self.reference) == CAPACITY)
    @rule(tokens=tokens_st)
    def pass_beyond_a_full_cache(self, tokens):
        """At capacity every pass is refused, and the cache stays as it is (the invariant)."""
        with pytest.raises(BackendError):
            self.backend.decode_verify(tokens, CAPACITY)

    @invariant()
    def same_length(self):
        assert self.backend.current_len() == len(self.reference)
        assert list(self.backend.resident_tokens()) == self.reference


BackendProtocol.TestCase.settings = settings(max_examples=examples(300), stateful_step_count=30, deadline=None)
TestBackendProtocol = BackendProtocol.TestCase
