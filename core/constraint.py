"""Structured outputs: a grammar's mask in every pick, exact under speculation, for ``core.state``.

A constrained generation carries a ``Grammar`` in its ``Options`` (a compiled constraint, shareable: a JSON schema,
a regular expression, a Lark grammar). ``DecodeState.start`` opens one ``Matcher`` for the generation (the grammar
engine's cursor over token sequences, behind the protocol below, so a test's fake grammar and the real engine's
adapter in ``adapters/`` are interchangeable) and wraps it in a ``Constraint``.

The rules (``core/state.py`` calls them; nothing else does):

1. **The mask is part of the processed row.** The row that picks the token after ``generated + draft[:i]`` (verify
   row ``i``; row 0 is the base row) has every token the grammar forbids after that prefix set to ``-inf`` before
   the pick (``core/sampling.py``: after the processors, before greedy or seeded sampling). So the pick from a
   verify row is exactly the pick plain constrained decoding makes at that position, and a draft token the
   grammar forbids is never accepted (no allowed pick equals it).
2. **EOS only where the grammar accepts.** The EOS ids (``Options.eos_token_ids``) are allowed exactly where the
   tokens so far form a complete match (``Matcher.accepting``); the matcher's own mask never decides them.
3. **A complete grammar ends the generation.** Once the committed tokens are a complete match that no token can
   extend (``Matcher.complete``), the generation ends there (``FinishReason.GRAMMAR_COMPLETE``, the OpenAI API's
   "stop"), with no further pass.

Exactness under speculation is a matter of positions: a ``Constraint`` is a value over one mutable matcher that it
moves to whatever token sequence it is asked about (rolling back what the two sequences do not share, consuming the
rest), so the mask for a row depends only on the tokens before that row. A step moves it along the draft as its rows
are picked (each picked draft token is allowed, so the grammar consumes it); the next step's question is asked after
the committed tokens, and the rejected draft tokens are rolled back then. Consuming a committed token is O(1) work
per token; a step costs one mask per row it picks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Matcher(Protocol):
    """One generation's position in a grammar (mutable; owned by one ``Constraint``). Token ids are the model's."""

    def allowed(self) -> np.ndarray:
        """``[vocab]`` bool, a new array the caller owns: True for each token the grammar allows next, never the
        grammar engine's own end-of-sequence token (the core allows ``Options.eos_token_ids`` by rule 2)."""
        ...

    def consume(self, token: int) -> None:
        """Advance past ``token``; ``ValueError`` if the grammar forbids it here."""
        ...

    def rollback(self, count: int) -> None:
        """Undo the last ``count`` consumed tokens (at most as many as were consumed)."""
        ...

    def accepting(self) -> bool:
        """True when the tokens consumed so far form a complete match (EOS may follow)."""
        ...

    def complete(self) -> bool:
        """True when the tokens consumed so far form a complete match that no token can extend."""
        ...

    def forced(self) -> tuple[int, ...]:
        """Tokens that are the grammar's only continuation from here, in order (empty when there is a choice)."""
        ...


@runtime_checkable
class Grammar(Protocol):
    """A compiled constraint: a value shared by any number of generations, each with its own ``Matcher``."""

    def matcher(self) -> Matcher:
        """A new matcher at the start of the grammar."""
        ...


class Constraint:
    """One generation's grammar, asked about token sequences: the ``Matcher`` moved to each sequence asked about.

    Every question names a sequence of generated tokens (a ``base``, then a few ``extra`` tokens, e.g. a draft
    prefix); the answer depends on that sequence only, whatever was asked before. The base's storage
    (``core.tokens.Shared``) tells how much of it the matcher already holds, so following one generation costs
    O(new tokens) per question."""

    def __init__(self, matcher: Matcher) -> None:
        self._matcher = matcher
        self._path: list[int] = []  # the tokens the matcher has consumed
        self._storage: object = None  # the base storage the path was last moved along ...
        self._from_storage = 0  # ... and how many leading path tokens are known to equal its items

    def allowed(self, base: Sequence[int], extra: Sequence[int], eos_token_ids: Iterable[int]) -> np.ndarray:
        """``[vocab]`` bool: the tokens allowed after ``base + extra`` (rules 1 and 2). A row after an EOS among
        ``extra`` (a draft that ran on past an EOS) is never committed: it allows every token."""
        eos_ids = frozenset(eos_token_ids)
        if any(t in eos_ids for t in extra):
            mask = self._matcher.allowed()
            mask[:] = True
            return mask
        self._move_to(base, 0, extra)
        mask = self._matcher.allowed()
        eos = [t for t in eos_ids if t < mask.shape[0]]
        if eos:
            mask[eos] = self._matcher.accepting()
        return mask

    def complete(self, base: Sequence[int]) -> bool:
        """True when ``base`` is a complete match that no token can extend (rule 3)."""
        self._move_to(base, 0, ())
        return self._matcher.complete()

    def forced(self, context: Sequence[int], offset: int) -> tuple[int, ...]:
        """The tokens the grammar forces after ``context[offset:]`` (its only continuation), in order."""
        self._move_to(context, offset, ())
        return self._matcher.forced()

    def _move_to(self, base: Sequence[int], offset: int, extra: Sequence[int]) -> None:
        """Move the matcher to ``base[offset:] + extra``."""
        parts = getattr(base, "parts", None)
        head, items, n = parts() if parts is not None else ((), None, 0)
        path = self._path
        own = len(base) - offset  # the tokens of base that count
        target_len = own + len(extra)

        def target(i: int) -> int:
            return int(base[offset + i]) if i < own else int(extra[i - own])

        # How many leading tokens the path shares with the target: free up to what is known of the same storage
        # (``base[offset:]`` is the storage's items when the head is exactly the offset).
        storage = items if items is not None and len(head) == offset else None
        same = min(self._from_storage, n, len(path)) if storage is not None and storage is self._storage else 0
        limit = min(len(path), target_len)
        while same < limit and path[same] == target(same):
            same += 1
        self._storage, self._from_storage = None, 0  # until the move succeeds
        if len(path) > same:
            self._matcher.rollback(len(path) - same)
            del path[same:]
        for i in range(same, target_len):
            token = target(i)
            self._matcher.consume(token)
            path.append(token)
        self._storage, self._from_storage = (storage, n) if storage is not None else (None, 0)


def masked(z: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """``z`` (a processed row) with every token ``allowed`` does not allow at ``-inf`` (rule 1): a new array of
    ``z``'s dtype."""
    if allowed.shape != z.shape:
        raise ValueError(f"the grammar's mask has shape {allowed.shape} but the logits row has {z.shape}")
    return np.where(allowed, z, -np.inf)
