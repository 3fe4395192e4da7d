"""The IO binding of a pass: the per-pass row buffers, the default binding, and the static-shape binding.

* **Rows** (:class:`RowBuffers`). The logits are bound to a preallocated ``[rows, vocab]`` buffer (``rows`` = the
  prefill chunk, 256 by default, grown once if a pass is wider), so nothing vocab-sized is allocated per step; the
  ids too, and the hidden states (``[rows, hidden]``) when the graph has that output. On CUDA, float16 rows asked
  for on the host are converted into a preallocated float32 host buffer.
* **Default** (:class:`DefaultBinding`). Per pass: ids ``[1, count]``, ``attention_mask`` ``[1, total]`` (a
  prefix of a ``[max_length]`` buffer of ones), position ids ``[1, count]`` (a slice of ``0..max_length-1`` at
  the pass's position) and, when the graph takes it, ``KEEP_LOGITS_INPUT`` (the rows the pass computes, a host
  int64 ``[1]``: the outputs are bound as ``[1, kept, ...]``).
* **Static shapes** (:class:`StaticBinding`; ``static_shapes=True``, needs the shared-buffer GroupQueryAttention
  path): ``attention_mask`` is bound as ``[1, max_length]`` and the length is carried by its values (ones, then
  zeros): the builder's graph feeds GroupQueryAttention ``seqlens_k = ReduceSum(mask) - 1`` and
  ``total_sequence_length = Shape(mask)[1]``, and with the KV buffer bound as both past and present the op reads
  the real length from ``seqlens_k`` (it takes the rotary positions from it too). Ids (and position ids, for graphs
  that take them) go to fixed buffers, and each pass width keeps its own IO binding (a :class:`StaticPass`), so
  every pass of a width has identical shapes and addresses (a graph that takes ``KEEP_LOGITS_INPUT`` gets the
  width: every row). On the CPU the logits are bit for bit those of the
  default binding (tested). On CUDA this path also runs ONNX Runtime on the array module's own stream
  (``user_compute_stream``) with the run-config entry ``disable_synchronize_execution_providers=1``: the host never
  waits for the device except when it reads the picks or rows back (and, with graphs, inside ONNX Runtime's graph
  replay, which synchronises its stream). Inputs are staged in page-locked memory, indexed by position, so chunked
  prefill never overwrites a staged chunk before the device has copied it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .arrays import ArrayModule
from .model_graph import DecoderGraph
from .tree_rewrite import tree_feeds


def bind_input(binding, arrays: ArrayModule, name: str, dtype, shape: list[int], address: int) -> None:
    """Bind graph input ``name`` (``shape`` of ``dtype``) to ``address`` on ``arrays``' device."""
    binding.bind_input(name, arrays.device_type, arrays.device_id, dtype, shape, address)


def bind_kept(binding, graph: DecoderGraph, kept: np.ndarray) -> None:
    """Bind the graph's ``KEEP_LOGITS_INPUT`` (when it takes it) to ``kept``, a host int64 ``[1]`` array the session
    reads on each run (the caller keeps it alive)."""
    if graph.keep_name is not None:
        binding.bind_input(graph.keep_name, "cpu", 0, np.int64, [1], kept.ctypes.data)


def bind_output(binding, arrays: ArrayModule, name: str, dtype, shape: list[int], address: int) -> None:
    """Bind graph output ``name`` (``shape`` of ``dtype``) to ``address`` on ``arrays``' device."""
    binding.bind_output(name, arrays.device_type, arrays.device_id, dtype, shape, address)


