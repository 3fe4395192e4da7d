"""The backend protocol: the imperative device work that the driver asks for.

A backend owns one KV cache for one sequence. Its length, ``current_len()``, counts the token positions whose
keys and values are resident. The driver keeps it exactly one token behind the committed tokens (the last
committed token is "pending": it is fed at the start of the next pass), so the protocol needs only three moves:

* ``decode(tokens, past)``: fold ``tokens`` into the KV at position ``past`` (which must equal ``current_len()``)
  and return the next-token logits after the last of them, shape ``[vocab]``. Used for prefill and plain steps.
* ``decode_verify(tokens, base)``: one pass over ``tokens`` at ``base == current_len()``; the KV length becomes
  ``base + len(tokens)``; returns one row of logits per token, shape ``[len(tokens), vocab]``, row ``i`` being
  the target's next-token logits after ``tokens[i]``.
* ``rewind(length)``: forget every position at or past ``length`` (``0 <= length <= current_len()``).

Arrays returned by ``decode`` and ``decode_verify`` are float32 host arrays that the backend may reuse: they are
valid until the next call on the same backend. A contract violation (wrong position, id outside the vocabulary,
too long for the cache) raises ``BackendError`` before any state changes; it never corrupts the cache.

One optional capability, ``DevicePicks``: a backend whose logits live on a device (CUDA) offers
``verify_picks(tokens, base) -> (picks, margins)``, the same pass as ``decode_verify`` reduced where the logits
live to each row's argmax id (lowest id on ties, int64 ``[len(tokens)]``) and the gap between the row's two largest
logits (float32 ``[len(tokens)]``; NaN for a row that is not finite where its pick is made). It copies
``2 * len(tokens)`` numbers to the host instead of ``len(tokens) * vocab``. The driver asks for picks, and feeds the
core's ``step_from_picks``, only when ``uses_device_picks(backend)`` (and no logprobs are wanted).
``argmax_margin`` is the reduction on the host, the reference every device kernel must equal.

A second optional capability, ``HiddenStates``, is for proposers that read the target itself (a shared-KV draft
head): ``hidden_at(position)`` is the target's final hidden state (after the last norm, the LM head's input) at a
position of the last pass. Such a proposer is given the backend when it is made; the driver guarantees that
whenever it asks for a draft, the backend holds the KV of every context token but the last (``current_len() ==
len(context) - 1``) and its last pass computed position ``current_len() - 1``, whose hidden state predicted the
last context token. The core never sees any of it: it sees only draft tokens.

A third optional capability, ``TreeRows``, verifies a token tree (``core.tree.DraftTree``) in one pass: a backend
with ``tree_rows`` True offers ``verify_tree(tokens, parents, base)``, a pass over ``tokens = (pending, *nodes)``
whose node ``j`` (``parents[j]``: -1 for the pending token, else an earlier node) is written at KV position
``base + 1 + j``, computed at position ``base + 1 + depth(j)`` and attending to the first ``base`` positions and to
the rows ``core.tree.tree_mask(parents)`` names (itself and its ancestors) only, so its logits row is plain
decoding's after that node's path; and ``keep_path(start, nodes)``, which moves the accepted path's KV where plain
decoding has it (position ``start + 1 + nodes[d]`` to ``start + 1 + d``), after which the driver rewinds as after a
chain. The driver sends a tree only to a backend with ``tree_rows`` True (elsewhere it verifies the tree's first
branch, a chain).

The batched protocol, ``BatchBackend``, is a separate one for continuous batching: a fixed number of *slots*, each
one sequence's KV cache with its own length, and one pass, ``run_pass(rows)``, that carries a ragged batch of
``BatchRow(slot, tokens, position)`` (at most one row per slot, ``position == current_len(slot)``). Each row's
answer is what ``decode_verify(tokens, position)`` would return for that slot's sequence alone; ``rewind`` and
``reset`` act on one slot. ``check_batch`` is the one check of a pass, done before any slot changes. A row may ask
for the hidden states of its positions too (``BatchRow.hidden_states``): the per-slot form of ``HiddenStates``,
for a drafter bound to one slot (``backends/onnx/slot_drafters.py``). A row may be a token tree
(``BatchRow.parents``), for a backend whose ``tree_rows`` is True (the per-slot form of ``TreeRows``, with
``keep_path(slot, start, nodes)``).

``BatchBackend`` is what the batch driver drives, whatever the batch size: a one-sequence ``Backend`` runs behind
it as ``OneSlot(backend)`` (one slot; a row that asks for ``picks`` is answered by its ``DevicePicks``), so a lone
generation is a batch of one on the same loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple, Protocol, TypeGuard, runtime_checkable

import attrs
import numpy as np

from ortspec.core.tree import check_parents


class BackendError(RuntimeError):
    """A call broke the backend protocol, or the device failed; the KV cache is unchanged."""


@runtime_checkable
class Backend(Protocol):
    """One sequence's target model and KV cache (see the module docstring for the contract)."""

    @property
    def vocab_size(self) -> int:
        """Width of every logits row."""
        ...

    @property
    def max_length(self) -> int:
        """The most token positions the KV cache can hold."""
        ...

    def reset(self) -> None:
        """Empty the KV cache (``current_len()`` becomes 0)."""
        ...

    def current_len(self) -> int:
        """Number of resident KV positions."""
        ...

    def decode(self, tokens: Sequence[int], past: int) -> np.ndarray:
        """Fold ``tokens`` in at ``past``; return the logits after the last one, ``[vocab]`` float32."""
        ...

    def decode_verify(self, tokens: Sequence[int], base: int) -> np.ndarray:
        """One pass over ``tokens`` at ``base``; return ``[len(tokens), vocab]`` float32 logits rows."""
        ...

    def rewind(self, length: int) -> None:
        """Keep only the first ``length`` KV positions; copies nothing."""
        ...


