"""The recurrent states of a hybrid model (such as LFM2, whose ``conv`` layers carry a state instead of a KV cache):
the snapshot that survives one pass, and what a rewind replays.

A state cannot be rewound by changing a length: a pass reads the state after the positions before it and writes
the state after its last token. So each state has two buffers, bound as past and present in turn
(:meth:`RecurrentStates.bind`): after a pass, the current buffer holds the state after ``current_len()`` positions
and the other the state before the pass (the snapshot, at ``snapshot_len`` positions). A rewind into the last pass
restores the snapshot and replays the kept tokens after it (:meth:`RecurrentStates.restore`, then the backend runs
:meth:`RecurrentStates.tokens` again); a rewind further back replays from the start. Speculation stays exact; a
partly accepted draft costs one extra pass.
"""

from __future__ import annotations

import numpy as np

from .arrays import ArrayModule
from .model_graph import StateNames


class RecurrentStates:
    """Two buffers per state in ``states`` (``[1, *shape]`` of its dtype, on the array module's device) and the
    token at each position (for replays), up to ``max_length`` positions."""

    def __init__(self, arrays: ArrayModule, states: tuple[StateNames, ...], max_length: int) -> None:
        self._arrays = arrays
        self._names = states
        self._buffers = [[arrays.zeros((1, *names.shape), names.dtype) for _ in range(2)] for names in states]
        self._current = 0  # which buffer of each pair holds the state after current_len() positions
        self._snapshot_len: int | None = None  # the positions the other buffer's state is after (None: unusable)
        self._history = np.zeros(max_length, np.int64)

    def bind(self, binding) -> None:
        """Bind the current buffers as the past inputs and the others as the present outputs of the next pass
        (which overwrites the snapshot)."""
        device, device_id = self._arrays.device_type, self._arrays.device_id
        for names, pair in zip(self._names, self._buffers, strict=True):
            shape = [1, *names.shape]
            past, present = pair[self._current], pair[1 - self._current]
            binding.bind_input(names.past, device, device_id, names.dtype, shape, self._arrays.ptr(past))
            binding.bind_output(names.present, device, device_id, names.dtype, shape, self._arrays.ptr(present))
        self._snapshot_len = None

    def commit(self, tokens: np.ndarray, past: int) -> None:
        """A pass over ``tokens`` at ``past`` succeeded: its outputs become current, the state before it the
        snapshot."""
        self._current, self._snapshot_len = 1 - self._current, past
        self._history[past : past + len(tokens)] = tokens

    def zero(self) -> None:
        """The states of an empty sequence (zeros), in the current buffers; no snapshot."""
        for pair in self._buffers:
            pair[self._current][...] = 0
        self._snapshot_len = None

    def restore(self, length: int) -> int:
        """Go back to the latest state at or before ``length`` positions: the snapshot when it is not past
        ``length``, else the empty sequence's. Returns its position; the caller replays ``tokens(it, length)``."""
        if self._snapshot_len is not None and self._snapshot_len <= length:
            self._current = 1 - self._current
            restored, self._snapshot_len = self._snapshot_len, None
            return restored
        self.zero()
        return 0

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """The tokens at positions ``[start, stop)`` (a copy)."""
        return self._history[start:stop].copy()