class RowBuffers:
    """The buffers of a pass's rows, for up to ``capacity`` tokens: ``ids_host`` (and ``ids`` on the device),
    ``logits`` ``[capacity, vocab]`` in the graph's dtype, ``host_logits`` (the float32 host rows handed out: the
    logits buffer itself when it is one), ``hidden`` ``[capacity, hidden_size]`` (None without the output) and
    ``hidden_span``: ``(start, count)``, the positions whose hidden states ``hidden`` holds ((0, 0): none)."""

    def __init__(self, arrays: ArrayModule, graph: DecoderGraph, vocab: int) -> None:
        self._arrays = arrays
        self._graph = graph
        self._vocab = vocab
        self.capacity = 0
        self.ids_host = np.empty(0, graph.ids_dtype)
        self.ids: Any = self.ids_host
        self.logits: Any = None
        self.host_logits = np.empty((0, vocab), np.float32)
        self.hidden: Any = None
        self.hidden_span = (0, 0)
        self.hidden_host = np.empty(max(graph.hidden_size, 1), np.float32)

    def allocate(self, rows: int) -> None:
        """(Re)allocate every buffer for ``rows`` tokens (the old ones, and the hidden states they held, go)."""
        arrays, graph = self._arrays, self._graph
        self.capacity = rows
        self.ids_host = np.zeros(rows, graph.ids_dtype)
        self.ids = self.ids_host if arrays.device_type == "cpu" else arrays.zeros(rows, graph.ids_dtype)
        self.logits = arrays.empty((rows, self._vocab), graph.logits_dtype)
        float32_on_host = arrays.device_type == "cpu" and graph.logits_dtype == np.float32
        self.host_logits = self.logits if float32_on_host else np.empty((rows, self._vocab), np.float32)
        if graph.hidden_name:
            self.hidden = arrays.empty((rows, graph.hidden_size), graph.hidden_dtype)
            self.hidden_span = (0, 0)

    def bind_outputs(self, binding, count: int) -> None:
        """Bind the per-row outputs of a pass that computes ``count`` rows (its tokens, or the last ``count`` of
        them with ``KEEP_LOGITS_INPUT``): the logits, and the hidden states when the graph has them."""
        arrays, graph = self._arrays, self._graph
        shape = [1, count, self._vocab]
        bind_output(binding, arrays, graph.logits_name, graph.logits_dtype, shape, arrays.ptr(self.logits))
        if graph.hidden_name:
            shape = [1, count, graph.hidden_size]
            bind_output(binding, arrays, graph.hidden_name, graph.hidden_dtype, shape, arrays.ptr(self.hidden))

    def host_row(self, row: int) -> np.ndarray:
        """Logits row ``row`` of the last pass as a float32 host ``[vocab]`` view (copied there on a device)."""
        if self.host_logits is self.logits:
            return self.logits[row]
        out = self.host_logits[row]
        self._arrays.download(self.logits[row], out)
        return out

    def host_rows(self, count: int) -> np.ndarray:
        """The last pass's first ``count`` logits rows as a float32 host ``[count, vocab]`` view."""
        if self.host_logits is self.logits:
            return self.logits[:count]
        out = self.host_logits[:count]
        self._arrays.download(self.logits[:count], out)
        return out


class DefaultBinding:
    """The default binding: one IO binding of the session (``binding``), with the inputs bound per pass."""

    def __init__(self, arrays: ArrayModule, graph: DecoderGraph, max_length: int) -> None:
        self._arrays = arrays
        self._graph = graph
        # [max_length] ones and 0..max_length-1: a pass binds the prefix (mask) or the slice at its position
        self._mask = arrays.from_host(np.ones(max_length, graph.mask_dtype)) if graph.mask_name else None
        self._positions = (
            arrays.from_host(np.arange(max_length, dtype=graph.position_dtype)) if graph.position_name else None
        )
        self._kept = np.ones(1, np.int64)  # the KEEP_LOGITS_INPUT value, read by the session on the host
        self._tree_feeds: tuple[np.ndarray, np.ndarray] | None = None  # kept alive until the next pass binds
        self.binding: Any = None

    def open(self, session) -> Any:
        """A fresh IO binding of ``session`` (after the session changed); returns it."""
        self.binding = session.io_binding()
        return self.binding

    def bind_pass(
        self, rows: RowBuffers, tokens: np.ndarray, past: int, kept: int, parents: Sequence[int] | None = None
    ) -> None:
        """Bind a pass of ``tokens`` at ``past`` whose outputs hold its last ``kept`` rows (``len(tokens)`` unless
        the graph takes ``KEEP_LOGITS_INPUT``). With the tree inputs (``DecoderGraph.tree_bias_name``): consecutive
        positions and a zero bias, or for a tree row ``(pending, *nodes)`` (``parents``: node ``j``'s parent, -1 for
        the pending token) each node at ``past + 1 + depth`` seeing its ancestors only (``tree_feeds``); host
        arrays, which ONNX Runtime copies where the session runs."""
        binding, graph, arrays = self.binding, self._graph, self._arrays
        count = len(tokens)
        self._kept[0] = kept
        bind_kept(binding, graph, self._kept)
        rows.ids_host[:count] = tokens
        if arrays.device_type != "cpu":
            arrays.upload(rows.ids[:count], rows.ids_host[:count])
        bind_input(binding, arrays, graph.ids_name, graph.ids_dtype, [1, count], arrays.ptr(rows.ids))
        if graph.mask_name:
            bind_input(binding, arrays, graph.mask_name, graph.mask_dtype, [1, past + count], arrays.ptr(self._mask))
        if graph.position_name:
            address = arrays.ptr(self._positions) + past * np.dtype(graph.position_dtype).itemsize
            bind_input(binding, arrays, graph.position_name, graph.position_dtype, [1, count], address)
        if graph.tree_bias_name is not None and graph.tree_positions_name is not None:
            if parents is None:
                positions = (past + np.arange(count, dtype=np.int64))[None, :]
                bias = np.zeros((1, 1, count, past + count), graph.tree_bias_dtype)
            else:
                rooted = (-1, *(p + 1 for p in parents))  # the pending token is the one root
                positions, bias = tree_feeds(rooted, past, past + count, graph.tree_bias_dtype or np.float32)
            self._tree_feeds = (positions, bias)
            binding.bind_cpu_input(graph.tree_positions_name, positions)
            binding.bind_cpu_input(graph.tree_bias_name, bias)
        rows.bind_outputs(binding, kept)