def check_tokens(tokens: Sequence[int], vocab_size: int, what: str = "tokens") -> None:
    """Raise ``BackendError`` unless ``tokens`` is a non-empty sequence of ids in ``[0, vocab_size)``."""
    if len(tokens) == 0:
        raise BackendError(f"{what} is empty: a pass needs at least one token")
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise BackendError(f"{what} holds {t!r}, which is not an integer token id")
        if not 0 <= int(t) < vocab_size:
            raise BackendError(f"{what} holds token id {int(t)}, outside the vocabulary [0, {vocab_size})")


def check_position(position: int, current_len: int, n_tokens: int, max_length: int, what: str) -> None:
    """Raise ``BackendError`` unless a pass of ``n_tokens`` at ``position`` appends to the cache and fits in it."""
    if position != current_len:
        raise BackendError(f"{what}={position} but the KV cache holds {current_len} positions; they must be equal")
    if current_len + n_tokens > max_length:
        raise BackendError(
            f"{n_tokens} tokens at position {position} would exceed the KV capacity of {max_length} positions"
        )


@runtime_checkable
class DevicePicks(Protocol):
    """Optional capability (see the module docstring): picks and margins made where the logits live.

    ``picks_on_device`` says whether asking for picks saves a copy (True when the logits live on a device); a
    host backend may still implement ``verify_picks`` (tests use it) with ``picks_on_device`` False."""

    @property
    def picks_on_device(self) -> bool: ...

    def verify_picks(self, tokens: Sequence[int], base: int) -> tuple[np.ndarray, np.ndarray]:
        """One pass over ``tokens`` at ``base`` (as ``decode_verify``); return ``(picks, margins)`` per row."""
        ...


