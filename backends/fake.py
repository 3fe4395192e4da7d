"""A deterministic fake target model and a backend that checks the protocol on every call.

``FakeModel`` maps a whole context (every token so far) to next-token logits, in pure numpy. Its logits mix a
Markov part (the preferred successor of the last token, so that text repeats and prompt lookup finds matches)
with a part keyed on a hash of the entire context, so that a KV cache holding one wrong or missing position
changes the logits and, usually, the output. It can plant exact ties and near ties between the top two ids, and
an EOS token that wins now and then.

``FakeBackend`` is the imperative side: it keeps the resident tokens (its "KV cache"), enforces the protocol of
``backends.base`` and counts passes. ``FakeBatchBackend`` is the batched protocol (``BatchBackend``) over the same
model: one ``FakeBackend`` per slot, so each row's logits are exactly that sequence's alone.

Token trees (``TreeRows``). A KV entry is modelled as the token and the rolling hash of the context it was computed
in. In a tree pass each row's context is read off the attention rule (``core.tree.tree_mask``) and the positions
(``position + 1 + depth``): the tokens it sees, in position order. A row that sees two tokens at one position, or
misses one, is computed in a context no plain decoding has (its hash takes a marker no token has), so a wrong mask,
a wrong position or a KV entry kept at the wrong place changes the logits of that row and of every row after it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import attrs
import numpy as np

from ortspec.core.tree import tree_mask

from .base import (
    BackendError,
    BatchRow,
    argmax_margin,
    check_batch,
    check_kept_path,
    check_position,
    check_slot,
    check_tokens,
    check_tree_row,
)

_HASH_MUL = 0x100000001B3
_HASH_MASK = (1 << 64) - 1
_TABLE_FLOATS = 1 << 18  # the whole-context part draws from a table of this many floats (1 MiB) ...
_MAX_TABLE_ROWS = 4096  # ... in at most this many rows: 4096 rows up to a vocabulary of 64, fewer beyond


def _table_rows(vocab_size: int) -> int:
    return max(64, min(_MAX_TABLE_ROWS, _TABLE_FLOATS // vocab_size))


@functools.lru_cache(maxsize=32)
def _weights(seed: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The successor table ``[vocab]`` and the whole-context table ``[rows, vocab]`` float32 of a model, read-only
    (shared by every ``FakeModel`` with this seed and vocabulary: property tests build thousands)."""
    rng = np.random.default_rng(seed)
    successor = rng.integers(0, vocab_size, size=vocab_size)
    table = rng.standard_normal((_table_rows(vocab_size), vocab_size)).astype(np.float32)
    successor.setflags(write=False)
    table.setflags(write=False)
    return successor, table


