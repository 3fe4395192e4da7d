"""What one session run of ``OrtBatchBackend`` binds (``batch.py``'s module docstring gives the shapes): the host
inputs of a run over a range of slots (``PassInputs``, tree rows included), how a pass's rows split into runs
(``pass_groups``) and the grown-never-shrunk output buffers (``Outputs``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import numpy as np

from ortspec.core.tree import DraftTree, tree_mask

from ..base import BatchRow
from .model_graph import DecoderGraph


class PassInputs:
    """The host inputs of one session run over the bound slot range: ``ids`` ``[B, S]``, ``mask`` ``[B, total]``,
    ``positions`` ``[B, S]``, ``starts`` (each bound row's first written position) and ``keep`` (``[1]``: the last
    ``kept`` positions get logits; all ``S`` when the graph has no ``keep_name``). With the tree inputs
    (``DecoderGraph.tree_bias_name``): ``tree_positions`` ``[B, S]`` (``positions``; for a tree row, its start plus
    1 + each node's depth) and ``tree_bias`` (zeros ``[1, 1, S, total]`` when no row is a tree, else ``[B, 1, S,
    total]``: zeros, and for each tree row ``-inf`` where ``core.tree.tree_mask`` hides one of its rows from another).
    ``trees`` maps a bound row's index ``b`` to its tree's ``parents`` (``BatchRow.parents``).

    ``valid`` (a graph with ``query_lengths_name``, ``ragged_rewrite.py``): each bound row's count of real tokens,
    ``0 <= valid[b] <= S`` (0: an idle row, whose start must be 1), fed as ``query_lengths`` (int32 ``[B]``); a row's
    mask then covers ``starts[b] + valid[b]`` positions and its padding positions repeat its last real one. None:
    every row is ``S`` tokens long (its padding is written to the KV past its real length and forgotten)."""

    def __init__(
        self,
        graph: DecoderGraph,
        starts: np.ndarray,
        width: int,
        kept: int,
        trees: Mapping[int, tuple[int, ...]] | None = None,
        valid: np.ndarray | None = None,
    ) -> None:
        count = len(starts)
        filled = starts + (width if valid is None else valid)  # positions each slot holds after the run
        total = max(int(filled.max()), width)
        self.starts = starts
        self.width = width
        self.kept = kept if graph.keep_name is not None else width  # logits positions computed: the last ``kept``
        self.keep = np.array([self.kept], np.int64)
        self.ids = np.zeros((count, width), graph.ids_dtype)
        self.mask = (np.arange(total)[None, :] < filled[:, None]).astype(graph.mask_dtype or np.int64)
        positions = starts[:, None] + np.arange(width)[None, :]
        if valid is not None:
            positions = np.minimum(positions, np.maximum(filled - 1, 0)[:, None])
        self.positions = positions.astype(graph.position_dtype or np.int64)
        self.query_lengths = None if valid is None else valid.astype(np.int32)
        self.tree_positions = self.tree_bias = None
        if graph.tree_bias_name is not None:
            self.tree_positions = self.positions.astype(np.int64)
            self.tree_bias = np.zeros((count if trees else 1, 1, width, total), graph.tree_bias_dtype)
            for b, parents in (trees or {}).items():
                self._tree(b, parents)

    def _tree(self, b: int, parents: tuple[int, ...]) -> None:
        """Positions and bias of bound row ``b``, a tree row ``(pending, *nodes)`` (``BatchRow.parents``)."""
        assert self.tree_positions is not None and self.tree_bias is not None
        start, n = int(self.starts[b]), len(parents)
        self.tree_positions[b, 1 : n + 1] = start + 1 + np.asarray(DraftTree((0,) * n, parents).depths, np.int64)
        hidden = ~tree_mask(parents)
        self.tree_bias[b, 0, : n + 1, start : start + n + 1][hidden] = -np.inf


@attrs.frozen
class PassGroup:
    """Rows that one session run can carry: ``idle_at_zero`` is True for a prefill group (every row at position
    0), whose idle slots must start at 0 too."""

    rows: tuple[BatchRow, ...]
    idle_at_zero: bool


def pass_groups(rows: Sequence[BatchRow]) -> list[PassGroup]:
    """Split a batch into the session runs ONNX Runtime's ``GroupQueryAttention`` accepts: it takes a batch of
    more than one row only when every row is one token (decode) or every row starts at position 0 (prefill); a
    row of several tokens at a later position (a prompt chunk, a verify of a draft) runs alone. Prefill rows run
    together only with rows of the same length, so no prompt is padded to a longer one (padding is computed like
    real tokens, the LM head included). Order: the decode group, the prefill groups (by
    length, in order of first appearance), then each lone row."""
    decode = tuple(row for row in rows if len(row.tokens) == 1)
    prefill: dict[int, list[BatchRow]] = {}
    for row in rows:
        if len(row.tokens) > 1 and row.position == 0:
            prefill.setdefault(len(row.tokens), []).append(row)
    alone = [row for row in rows if len(row.tokens) > 1 and row.position > 0]
    groups = [PassGroup(decode, False)] if decode else []
    groups.extend(PassGroup(tuple(same), True) for same in prefill.values())
    groups.extend(PassGroup((row,), False) for row in alone)
    return groups


# What one session run costs beyond its rows, in padded token rows (the weights are read once per run):
# read off docs/bench/batch-pass-cost.md (a run of 16 one-token rows against one of a single row).
RUN_ROWS = 16


def ragged_groups(rows: Sequence[BatchRow], max_length: int, run_rows: int = RUN_ROWS) -> list[PassGroup]:
    """Split a batch into session runs of a graph that takes query lengths (``ragged_rewrite.py``), where any rows
    can share a run, each right-padded to the run's widest: the partition of the rows, ordered by width, into
    runs that costs least when a run costs ``run_rows`` plus its rows times its width (the padding is computed like
    real tokens), every row fitting ``max_length`` at its position plus the run's width. A tree row (``parents``)
    is a row like any other (its bias is its own: ``PassInputs``); a row as wide as ``max_length`` runs alone (an
    idle row beside it would not fit). Runs come narrowest first."""
    alone: list[BatchRow] = []
    ordered: list[BatchRow] = []
    for row in rows:
        (alone if len(row.tokens) >= max_length else ordered).append(row)
    ordered.sort(key=lambda row: len(row.tokens))
    n = len(ordered)
    best = [0.0] + [float("inf")] * n  # best[j]: the least cost of the first j rows
    cut = [0] * (n + 1)  # where the last run of best[j] starts
    for j in range(1, n + 1):
        width = len(ordered[j - 1].tokens)
        furthest = 0
        for i in range(j - 1, -1, -1):
            furthest = max(furthest, ordered[i].position)
            if furthest + width > max_length:
                break
            cost = best[i] + run_rows + (j - i) * width
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups: list[PassGroup] = []
    j = n
    while j > 0:
        groups.append(PassGroup(tuple(ordered[cut[j] : j]), False))
        j = cut[j]
    groups.reverse()
    groups.extend(PassGroup((row,), False) for row in alone)
    return groups


class Grown:
    """An output buffer, grown and never shrunk; ``view(count, width, size)`` is ``[count, width, size]``."""

    def __init__(self, dtype: np.dtype) -> None:
        self._array = np.empty(0, dtype)

    def view(self, count: int, width: int, size: int) -> np.ndarray:
        total = count * width * size
        if self._array.size < total:
            self._array = np.empty(total, self._array.dtype)
        return self._array[:total].reshape(count, width, size)


@attrs.frozen
class Outputs:
    """The buffers one session run writes: ``logits`` ``[B, kept, vocab]`` and, when the graph has them, the
    hidden states of the same positions ``[B, kept, hidden]`` (``hidden`` None without them)."""

    logits: Grown
    hidden: Grown | None

    @classmethod
    def of(cls, graph: DecoderGraph) -> Outputs:
        hidden = Grown(graph.hidden_dtype) if graph.hidden_name and graph.hidden_dtype is not None else None
        return cls(Grown(graph.logits_dtype), hidden)
