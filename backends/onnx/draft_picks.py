"""A draft head's pick from one logits row: its argmax, or, when the generation samples, the target's own pick rule
applied to the row (coupled drafting: ``core.sampling.DraftPicker``).

A head's logits are over its draft vocabulary: V' ids, column ``j`` being target id ``draft_to_target[j]`` (no map:
V' = V, the identity). Coupled, the row is scattered into a row over the target's vocabulary, ``-inf`` at every id
the head cannot draft (never picked, whatever the processors do), and handed to the core's rule
(``DraftPicks.pick``), which draws in the target's id order with the uniform of the token's index: the head's draw
and the target's run over the same ids in the same order and coincide where the two distributions are close. The
rule itself is not restated here. Greedy, the pick is the row's argmax.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ortspec.core.sampling import DraftPicks

from .arrays import ArrayModule


class HeadPicks:
    """How one drafter turns its head's logits into its next draft token, a target id, or None to stop drafting.
    ``to_target``: the int64 ``[V']`` map (None: identity); ``target_vocab``: V; ``stop_below``: a pick whose
    probability is below it is not drafted (0: never): under the head's softmax for an argmax pick, under the
    processed distribution it was drawn from for a coupled one; ``arrays`` and ``device``: where the logits live."""

    def __init__(
        self, to_target: np.ndarray | None, target_vocab: int, stop_below: float, arrays: ArrayModule, device: str
    ) -> None:
        self.to_target = to_target
        self.target_vocab = target_vocab
        self.stop_below = stop_below
        self.arrays, self.device = arrays, device

    def pick(self, logits: Any, picks: DraftPicks | None, drafted: Sequence[int]) -> int | None:
        """The pick from one head run's ``logits`` ``[1, 1, V']`` (the drafter's output buffer, on its device): the
        argmax (on a device, the device's), or with ``picks`` the coupled pick at draft position ``len(drafted)``."""
        if picks is None and self.device != "cpu":
            return self.target_id(int(self.arrays.argmax_margin(logits[0])[0][0]))
        row = self.host_row(logits)
        return self.argmax(row) if picks is None else self.coupled(row, picks, drafted)

    def host_row(self, logits: Any) -> np.ndarray:
        """The row of one head run's ``logits`` ``[1, 1, V']`` on the host (downloaded from a device)."""
        row = logits[0, 0]
        if self.device != "cpu":
            host = np.empty(row.shape, np.float32)
            self.arrays.download(row, host)
            row = host
        return np.asarray(row)

    def ranked(self, row: np.ndarray, count: int) -> list[tuple[int, float]]:
        """The ``count`` likeliest target ids of a host ``row`` (``host_row``) under the head's softmax, the likeliest
        first (the lowest column on ties), each with its probability."""
        count = max(0, min(count, row.shape[-1]))
        if count == 0:
            return []
        values = np.array(row, np.float32)  # a copy: the picked columns are masked below
        top = []
        for _ in range(count):  # a few argmaxes cost less than a partition of the row
            top.append(int(np.argmax(values)))
            values[top[-1]] = -np.inf
        values[top] = np.asarray(row, np.float32)[top]
        shifted = np.exp(values - values[top[0]])
        probs = shifted[top] / float(shifted.sum())
        return [(self.target_id(j), float(p)) for j, p in zip(top, probs, strict=True)]

    def target_id(self, draft_id: int) -> int:
        """The target id of column ``draft_id``."""
        return int(self.to_target[draft_id]) if self.to_target is not None else draft_id

    def argmax(self, row: np.ndarray) -> int | None:
        """The row's argmax (lowest id on ties), or None when its softmax probability is below ``stop_below``."""
        best = int(np.argmax(row))
        if self.stop_below > 0.0 and 1.0 / float(np.exp(row - row[best]).sum()) < self.stop_below:
            return None
        return self.target_id(best)

    def coupled(self, row: np.ndarray, picks: DraftPicks, drafted: Sequence[int]) -> int | None:
        """The target's rule's pick at draft position ``len(drafted)`` from ``row`` over the target's vocabulary;
        None when the row is not finite where the pick is made or the pick is less likely than ``stop_below``."""
        if self.to_target is None:
            full = np.asarray(row, dtype=np.float32)
        else:
            full = np.full(self.target_vocab, -np.inf, dtype=np.float32)
            full[self.to_target] = row
        pick = picks.pick(full, drafted)
        if pick is None or (self.stop_below > 0.0 and math.exp(pick.logprob) < self.stop_below):
            return None
        return pick.token