def argmax_margin(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``rows`` ``[count, vocab >= 2]``: the argmax id (lowest among ties), int64, and the gap between
    the two largest values (0 on a tie), float32; NaN margin for a row that is not finite where its pick is made.

    The pick is ``numpy.argmax``'s, as in ``core.state.step``: the first maximum, or the first NaN if the row
    holds one."""
    rows = np.asarray(rows)
    if rows.ndim != 2 or rows.shape[1] < 2:
        raise ValueError(f"argmax_margin needs a [rows, vocab>=2] array, got shape {rows.shape}")
    ids = np.argmax(rows, axis=1)  # the first occurrence of the maximum; a NaN counts as the maximum
    picked = np.take_along_axis(rows, ids[:, None], axis=1)[:, 0]
    finite = np.isfinite(picked)  # False for a row holding a NaN, topped by +inf, or all -inf
    two_largest = np.partition(rows, rows.shape[1] - 2, axis=1)[:, -2:]
    # subtract only where the top is finite (inf - inf would warn); the second largest may be -inf (margin +inf)
    gaps = np.where(finite, two_largest[:, 1], 0) - np.where(finite, two_largest[:, 0], 0)
    margins = np.where(finite, gaps, np.nan).astype(np.float32)
    return ids.astype(np.int64), margins


def uses_device_picks(backend: Backend) -> TypeGuard[DevicePicks]:
    """True when the driver should ask ``backend`` for picks instead of logits rows."""
    return isinstance(backend, DevicePicks) and bool(backend.picks_on_device)


@runtime_checkable
class HiddenStates(Protocol):
    """Optional capability (see the module docstring): the target's final hidden states of the last pass."""

    @property
    def hidden_size(self) -> int:
        """Width of a hidden state."""
        ...

    def hidden_at(self, position: int) -> np.ndarray:
        """The final hidden state at ``position`` (one of the last pass's positions), ``[hidden_size]`` float32;
        valid until the next call on the backend. ``BackendError`` for any other position."""
        ...


@runtime_checkable
class TreeRows(Protocol):
    """Optional capability (see the module docstring): one pass over a token tree, and the accepted path kept."""

    @property
    def tree_rows(self) -> bool:
        """True when ``verify_tree`` and ``keep_path`` may be called."""
        ...

    def verify_tree(self, tokens: Sequence[int], parents: Sequence[int], base: int) -> np.ndarray:
        """One pass at ``base == current_len()`` over ``tokens = (pending, *nodes)``, ``parents[j]`` node ``j``'s
        parent (-1: the pending token; else an earlier node); the KV length becomes ``base + len(tokens)``, node
        ``j``'s entry at ``base + 1 + j``. Returns ``[len(tokens), vocab]`` float32 logits: row 0 after the pending
        token, row ``j + 1`` after node ``j``'s path (what ``decode_verify`` gives for that path alone)."""
        ...

    def keep_path(self, start: int, nodes: Sequence[int]) -> None:
        """Move the KV of position ``start + 1 + nodes[d]`` to ``start + 1 + d`` for each ``d`` (``nodes``: an
        accepted path of the tree pass at ``start``, in depth order, so strictly increasing with ``nodes[d] >= d``).
        After it, positions ``[0, start + 1 + len(nodes))`` hold what plain decoding of the pending token and the
        path would; what lies past them is undefined until a ``rewind`` drops it. ``BackendError``, nothing moved,
        for a path that is not one (``check_kept_path``)."""
        ...


def check_kept_path(start: int, nodes: Sequence[int], current_len: int) -> None:
    """Raise ``BackendError`` unless ``nodes`` is a path ``keep_path`` can keep after a tree pass at ``start``:
    ints, strictly increasing, ``nodes[d] >= d``, every source position ``start + 1 + nodes[d]`` resident."""
    if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or start < 0:
        raise BackendError(f"keep_path: start {start!r} is not a position")
    previous = -1
    for d, node in enumerate(nodes):
        if isinstance(node, bool) or not isinstance(node, (int, np.integer)) or not previous < node:
            raise BackendError(f"keep_path: nodes {tuple(nodes)!r} are not strictly increasing node indices")
        if node < d or start + 1 + node >= current_len:
            raise BackendError(f"keep_path: node {node} at depth {d} cannot be kept (KV holds {current_len} positions)")
        previous = node


def kept_path_moves(start: int, nodes: Sequence[int], current_len: int) -> list[tuple[int, int]]:
    """The ``(source, target)`` positions ``keep_path(start, nodes)`` copies, ascending (so no source is overwritten
    before it is read): ``start + 1 + nodes[d]`` to ``start + 1 + d`` for each node not already in place; checked
    first (``check_kept_path``)."""
    check_kept_path(start, nodes, current_len)
    return [(start + 1 + node, start + 1 + d) for d, node in enumerate(nodes) if node != d]


def check_tree_row(tokens: Sequence[int], parents: Sequence[int], what: str) -> None:
    """Raise ``BackendError`` unless ``parents`` are the parents of a tree row over ``tokens`` (pending, *nodes):
    one per node, each -1 or an earlier node (``core.tree.check_parents``)."""
    if len(parents) != len(tokens) - 1:
        raise BackendError(f"{what}: {len(tokens) - 1} nodes after the pending token but {len(parents)} parents")
    try:
        check_parents(parents)
    except ValueError as exc:
        raise BackendError(f"{what}: {exc}") from exc


def _ids(tokens: Iterable[int]) -> tuple[int, ...]:
    return tuple(tokens)


def _parents(parents: Iterable[int] | None) -> tuple[int, ...] | None:
    return None if parents is None else tuple(parents)


def _check_last_logits(row: BatchRow, attribute: object, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value):
        raise ValueError(f"last_logits must be None or an int >= 1, got {value!r}")


@attrs.frozen
class BatchRow:
    """One row of a batched pass: ``tokens`` folded into ``slot``'s KV cache at ``position`` (which must equal
    that slot's ``current_len``). ``last_logits``: the caller reads the logits of the row's last ``last_logits``
    positions only (a prompt chunk: 1), so the backend may skip computing the others; None: every position's
    (a decode or a verify). ``logits_rows`` is how many rows of logits the pass returns for it. ``hidden_states``:
    the caller will also read the target's final hidden states at those positions (a shared-KV drafter bound to
    the slot does), so a backend that has them keeps them for the slot until its next row (``OrtBatchBackend``:
    ``hidden_row``); a row without it costs nothing for them. ``picks``: the caller reads only each row's argmax and
    margin (``DevicePicks``), so a backend whose logits live on a device (``picks_on_device``) answers the row with
    ``RowPicks`` instead of its logits rows; only such a backend may be sent one (``check_batch``). ``parents``:
    None for a chain (every token after the one before); for a token tree, ``tokens = (pending, *nodes)`` and
    ``parents[j]`` is node ``j``'s parent (-1: the pending token; ``core.tree.DraftTree.parents``): node ``j``'s KV
    is written at ``position + 1 + j``, its position is ``position + 1 + depth(j)``, and it attends to the slot's
    first ``position`` positions and to the rows ``core.tree.tree_mask(parents)`` names; only a backend whose
    ``tree_rows`` is True may be sent one, and every row's logits are read (``last_logits`` None)."""

    slot: int
    tokens: tuple[int, ...] = attrs.field(converter=_ids)
    position: int
    last_logits: int | None = attrs.field(default=None, validator=_check_last_logits)
    hidden_states: bool = False
    picks: bool = False
    parents: tuple[int, ...] | None = attrs.field(default=None, converter=_parents)

    @property
    def logits_rows(self) -> int:
        return len(self.tokens) if self.last_logits is None else min(self.last_logits, len(self.tokens))


class RowPicks(NamedTuple):
    """A ``BatchRow.picks`` row's answer: per logits row, the argmax id (lowest on ties, int64 ``[n]``) and the gap
    between its two largest logits (float32 ``[n]``, NaN for a non-finite row): ``argmax_margin`` of its rows."""

    ids: np.ndarray
    margins: np.ndarray


@runtime_checkable
class BatchBackend(Protocol):
    """A target model with ``slots`` KV caches, one per sequence, each with its own length, run by one pass over
    a ragged batch of rows (see the module docstring). Errors raise ``BackendError`` before any slot changes."""

    @property
    def vocab_size(self) -> int:
        """Width of every logits row."""
        ...

    @property
    def max_length(self) -> int:
        """The most token positions one slot's KV cache can hold."""
        ...

    @property
    def slots(self) -> int:
        """How many sequences the backend holds at once (slots are ``0 .. slots - 1``)."""
        ...

    def reset(self, slot: int) -> None:
        """Empty ``slot``'s KV cache (its ``current_len`` becomes 0)."""
        ...

    def current_len(self, slot: int) -> int:
        """Number of resident KV positions in ``slot``."""
        ...

    def run_pass(self, rows: Sequence[BatchRow]) -> Sequence[np.ndarray | RowPicks]:
        """One pass over every row (at most one per slot); each row's slot grows by ``len(row.tokens)``. Returns,
        per row in order, ``[row.logits_rows, vocab]`` float32 logits: the last ``logits_rows`` rows of what
        ``decode_verify`` gives for that slot alone, valid until the next call on the backend (a ``picks`` row:
        their ``RowPicks``)."""
        ...

    def rewind(self, slot: int, length: int) -> None:
        """Keep only the first ``length`` KV positions of ``slot``; copies nothing."""
        ...


@runtime_checkable
class BatchTreeRows(Protocol):
    """The per-slot form of ``TreeRows``: a ``BatchBackend`` whose ``tree_rows`` is True runs ``BatchRow``s with
    ``parents`` and keeps an accepted path in a slot."""

    @property
    def tree_rows(self) -> bool: ...

    def keep_path(self, slot: int, start: int, nodes: Sequence[int]) -> None:
        """``TreeRows.keep_path`` in ``slot``: after it, ``slot``'s positions ``[0, start + 1 + len(nodes))`` hold
        what plain decoding's would."""
        ...


def runs_trees(backend: object) -> TypeGuard[BatchTreeRows]:
    """True when ``backend`` runs tree rows (its ``tree_rows`` is True), so the driver may send it ``DraftTree``s."""
    return bool(getattr(backend, "tree_rows", False))


def batches_drafts(backend: object) -> bool:
    """True when ``backend`` runs a multi-token row after a past in the same session run as the pass's other rows
    (its ``ragged_rows`` is True), so a draft row costs its rows in the batch rather than a pass of its own
    (``core.width.pass_cost``)."""
    return bool(getattr(backend, "ragged_rows", False))


def check_slot(slot: int, slots: int) -> None:
    """Raise ``BackendError`` unless ``slot`` is an int in ``[0, slots)``."""
    if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) or not 0 <= slot < slots:
        raise BackendError(f"slot {slot!r} is outside [0, {slots})")