class StaticPass:
    """One pass width's fixed IO binding and run options, and the graph id they carry."""

    __slots__ = ("binding", "count", "graph_id", "run_options")

    def __init__(self, *, count: int, binding, run_options, graph_id: int) -> None:
        self.count, self.binding, self.run_options, self.graph_id = count, binding, run_options, graph_id


class StaticBinding:
    """The static-shape binding's buffers: the ``[max_length]`` mask (its leading ``mask_ones`` values are ones,
    the rest zeros), page-locked sources of ones and zeros to copy from, the page-locked ids staging indexed by
    position, the constant positions ``0..max_length-1`` and the fixed position-ids buffer; and ``passes``, the
    :class:`StaticPass` of each width seen (dropped by :meth:`forget_passes` when the row buffers move)."""

    def __init__(self, arrays: ArrayModule, graph: DecoderGraph, max_length: int) -> None:
        self._arrays = arrays
        self._graph = graph
        self._max_length = max_length
        self.mask = arrays.zeros(max_length, graph.mask_dtype)
        self.mask_ones = 0
        self._mask_one_src = arrays.pinned_empty(max_length, graph.mask_dtype)
        self._mask_one_src[...] = 1
        self._mask_zero_src = arrays.pinned_empty(max_length, graph.mask_dtype)
        self._mask_zero_src[...] = 0
        self._stage_ids = arrays.pinned_empty(max_length, graph.ids_dtype)
        self._positions_src: Any = None
        self._positions_fixed: Any = None  # the position ids, for graphs that take them
        if graph.position_name:
            self._positions_src = arrays.pinned_empty(max_length, graph.position_dtype)
            self._positions_src[...] = np.arange(max_length)
            self._positions_fixed = arrays.zeros(1, graph.position_dtype)  # sized by allocate
        self.passes: dict[int, StaticPass] = {}
        self._kept: dict[int, np.ndarray] = {}  # per width, its KEEP_LOGITS_INPUT value (the width: every row)

    def allocate(self, rows: int) -> None:
        """The fixed position ids for passes of up to ``rows`` tokens (with the row buffers)."""
        if self._positions_fixed is not None:
            self._positions_fixed = self._arrays.zeros(rows, self._graph.position_dtype)

    def forget_passes(self) -> None:
        self.passes = {}

    def add_pass(self, count: int, binding, ids, run_options, graph_id: int) -> StaticPass:
        """Bind the inputs of passes of ``count`` tokens to ``binding`` (which has the KV and the row outputs
        bound; ``ids``: the row buffers' device ids) and keep it as the width's :class:`StaticPass`."""
        arrays, graph = self._arrays, self._graph
        assert graph.mask_name is not None  # static_shapes_unsupported refuses a graph without one
        bind_input(binding, arrays, graph.ids_name, graph.ids_dtype, [1, count], arrays.ptr(ids))
        bind_kept(binding, graph, self._kept.setdefault(count, np.array([count], np.int64)))
        bind_input(binding, arrays, graph.mask_name, graph.mask_dtype, [1, self._max_length], arrays.ptr(self.mask))
        if graph.position_name:
            address = arrays.ptr(self._positions_fixed)
            bind_input(binding, arrays, graph.position_name, graph.position_dtype, [1, count], address)
        found = StaticPass(count=count, binding=binding, run_options=run_options, graph_id=graph_id)
        self.passes[count] = found
        return found

    def stage(self, tokens: np.ndarray, ids, past: int, total: int) -> None:
        """Enqueue a pass's inputs: ids (staged at their positions, so a later chunk never overwrites an earlier one
        before its copy; ``ids``: the row buffers' device ids), position ids, and the mask's ones/zeros boundary
        moved to ``total``."""
        arrays, count = self._arrays, total - past
        stage = self._stage_ids[past:total]
        stage[...] = tokens
        arrays.copy_from_host(ids[:count], stage)
        if self._positions_fixed is not None:
            arrays.copy_from_host(self._positions_fixed[:count], self._positions_src[past:total])
        ones = self.mask_ones
        if total > ones:
            arrays.copy_from_host(self.mask[ones:total], self._mask_one_src[ones:total])
        elif total < ones:
            arrays.copy_from_host(self.mask[total:ones], self._mask_zero_src[total:ones])
        self.mask_ones = total


def static_shapes_unsupported(graph: DecoderGraph, share_buffer: bool) -> str | None:
    """Why a graph cannot take the static-shape binding (None when it can): it needs the shared KV buffer (a
    GroupQueryAttention graph; otherwise the KV inputs change shape every pass) and an ``attention_mask`` input
    whose values carry the length (a graph with only position ids has no input that says how much of a
    fixed-size KV buffer is valid)."""
    if not share_buffer:
        return (
            "the KV cache is not one shared past/present buffer (it needs GroupQueryAttention and "
            "past_present_share_buffer), so the KV inputs change shape with every pass"
        )
    if graph.mask_name is None:
        return "the graph has no attention_mask input, so nothing would carry the sequence length"
    if graph.states:
        return "the graph carries a recurrent state (its per-layer state buffers alternate between passes)"
    return None
