"""A fake grammar for the core's constraint protocol (``ortspec.core.constraint``): a small deterministic automaton
over token ids, so the properties and unit tests can constrain the fake backend without a grammar engine."""

from __future__ import annotations

import attrs
import numpy as np


@attrs.frozen
class FakeGrammar:
    """A deterministic automaton: state 0 is the start; ``transitions[s]`` holds ``(token, next state)`` pairs (one
    per token); a match is complete in the ``accepting`` states. A state with no transition must be accepting."""

    vocab_size: int
    transitions: tuple[tuple[tuple[int, int], ...], ...]
    accepting: frozenset[int]

    def __attrs_post_init__(self) -> None:
        for s, edges in enumerate(self.transitions):
            if not edges and s not in self.accepting:
                raise ValueError(f"state {s} has no transition and is not accepting (a dead end)")
            if len({t for t, _ in edges}) != len(edges):
                raise ValueError(f"state {s} has two transitions on one token")

    def matcher(self) -> FakeMatcher:
        return FakeMatcher(self)

    def step(self, state: int, token: int) -> int | None:
        """The state after ``token`` from ``state``; None where the grammar forbids it."""
        return dict(self.transitions[state]).get(token)

    def obeys(self, tokens: tuple[int, ...] | list[int]) -> bool:
        """True when every token is allowed after those before it."""
        state: int | None = 0
        for token in tokens:
            state = self.step(state, token)
            if state is None:
                return False
        return True

    def state_after(self, tokens: tuple[int, ...] | list[int]) -> int:
        state = 0
        for token in tokens:
            nxt = self.step(state, token)
            assert nxt is not None, f"token {token} is forbidden in state {state}"
            state = nxt
        return state


class FakeMatcher:
    """``ortspec.core.constraint.Matcher`` over a ``FakeGrammar``; counts its masks (``masks``) and consumed tokens."""

    def __init__(self, grammar: FakeGrammar) -> None:
        self.grammar = grammar
        self.states = [0]
        self.masks = 0
        self.consumed = 0

    def allowed(self) -> np.ndarray:
        self.masks += 1
        mask = np.zeros(self.grammar.vocab_size, dtype=bool)
        for token, _ in self.grammar.transitions[self.states[-1]]:
            mask[token] = True
        return mask

    def consume(self, token: int) -> None:
        nxt = self.grammar.step(self.states[-1], token)
        if nxt is None:
            raise ValueError(f"the grammar forbids token {token} in state {self.states[-1]}")
        self.states.append(nxt)
        self.consumed += 1

    def rollback(self, count: int) -> None:
        if count > len(self.states) - 1:
            raise ValueError(f"cannot roll back {count} tokens: {len(self.states) - 1} were consumed")
        del self.states[len(self.states) - count :]

    def accepting(self) -> bool:
        return self.states[-1] in self.grammar.accepting

    def complete(self) -> bool:
        return self.accepting() and not self.grammar.transitions[self.states[-1]]

    def forced(self) -> tuple[int, ...]:
        out: list[int] = []
        state = self.states[-1]
        while len(out) < 32 and state not in self.grammar.accepting and len(self.grammar.transitions[state]) == 1:
            token, state = self.grammar.transitions[state][0]
            out.append(token)
        return tuple(out)