def check_batch(rows: Sequence[BatchRow], backend: BatchBackend) -> None:
    """Raise ``BackendError`` unless ``rows`` is a non-empty batch whose every row names its own slot, holds ids
    in the vocabulary, starts at its slot's length and fits its slot's capacity, and is a chain or, for a backend
    that runs tree rows, a valid tree whose every row is read."""
    if not rows:
        raise BackendError("a batched pass needs at least one row")
    seen: set[int] = set()
    for row in rows:
        check_slot(row.slot, backend.slots)
        if row.slot in seen:
            raise BackendError(f"slot {row.slot} has two rows in one pass")
        seen.add(row.slot)
        if row.picks and not getattr(backend, "picks_on_device", False):
            raise BackendError(f"the row of slot {row.slot} asks for device picks, which this backend does not make")
        check_tokens(row.tokens, backend.vocab_size, f"the tokens of slot {row.slot}")
        if row.parents is not None:
            if not runs_trees(backend):
                raise BackendError(f"the row of slot {row.slot} is a token tree, which this backend does not run")
            check_tree_row(row.tokens, row.parents, f"the tree row of slot {row.slot}")
            if row.last_logits is not None:
                raise BackendError(f"the tree row of slot {row.slot} must read every row's logits (last_logits None)")
        length = backend.current_len(row.slot)
        check_position(row.position, length, len(row.tokens), backend.max_length, f"the position of slot {row.slot}")