@attrs.frozen
class FakeModel:
    """A deterministic stand-in for a language model.

    ``markov``: weight of the last-token successor table (high: repetitive text); ``noise``: weight of the
    whole-context part; ``tie_rate``: fraction of positions whose top two logits are made to tie exactly (even
    hashes) or nearly (odd hashes, gap ``near_tie_gap``); ``eos_id``/``eos_rate``: an EOS token and the fraction of
    positions where it wins; ``nonfinite_rate``: fraction of positions whose row is not finite where the pick is
    made (a NaN somewhere, +inf at the top, or every logit -inf), which every decoder must refuse.
    """

    vocab_size: int = 32
    seed: int = 0
    markov: float = 2.0
    noise: float = 1.0
    tie_rate: float = 0.0
    near_tie_gap: float = 1e-4
    eos_id: int | None = None
    eos_rate: float = 0.0
    nonfinite_rate: float = 0.0
    _successor: np.ndarray = attrs.field(init=False, eq=False, repr=False)
    _table: np.ndarray = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {self.vocab_size}")
        if self.eos_id is not None and not 0 <= self.eos_id < self.vocab_size:
            raise ValueError(f"eos_id {self.eos_id} is outside the vocabulary")
        successor, table = _weights(self.seed, self.vocab_size)
        object.__setattr__(self, "_successor", successor)
        object.__setattr__(self, "_table", table)

    def context_hash(self, previous_hash: int, token: int) -> int:
        """The rolling hash of a context extended by ``token`` (the empty context hashes to ``seed``)."""
        return ((previous_hash ^ (token + 1)) * _HASH_MUL) & _HASH_MASK

    def context_hashes(self, tokens: Sequence[int]) -> tuple[int, ...]:
        """Per position of ``tokens``, the hash of the context a plain decoder computes that KV entry in."""
        out, h = [], self.seed
        for t in tokens:
            h = self.context_hash(h, int(t))
            out.append(h)
        return tuple(out)

    def logits_after(self, last_token: int, context_hash: int) -> np.ndarray:
        """Next-token logits ``[vocab]`` float32 for a context ending in ``last_token`` with ``context_hash``."""
        row = self._table[context_hash % self._table.shape[0]] * np.float32(self.noise)
        row[self._successor[last_token]] += np.float32(self.markov)
        selector = (context_hash >> 20) % 100_000 / 100_000.0
        if self.eos_id is not None and selector < self.eos_rate:
            row[self.eos_id] = row.max() + 1.0
        elif selector >= 1.0 - self.tie_rate:
            order = np.argsort(-row, kind="stable")
            best, second = order[0], order[1]
            gap = 0.0 if (context_hash >> 40) % 2 == 0 else self.near_tie_gap
            row[second] = row[best] - np.float32(gap)
        if (context_hash >> 44) % 100_000 / 100_000.0 < self.nonfinite_rate:
            kind = (context_hash >> 8) % 3
            if kind == 0:
                row[(context_hash >> 12) % self.vocab_size] = np.nan
            elif kind == 1:
                row[int(np.argmax(row))] = np.inf
            else:
                row[:] = -np.inf
        return row

    def after(self, context: Sequence[int]) -> FakeContext:
        """The model after ``context`` (O(len(context)) once; extend it with ``FakeContext.then``, O(1))."""
        state = FakeContext(self, self.seed, -1, 0)
        for t in context:
            state = state.then(int(t))
        return state

    def logits_for(self, context: Sequence[int]) -> np.ndarray:
        """Next-token logits after the whole non-empty ``context`` (O(len(context)))."""
        return self.after(context).logits()

    def hidden(self, context_hash: int, size: int) -> np.ndarray:
        """A stand-in final hidden state, ``[size]`` float32: the first ``size`` logits of the context's
        whole-context part (a deterministic function of the context, like a real hidden state)."""
        return self._table[context_hash % self._table.shape[0], :size] * np.float32(self.noise)

    def greedy(self, prompt: Sequence[int], n: int) -> list[int]:
        """The first ``n`` greedy tokens after ``prompt`` (no stop rules): an oracle for tests."""
        state = self.after(prompt)
        out = []
        for _ in range(n):
            t = int(np.argmax(state.logits()))
            out.append(t)
            state = state.then(t)
        return out


@attrs.frozen
class FakeContext:
    """A ``FakeModel`` after a context, carried token by token: ``then(token)`` is O(1), and ``logits()`` is
    exactly ``model.logits_for(context)`` (a pure function of the context, however it was reached)."""

    model: FakeModel
    context_hash: int  # the rolling hash of the context (``FakeModel.context_hash``)
    last_token: int  # -1 for the empty context
    length: int

    def then(self, token: int) -> FakeContext:
        """The context one ``token`` longer (this value is unchanged)."""
        return FakeContext(self.model, self.model.context_hash(self.context_hash, token), token, self.length + 1)

    def logits(self) -> np.ndarray:
        """Next-token logits ``[vocab]`` float32, a fresh array the caller owns; the context must not be empty."""
        if self.length == 0:
            raise ValueError("the empty context has no next-token logits")
        return self.model.logits_after(self.last_token, self.context_hash)


