"""The KV store of one sequence: the per-layer key and value buffers, their length, rewinding it, and the address
of one KV head for a reader on the same device.

One preallocated buffer per layer for keys and one for values, ``[1, kv_heads, max_length, head_size]`` of the
graph's KV dtype. When the graph's attention is ``GroupQueryAttention`` and the config asks for
``past_present_share_buffer``, ``past_key_values.N`` and ``present.N`` are bound to the *same* buffer
(:meth:`KvStore.bind_shared`): the operator appends the new positions in place and reads the length from
``attention_mask``. Then a rewind only changes :attr:`KvStore.length` and a pass allocates and copies nothing
KV-sized. Otherwise (another attention op, or sharing turned off) the grow/copy path
(:meth:`KvStore.bind_grow_copy`, then :meth:`KvStore.copy_back`) feeds the first ``length`` positions as their own
tensors and copies the new ones back after each run: correct, but slower.

Positions at or past ``length`` are stale and never read. The buffers are owned here; a reader given
:meth:`KvStore.pointer` must not write them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..base import BackendError
from .arrays import ArrayModule
from .model_graph import DecoderGraph

KV_KINDS = ("key", "value")


class KvStore:
    """Per-layer key and value buffers of ``shape`` = ``(1, kv_heads, max_length, head_size)`` (``keys[layer]``,
    ``values[layer]``: arrays of the array module, on its device) and ``length``, the resident positions."""

    def __init__(self, arrays: ArrayModule, graph: DecoderGraph, kv_heads: int, max_length: int, head_size: int):
        self._arrays = arrays
        self._graph = graph
        self.shape = (1, kv_heads, max_length, head_size)
        self.keys = [arrays.zeros(self.shape, graph.kv_dtype) for _ in graph.kv_names]
        self.values = [arrays.zeros(self.shape, graph.kv_dtype) for _ in graph.kv_names]
        self.length = 0
        self._fed: list[Any] = []  # the grow/copy path's fed copies, kept alive through a run

    def check_rewind(self, length: int) -> None:
        """``BackendError`` unless ``0 <= length <= self.length``."""
        if not 0 <= length <= self.length:
            raise BackendError(f"rewind({length}) but the KV cache holds {self.length} positions")

    def _pairs(self, layer: int):
        names = self._graph.kv_names[layer]
        return (
            (names.past_key, names.present_key, self.keys[layer]),
            (names.past_value, names.present_value, self.values[layer]),
        )

    def bind_shared(self, binding) -> None:
        """Bind each layer's buffers to ``binding`` as both the past input and the present output."""
        arrays, dtype = self._arrays, self._graph.kv_dtype
        device, device_id, shape = arrays.device_type, arrays.device_id, list(self.shape)
        for layer in range(len(self.keys)):
            for past_name, present_name, buffer in self._pairs(layer):
                address = arrays.ptr(buffer)
                binding.bind_input(past_name, device, device_id, dtype, shape, address)
                binding.bind_output(present_name, device, device_id, dtype, shape, address)

    def bind_grow_copy(self, binding, ort, past: int, total: int) -> list[tuple]:
        """Grow/copy path: bind copies of the first ``past`` positions as the past inputs and fresh
        ``total``-position buffers as the present outputs; return the (key, value) outputs per layer, for
        :meth:`copy_back`. ``ort``: the onnxruntime module (a zero-length past is bound as an ``OrtValue``)."""
        arrays, dtype = self._arrays, self._graph.kv_dtype
        device, device_id = arrays.device_type, arrays.device_id
        _, kv_heads, _, head_size = self.shape
        presents = []
        self._fed = []
        for layer in range(len(self.keys)):
            pair = []
            for past_name, present_name, buffer in self._pairs(layer):
                fed = arrays.prefix(buffer, past)
                self._fed.append(fed)
                if past == 0:
                    # a zero-length tensor may have a null data pointer; bind it as an OrtValue instead
                    host = np.zeros((1, kv_heads, 0, head_size), dtype)
                    self._fed.append(host)
                    binding.bind_ortvalue_input(past_name, ort.OrtValue.ortvalue_from_numpy(host))
                else:
                    binding.bind_input(
                        past_name, device, device_id, dtype, [1, kv_heads, past, head_size], arrays.ptr(fed)
                    )
                out = arrays.empty((1, kv_heads, total, head_size), dtype)
                binding.bind_output(
                    present_name, device, device_id, dtype, [1, kv_heads, total, head_size], arrays.ptr(out)
                )
                pair.append(out)
            presents.append(tuple(pair))
        return presents

    def copy_back(self, presents: list[tuple], past: int, total: int) -> None:
        """After a grow/copy run: copy positions ``[past, total)`` of each present output into the buffers."""
        for layer, (present_key, present_value) in enumerate(presents):
            self._arrays.copy_positions(self.keys[layer], present_key, past, total)
            self._arrays.copy_positions(self.values[layer], present_value, past, total)

    def move_positions(self, moves: Sequence[tuple[int, int]]) -> None:
        """Copy each ``(source, target)`` position's keys and values of every layer and head, in order (a tree
        pass's accepted path moved into place: ascending, so no source is overwritten before it is read)."""
        for source, target in moves:
            for buffer in (*self.keys, *self.values):
                buffer[:, :, target] = buffer[:, :, source]

    def pointer(self, layer: int, which: str, head: int) -> int:
        """The address of KV head ``head`` of ``layer`` (``which``: ``"key"`` or ``"value"``) at position 0:
        ``[max_length, head_size]`` elements, of which the first ``length`` are valid and contiguous.
        ``ValueError`` for a bad index."""
        _, kv_heads, max_length, head_size = self.shape
        if not 0 <= layer < len(self.keys) or not 0 <= head < kv_heads or which not in KV_KINDS:
            raise ValueError(
                f"kv_pointer({layer}, {which!r}, {head}): expected layer in [0, {len(self.keys)}), "
                f"which 'key' or 'value', head in [0, {kv_heads})"
            )
        buffer = (self.keys if which == "key" else self.values)[layer]
        return self._arrays.ptr(buffer) + head * max_length * head_size * np.dtype(self._graph.kv_dtype).itemsize


def move_rows(rows: Any, first: int, moves: Sequence[tuple[int, int]]) -> None:
    """Apply a kept path's ``moves`` (``backends.base.kept_path_moves``) to ``rows``, per-position rows (kept hidden
    states) of which row 0 is position ``first``: the moves whose source the rows hold and whose target lies at or
    past ``first``, in order."""
    for source, target in moves:
        if first <= source < first + len(rows) and target >= first:
            rows[target - first] = rows[source - first]