class OneSlot:
    """The batched protocol with one slot (slot 0) over a one-sequence ``backend``: what runs a ``Backend`` (the
    CUDA fast path, static shapes, a hybrid model, a fake) on the batch driver. A row whose caller reads one logits
    row (a plain step, a prompt chunk) runs as ``backend.decode``; a longer one as ``backend.decode_verify``; a
    ``picks`` row as ``backend.verify_picks``; a tree row as ``backend.verify_tree`` (``TreeRows``; asking for picks,
    reduced on the host by ``argmax_margin``). ``picks_on_device`` is ``uses_device_picks(backend)``, ``tree_rows``
    the backend's. It owns nothing: the backend's KV cache is the slot's."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.picks_on_device = uses_device_picks(backend)
        self.tree_rows = runs_trees(backend)

    @property
    def vocab_size(self) -> int:
        return self.backend.vocab_size

    @property
    def max_length(self) -> int:
        return self.backend.max_length

    @property
    def slots(self) -> int:
        return 1

    def reset(self, slot: int) -> None:
        check_slot(slot, 1)
        self.backend.reset()

    def current_len(self, slot: int) -> int:
        check_slot(slot, 1)
        return self.backend.current_len()

    def rewind(self, slot: int, length: int) -> None:
        check_slot(slot, 1)
        self.backend.rewind(length)

    def keep_path(self, slot: int, start: int, nodes: Sequence[int]) -> None:
        check_slot(slot, 1)
        backend = self.backend
        if not isinstance(backend, TreeRows) or not self.tree_rows:
            raise BackendError(f"{backend!r} does not run tree rows: it has no path to keep")
        backend.keep_path(start, nodes)

    def run_pass(self, rows: Sequence[BatchRow]) -> list[np.ndarray | RowPicks]:
        check_batch(rows, self)
        (row,) = rows
        backend = self.backend
        if row.parents is not None:
            assert isinstance(backend, TreeRows)
            tree = backend.verify_tree(row.tokens, row.parents, row.position)
            return [RowPicks(*argmax_margin(tree)) if row.picks else tree]
        if row.picks:
            assert uses_device_picks(backend)
            return [RowPicks(*backend.verify_picks(row.tokens, row.position))]
        if row.logits_rows == 1:
            return [backend.decode(row.tokens, row.position)[None, :]]
        return [backend.decode_verify(row.tokens, row.position)[-row.logits_rows :]]

    def __repr__(self) -> str:
        return f"OneSlot({self.backend!r})"
