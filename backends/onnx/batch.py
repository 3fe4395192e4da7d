"""``OrtBatchBackend``: the batched protocol (``BatchBackend`` in ``backends/base.py``) on an ONNX Runtime decoder
folder, on the CPU.

The KV of all slots lives in one buffer per layer for keys and one for values, ``[slots, kv_heads, max_length,
head_size]`` of the graph's KV dtype, bound as both ``past_key_values.N`` and ``present.N`` (the builder's
``past_present_share_buffer`` layout, on ``GroupQueryAttention``): the operator appends each row's new positions in
place, at the row's own length, which it reads from that row's ``attention_mask``.

**One pass, several runs.** ONNX Runtime's ``GroupQueryAttention`` (CPU, 1.32) takes a batch of more than one
row only when every row is one token or every row starts at position 0; for several tokens after a past it
refuses ("batch_size must be 1 when sequence_length > 1 and past context is given"). So ``run_pass`` splits its
rows (:func:`pass_groups`): the one-token rows (plain decodes) in one session run, the rows at position 0 (first
prompt chunks) in another, and each multi-token row after a past (a later prompt chunk, a verify of a draft) in a
run of its own. A batch of plain decodes is one run; speculation's verifies are not batched yet.

A run binds the contiguous range of slots ``[lo, hi]`` that its rows name, batch row ``b`` being slot ``lo + b``
(a view of the buffers at an offset: nothing is gathered or copied). Shapes, with ``S`` the longest row's token
count and ``B = hi - lo + 1``::

    input_ids      [B, S]      each row's tokens, right-padded with id 0 to S
    attention_mask [B, total]  row b: ones over its first start_b + S positions, then zeros;
                               total = max_b(start_b + S); so GroupQueryAttention's seqlens_k[b] = start_b + S - 1
    position_ids   [B, S]      row b: start_b, start_b + 1, ..., start_b + S - 1
    logits         [B, S, vocab]  row b's first len(tokens_b) rows are its answer

``start_b`` is the slot's ``current_len``. A row's padding positions are computed and written to its KV past its
real length, then forgotten: afterwards the slot's length is ``start_b + len(tokens_b)``, and the next pass
overwrites them (causal attention means a real token never sees the padding after it). A slot inside the range
with no row (an *idle* slot) gets a row of padding at its own length, written likewise to stale positions; when
``length + S`` would pass the slot's capacity the row starts at ``max_length - S`` instead, and in a prefill run
it starts at 0: then the resident positions it overwrites are saved before the run and restored after it. So the
idle slots' KV is untouched (the batch driver's prefix reuse counts on it), and a run costs the rows of the range.
Without prefix reuse the batch driver keeps the range dense (it admits into the lowest free slot); with it, a
request goes to the slot holding its prefix, or an empty one before one holding a conversation, so the range can
spread over idle slots.

Why a range and not a gather: copying each row's resident KV into a ``[B, ...]`` buffer and back costs its whole
length per pass (46 KB per position for SmolLM2-135M fp32); the range costs nothing but the idle rows' compute.

Out of scope (refused with ``BackendError`` naming why): hybrid models (recurrent states), folders without the
shared-buffer layout, graphs without an ``attention_mask`` input; static shapes, CUDA graphs and the CUDA provider
(``ValueError``). Every contract violation raises ``BackendError`` (``check_batch``) before any slot changes; a
failure inside ONNX Runtime raises ``BackendError`` and leaves every slot's length and resident KV as it was.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from ..base import BackendError, BatchRow, check_batch, check_slot
from .config import BackendConfig
from .folder import ModelFolder
from .model_graph import DecoderGraph, LoadedGraph, inspect_graph, load_rewrites, read_graph_facts
from .session import execution_providers, open_session

CPU = "cpu"


def refusal(graph: DecoderGraph, folder: ModelFolder, config: BackendConfig) -> str | None:
    """Why ``OrtBatchBackend`` cannot run this graph as configured (None when it can)."""
    if graph.states:
        return "the graph carries a recurrent state (hybrid models are not batched yet)"
    if not graph.group_query_attention:
        return "the graph has no GroupQueryAttention op, which batching needs to append each row at its own length"
    wants_sharing = folder.past_present_share_buffer if config.share_buffer is None else bool(config.share_buffer)
    if not wants_sharing:
        return "past/present buffer sharing is off (search.past_present_share_buffer or share_buffer=False)"
    if graph.mask_name is None:
        return "the graph has no attention_mask input, so nothing would carry each row's length"
    return None


def _check_cpu_only(config: BackendConfig) -> None:
    if config.provider != CPU:
        raise ValueError(f"OrtBatchBackend runs on the CPU only, got provider={config.provider!r}")
    if config.static:
        raise ValueError("OrtBatchBackend has no static-shape or CUDA-graph path (static_shapes, cuda_graphs)")


class _PassInputs:
    """The host inputs of one session run over the bound slot range: ``ids`` ``[B, S]``, ``mask`` ``[B, total]``,
    ``positions`` ``[B, S]``, ``starts`` (each bound row's first written position) and ``keep`` (``[1]``: the last
    ``kept`` positions get logits; all ``S`` when the graph has no ``keep_name``)."""

    def __init__(self, graph: DecoderGraph, starts: np.ndarray, width: int, kept: int) -> None:
        count = len(starts)
        total = int(starts.max()) + width
        self.starts = starts
        self.width = width
        self.kept = kept if graph.keep_name is not None else width  # logits positions computed: the last ``kept``
        self.keep = np.array([self.kept], np.int64)
        self.ids = np.zeros((count, width), graph.ids_dtype)
        self.mask = (np.arange(total)[None, :] < (starts[:, None] + width)).astype(graph.mask_dtype or np.int64)
        self.positions = (starts[:, None] + np.arange(width)[None, :]).astype(graph.position_dtype or np.int64)


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


class OrtBatchBackend:
    """``slots`` KV caches of one decoder session, run by one pass over a ragged batch of rows (``BatchBackend``;
    see the module docstring). Public attributes: ``session``, ``folder``, ``config``, ``graph`` (the checked
    :class:`DecoderGraph`), ``threads`` (intra-op), ``keys`` / ``values`` (per layer, ``[slots, kv_heads,
    max_length, head_size]`` host arrays, owned here) and ``runs`` (session runs so far; a pass takes one or
    more). The logits that ``run_pass`` returns are views of the backend's buffer, valid until its next call."""

    def __init__(
        self, session, folder: ModelFolder, config: BackendConfig, slots: int, *, loaded: LoadedGraph | None = None
    ) -> None:
        """Wrap an open CPU ``session`` of ``folder``'s decoder with ``slots`` KV caches (see :meth:`from_folder`).
        ``ValueError`` for a bad ``slots`` or config; ``BackendError`` naming why the graph cannot be batched."""
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an int >= 1, got {slots!r}")
        _check_cpu_only(config)
        facts = loaded.facts if loaded is not None else read_graph_facts(folder.model_path)
        self.session = session
        self.folder = folder
        self.config = config
        self.graph = inspect_graph(session, folder, facts)
        why_not = refusal(self.graph, folder, config)
        if why_not:
            raise BackendError(f"{folder.model_path}: OrtBatchBackend cannot batch this model: {why_not}")
        self.threads = session.get_session_options().intra_op_num_threads
        self._max_length = config.capacity(folder.context_length)
        self._vocab = folder.vocab_size
        shape = (slots, folder.num_kv_heads, self._max_length, folder.head_size)
        self.keys = [np.zeros(shape, self.graph.kv_dtype) for _ in self.graph.kv_names]
        self.values = [np.zeros(shape, self.graph.kv_dtype) for _ in self.graph.kv_names]
        self._lengths = [0] * slots
        self._logits = np.empty(0, self.graph.logits_dtype)
        self._bindings: dict[tuple[int, int], Any] = {}  # (first slot, count) -> IO binding with the KV bound
        self.runs = 0

    @classmethod
    def from_folder(
        cls,
        folder_or_path: ModelFolder | str | os.PathLike[str],
        config: BackendConfig | None = None,
        *,
        slots: int = 8,
        session_options=None,
    ) -> OrtBatchBackend:
        """Open the decoder in a builder-written folder on the CPU as ``config`` says (default:
        ``BackendConfig()``), with ``slots`` KV caches of ``config.capacity`` positions each. ``session_options``:
        a ready ``onnxruntime.SessionOptions`` replacing the config's session settings. Errors as
        ``OrtBackend.from_folder``, plus ``ValueError`` for the CUDA provider or static shapes and ``BackendError``
        for a model that cannot be batched (module docstring)."""
        config = config if config is not None else BackendConfig()
        _check_cpu_only(config)
        folder = folder_or_path if isinstance(folder_or_path, ModelFolder) else ModelFolder.load(folder_or_path)
        config.capacity(folder.context_length)  # ValueError before any work
        loaded = load_rewrites(folder, config, keep_logits=True)
        options = session_options if session_options is not None else config.session_options(folder.session_options)
        providers = execution_providers(CPU, config.device_id)
        session = open_session(
            folder.model_path, providers=providers, session_options=options, model_bytes=loaded.model_bytes
        )
        return cls(session, folder, config, slots, loaded=loaded)

    # ------------------------------------------------------------------------------------------------------------
    # protocol
    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def slots(self) -> int:
        return len(self._lengths)

    def reset(self, slot: int) -> None:
        check_slot(slot, self.slots)
        self._lengths[slot] = 0

    def current_len(self, slot: int) -> int:
        check_slot(slot, self.slots)
        return self._lengths[slot]

    def rewind(self, slot: int, length: int) -> None:
        check_slot(slot, self.slots)
        held = self._lengths[slot]
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or not 0 <= length <= held:
            raise BackendError(f"rewind({slot}, {length!r}) but slot {slot} holds {held} positions")
        self._lengths[slot] = int(length)

    def run_pass(self, rows: Sequence[BatchRow]) -> list[np.ndarray]:
        """The rows' session runs (one per group: see the module docstring); returns each row's
        ``[len(tokens), vocab]`` float32 logits, views valid until the next call."""
        check_batch(rows, self)
        groups = pass_groups(rows)
        if len(groups) == 1:
            return self._run_group(groups[0].rows, groups[0].idle_at_zero)
        lengths = list(self._lengths)
        done: dict[int, np.ndarray] = {}
        try:
            for group in groups:
                outputs = self._run_group(group.rows, group.idle_at_zero)
                done.update((row.slot, out.copy()) for row, out in zip(group.rows, outputs, strict=True))
        except BaseException:
            self._lengths = lengths  # positions already written are past the lengths: forgotten
            raise
        return [done[row.slot] for row in rows]

    # ------------------------------------------------------------------------------------------------------------
    def _run_group(self, rows: Sequence[BatchRow], idle_at_zero: bool) -> list[np.ndarray]:
        """One session run over the checked ``rows`` of one group; idle slots of the bound range start at 0 when
        ``idle_at_zero`` (a prefill group: every row must start there), else at their own length."""
        lo = min(row.slot for row in rows)
        hi = max(row.slot for row in rows)
        width = max(len(row.tokens) for row in rows)
        # the last `kept` of the padded width's positions cover every row's wanted ones (row b's are its last
        # logits_rows real positions, which end at len(tokens_b) - 1)
        kept = max(width - len(row.tokens) + row.logits_rows for row in rows)
        in_pass = {row.slot for row in rows}
        starts = np.array(
            [
                self._lengths[slot] if slot in in_pass else self._idle_start(slot, width, idle_at_zero)
                for slot in range(lo, hi + 1)
            ],
            dtype=np.int64,
        )
        inputs = _PassInputs(self.graph, starts, width, kept)
        for row in rows:
            inputs.ids[row.slot - lo, : len(row.tokens)] = row.tokens
        saved = self._save_overwritten(lo, starts, width)
        try:
            logits = self._run(lo, inputs)
        finally:
            self._restore(saved)
        self.runs += 1
        for row in rows:
            self._lengths[row.slot] += len(row.tokens)
        skipped = width - inputs.kept  # positions before the first with logits
        return [
            logits[row.slot - lo, len(row.tokens) - row.logits_rows - skipped : len(row.tokens) - skipped]
            for row in rows
        ]

    def _idle_start(self, slot: int, width: int, at_zero: bool) -> int:
        """Where an idle slot's row of padding starts: 0 in a prefill group, else its length, moved back so that
        ``width`` positions fit its capacity."""
        return 0 if at_zero else min(self._lengths[slot], self._max_length - width)

    def _save_overwritten(self, lo: int, starts: np.ndarray, width: int) -> list[tuple[int, int, list[np.ndarray]]]:
        """Copies of the resident positions that idle rows starting below their slot's length will overwrite:
        ``(slot, start, per-buffer copies of [start, min(length, start + width)))`` for each such slot."""
        saved = []
        for offset, start in enumerate(starts.tolist()):
            slot = lo + offset
            end = min(self._lengths[slot], start + width)
            if start < end:
                copies = [buffer[slot, :, start:end].copy() for buffer in (*self.keys, *self.values)]
                saved.append((slot, start, copies))
        return saved

    def _restore(self, saved: list[tuple[int, int, list[np.ndarray]]]) -> None:
        for slot, start, copies in saved:
            for buffer, copy in zip((*self.keys, *self.values), copies, strict=True):
                buffer[slot, :, start : start + copy.shape[1]] = copy

    def _logits_view(self, count: int, width: int) -> np.ndarray:
        """A ``[count, width, vocab]`` view of the logits buffer (grown, never shrunk)."""
        size = count * width * self._vocab
        if self._logits.size < size:
            self._logits = np.empty(size, self.graph.logits_dtype)
        return self._logits[:size].reshape(count, width, self._vocab)

    def _range_binding(self, lo: int, count: int):
        """The IO binding of slots ``[lo, lo + count)`` with their KV views bound as past and present (made once
        per range, so a run rebinds only its inputs and logits)."""
        binding = self._bindings.get((lo, count))
        if binding is not None:
            return binding
        graph = self.graph
        binding = self.session.io_binding()
        for layer, names in enumerate(graph.kv_names):
            for past, present, buffer in (
                (names.past_key, names.present_key, self.keys[layer]),
                (names.past_value, names.present_value, self.values[layer]),
            ):
                view = buffer[lo : lo + count]
                shape = list(view.shape)
                binding.bind_input(past, CPU, 0, graph.kv_dtype, shape, view.ctypes.data)
                binding.bind_output(present, CPU, 0, graph.kv_dtype, shape, view.ctypes.data)
        self._bindings[lo, count] = binding
        return binding

    def _run(self, lo: int, inputs: _PassInputs) -> np.ndarray:
        """Bind the slot range starting at ``lo`` and ``inputs``, run the session, return the logits
        ``[B, kept, vocab]`` (of the last ``inputs.kept`` positions) as float32."""
        graph = self.graph
        count, width = inputs.ids.shape
        binding = self._range_binding(lo, count)
        binding.bind_input(graph.ids_name, CPU, 0, graph.ids_dtype, list(inputs.ids.shape), inputs.ids.ctypes.data)
        assert graph.mask_name is not None  # refusal() rejects a graph without one
        binding.bind_input(graph.mask_name, CPU, 0, graph.mask_dtype, list(inputs.mask.shape), inputs.mask.ctypes.data)
        if graph.position_name:
            shape = list(inputs.positions.shape)
            binding.bind_input(graph.position_name, CPU, 0, graph.position_dtype, shape, inputs.positions.ctypes.data)
        if graph.keep_name is not None:
            binding.bind_input(graph.keep_name, CPU, 0, np.int64, [1], inputs.keep.ctypes.data)
        logits = self._logits_view(count, inputs.kept)
        shape = list(logits.shape)
        binding.bind_output(graph.logits_name, CPU, 0, graph.logits_dtype, shape, logits.ctypes.data)
        if graph.hidden_name:
            binding.bind_output(graph.hidden_name, CPU)  # not read here; onnxruntime allocates it
        try:
            self.session.run_with_iobinding(binding)
        except Exception as exc:  # noqa: BLE001 - ORT raises its own exception types
            raise BackendError(f"onnxruntime failed on a batched pass of {count} x {width} tokens: {exc}") from exc
        return logits if logits.dtype == np.float32 else logits.astype(np.float32)

    def __repr__(self) -> str:
        return (
            f"OrtBatchBackend({str(self.folder.path)!r}, slots={self.slots}, max_length={self._max_length}, "
            f"lengths={self._lengths}, kv={self.graph.kv_dtype})"
        )