class FakeBackend:
    """A ``Backend`` over a ``FakeModel``: resident tokens stand in for the KV cache."""

    def __init__(
        self,
        model: FakeModel,
        max_length: int = 4096,
        *,
        picks_on_device: bool = False,
        verify_drift: float = 0.0,
        tree_rows: bool = True,
    ) -> None:
        """``picks_on_device``: act like a device backend, so the driver asks ``verify_picks`` for picks.
        ``verify_drift``: every row of a ``decode_verify`` / ``verify_picks`` / ``verify_tree`` pass over more than
        one token is off by up to this much per logit (deterministic noise), as batch-dependent kernels are; the
        prompt pass and 1-token passes stay exact. ``tree_rows``: offer ``TreeRows`` (False: act like a backend
        that runs chains only)."""
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        if not verify_drift >= 0:
            raise ValueError(f"verify_drift must be >= 0, got {verify_drift}")
        self.model = model
        self.picks_on_device = picks_on_device
        self.tree_rows = tree_rows
        self.verify_drift = float(verify_drift)
        self.hidden_size = min(16, model.vocab_size)  # the HiddenStates capability
        self._last_pass = (0, 0)  # positions [start, end) computed by the last pass
        self._max_length = max_length
        self._tokens: list[int] = []
        self._hashes: list[int] = [model.seed]  # _hashes[i]: hash of the first i resident tokens
        self.passes = 0
        self.tokens_processed = 0
        self.peak_len = 0  # the most KV positions ever resident (tests check that no pass overshoots a limit)

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def max_length(self) -> int:
        return self._max_length

    def reset(self) -> None:
        self._tokens.clear()
        del self._hashes[1:]
        self.peak_len = 0

    def current_len(self) -> int:
        return len(self._tokens)

    def resident_tokens(self) -> tuple[int, ...]:
        return tuple(self._tokens)

    def resident_hashes(self) -> tuple[int, ...]:
        """Per resident position, the hash of the context its KV entry was computed in (``FakeModel.context_hash``
        of every token up to it): ``model.after(resident_tokens()[: p + 1]).context_hash`` at position ``p`` when
        the cache is what plain decoding writes."""
        return tuple(self._hashes[1:])

    def _run(self, tokens: Sequence[int], position: int, what: str) -> np.ndarray:
        check_tokens(tokens, self.vocab_size, "tokens")
        check_position(position, len(self._tokens), len(tokens), self._max_length, what)
        rows = np.empty((len(tokens), self.vocab_size), dtype=np.float32)
        for i, t in enumerate(tokens):
            t = int(t)
            h = self.model.context_hash(self._hashes[-1], t)
            self._tokens.append(t)
            self._hashes.append(h)
            rows[i] = self.model.logits_after(t, h)
        self.passes += 1
        self.tokens_processed += len(tokens)
        self.peak_len = max(self.peak_len, len(self._tokens))
        self._last_pass = (position, position + len(tokens))
        return rows

    def hidden_at(self, position: int) -> np.ndarray:
        """The stand-in hidden state at ``position``, which the last pass must have computed (``HiddenStates``)."""
        start, end = self._last_pass
        if not start <= position < min(end, len(self._tokens)):
            raise BackendError(f"hidden_at({position}): the last pass computed positions [{start}, {end})")
        return self.model.hidden(self._hashes[position + 1], self.hidden_size)

    def decode(self, tokens: Sequence[int], past: int) -> np.ndarray:
        return self._run(tokens, past, "past")[-1]

    def decode_verify(self, tokens: Sequence[int], base: int) -> np.ndarray:
        return self._verify_rows(tokens, base)

    def verify_picks(self, tokens: Sequence[int], base: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``DevicePicks`` capability on the host: ``decode_verify`` reduced to picks and margins."""
        return argmax_margin(self._verify_rows(tokens, base))

    def _verify_rows(self, tokens: Sequence[int], base: int) -> np.ndarray:
        rows = self._run(tokens, base, "base")
        self._drift(rows, base)
        return rows

    def _drift(self, rows: np.ndarray, base: int) -> None:
        """``verify_drift``'s noise on the rows of a multi-token pass at ``base``, in place."""
        if self.verify_drift and len(rows) > 1:
            for i, row in enumerate(rows):
                noise = np.random.default_rng(self._hashes[base + i + 1]).uniform(-1.0, 1.0, row.shape[0])
                row += (noise * self.verify_drift).astype(np.float32)

    def verify_tree(self, tokens: Sequence[int], parents: Sequence[int], base: int) -> np.ndarray:
        """``TreeRows``: a pass over ``(pending, *nodes)``; each row is computed in the context the attention rule
        and the positions give it (module docstring), and its KV entry is appended as computed."""
        if not self.tree_rows:
            raise BackendError("this FakeBackend runs no tree rows (tree_rows=False)")
        check_tokens(tokens, self.vocab_size, "tokens")
        check_position(base, len(self._tokens), len(tokens), self._max_length, "base")
        check_tree_row(tokens, parents, "verify_tree")
        model, ids = self.model, [int(t) for t in tokens]
        mask = tree_mask(parents)
        depth = [0]  # per row: 0 for the pending token, node j's depth + 1 for row j + 1
        for p in parents:
            depth.append(depth[p + 1] + 1)
        rows = np.empty((len(ids), self.vocab_size), dtype=np.float32)
        context_hash = self._hashes[-1]  # the first `base` positions, which every row sees
        for a in range(len(ids)):
            seen = sorted((base + depth[b], b) for b in np.flatnonzero(mask[a]))  # (position, row), in position order
            h, expected = context_hash, base
            for position, b in seen:
                if position != expected:  # a position seen twice or skipped: no plain context is like it
                    h = model.context_hash(h, self.vocab_size + abs(position - expected))
                h, expected = model.context_hash(h, ids[b]), position + 1
            rows[a] = model.logits_after(ids[seen[-1][1]], h)
            self._tokens.append(ids[a])
            self._hashes.append(h)
        self.passes += 1
        self.tokens_processed += len(ids)
        self.peak_len = max(self.peak_len, len(self._tokens))
        self._last_pass = (base, base + len(ids))
        self._drift(rows, base)
        return rows

    def keep_path(self, start: int, nodes: Sequence[int]) -> None:
        """``TreeRows``: node ``nodes[d]``'s KV entry (token and context hash) moves from ``start + 1 + nodes[d]``
        to ``start + 1 + d``."""
        check_kept_path(start, nodes, len(self._tokens))
        for d, node in enumerate(nodes):
            self._tokens[start + 1 + d] = self._tokens[start + 1 + node]
            self._hashes[start + 2 + d] = self._hashes[start + 2 + node]

    def rewind(self, length: int) -> None:
        if (
            isinstance(length, bool)
            or not isinstance(length, (int, np.integer))
            or not 0 <= length <= len(self._tokens)
        ):
            raise BackendError(f"rewind({length}) outside [0, {len(self._tokens)}]")
        del self._tokens[length:]
        del self._hashes[length + 1 :]


class FakeBatchBackend:
    """A ``BatchBackend`` over a ``FakeModel``: ``slots`` sequences, each a ``FakeBackend`` of ``max_length``
    positions, so a row's logits are exactly what a ``FakeBackend`` gives that sequence alone (the model is a pure
    function of the context). ``passes`` counts batched passes and ``rows_per_pass[i]`` the rows of pass ``i + 1``;
    ``tokens_per_pass[i]`` its tokens. ``ragged_rows``: what the backend says of its passes (a draft row runs beside
    the others, ``batches_drafts``), which changes only how a driver prices drafts: every pass is one pass here."""

    def __init__(
        self, model: FakeModel, slots: int, max_length: int = 4096, *, tree_rows: bool = True, ragged_rows: bool = False
    ) -> None:
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an int >= 1, got {slots!r}")
        self.model = model
        self.tree_rows = tree_rows  # BatchRow.parents rows run (False: a backend that runs chains only)
        self.ragged_rows = ragged_rows
        self._slots = [FakeBackend(model, max_length, tree_rows=tree_rows) for _ in range(slots)]
        self._max_length = max_length
        self.rows_per_pass: list[int] = []
        self.tokens_per_pass: list[int] = []

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def slots(self) -> int:
        return len(self._slots)

    @property
    def passes(self) -> int:
        return len(self.rows_per_pass)

    def slot_backend(self, slot: int) -> FakeBackend:
        """The ``FakeBackend`` that holds ``slot`` (for tests: its ``peak_len``, its resident tokens)."""
        check_slot(slot, len(self._slots))
        return self._slots[slot]

    def reset(self, slot: int) -> None:
        self.slot_backend(slot).reset()

    def current_len(self, slot: int) -> int:
        return self.slot_backend(slot).current_len()

    def run_pass(self, rows: Sequence[BatchRow]) -> list[np.ndarray]:
        check_batch(rows, self)
        out = [self._row(row)[-row.logits_rows :] for row in rows]
        self.rows_per_pass.append(len(rows))
        self.tokens_per_pass.append(sum(len(row.tokens) for row in rows))
        return out

    def _row(self, row: BatchRow) -> np.ndarray:
        backend = self._slots[row.slot]
        if row.parents is not None:
            return backend.verify_tree(row.tokens, row.parents, row.position)
        return backend.decode_verify(row.tokens, row.position)

    def rewind(self, slot: int, length: int) -> None:
        self.slot_backend(slot).rewind(length)

    def keep_path(self, slot: int, start: int, nodes: Sequence[int]) -> None:
        """``BatchTreeRows``: ``FakeBackend.keep_path`` in ``slot``."""
        self.slot_backend(slot).keep_path(start, nodes)
