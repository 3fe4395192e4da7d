"""``OrtBatchBackend``: the batched protocol (``BatchBackend`` in ``backends/base.py``) on an ONNX Runtime decoder
folder, on the CPU.

The KV of all slots lives in one buffer per layer for keys and one for values, ``[slots, kv_heads, max_length,
head_size]`` of the graph's KV dtype, bound as both ``past_key_values.N`` and ``present.N`` (the builder's
``past_present_share_buffer`` layout, on ``GroupQueryAttention``): the operator appends each row's new positions in
place, at the row's own length, which it reads from that row's ``attention_mask``.

**One pass, as few runs as pay.** ONNX Runtime's ``GroupQueryAttention`` (CPU, 1.32), as the builder wires it,
takes a batch of more than one row only when every row is one token or every row starts at position 0; for several
tokens after a past it refuses ("batch_size must be 1 when sequence_length > 1 and past context is given"). With
``BackendConfig.ragged_rows`` (the default where the graph and ONNX Runtime allow) the session runs the graph with
each row's query length (``ragged_rewrite.py``): rows of any lengths at any positions share a run, right-padded to
its widest, and ``run_pass`` groups them (:func:`ragged_groups`) to pad only where padding costs less than another
run. Without it (:func:`pass_groups`): the one-token rows (plain decodes) in one session run, the rows at position 0
(first prompt chunks) of one length in another, and each multi-token row after a past (a later prompt chunk, a
verify of a draft) in a run of its own. Either way a batch of plain decodes is one run.

A run binds the contiguous range of slots ``[lo, hi]`` that its rows name, batch row ``b`` being slot ``lo + b``
(a view of the buffers at an offset: nothing is gathered or copied). Shapes, with ``S`` the longest row's token
count and ``B = hi - lo + 1``::

    input_ids      [B, S]      each row's tokens, right-padded with id 0 to S
    attention_mask [B, total]  row b: ones over its first start_b + S positions, then zeros;
                               total = max_b(start_b + S); so GroupQueryAttention's seqlens_k[b] = start_b + S - 1
    position_ids   [B, S]      row b: start_b, start_b + 1, ..., start_b + S - 1
    logits         [B, S, vocab]  row b's first len(tokens_b) rows are its answer

``start_b`` is the slot's ``current_len``. Ragged (``ragged_rows``): row ``b``'s mask covers ``start_b +
len(tokens_b)`` positions and ``ortspec_query_lengths[b] = len(tokens_b)``, so only its real tokens are written and
attended; an *idle* slot inside the range (no row) gets a row of ``0`` tokens after one position, which writes
nothing. Otherwise a row's padding positions are computed and written to its KV past its real length, then
forgotten: afterwards the slot's length is ``start_b + len(tokens_b)``, and the next pass overwrites them (causal
attention means a real token never sees the padding after it); an idle slot gets a row of padding at its own
length, written likewise to stale positions; when
``length + S`` would pass the slot's capacity the row starts at ``max_length - S`` instead, and in a prefill run
it starts at 0: then the resident positions it overwrites are saved before the run and restored after it. So the
idle slots' KV is untouched (the batch driver's prefix reuse counts on it), and a run costs the rows of the range.
Without prefix reuse the batch driver keeps the range dense (it admits into the lowest free slot); with it, a
request goes to the slot holding its prefix, or an empty one before one holding a conversation, so the range can
spread over idle slots.

Why a range and not a gather: copying each row's resident KV into a ``[B, ...]`` buffer and back costs its whole
length per pass (``2 * layers * kv_heads * head_size`` values per position); the range costs nothing but the idle
rows' compute.

**Tree rows.** With ``BackendConfig.tree_rows`` the session runs the graph with the tree inputs
(``tree_rewrite.py``; ``pass_inputs.PassInputs`` feeds them, consecutive positions and a zero bias for ordinary
rows). A row with ``parents`` (a token tree, ``BatchRow``) runs after a past, each node at the row's position plus
its depth and seeing only what ``core.tree.tree_mask`` allows (the bias is per row, so with ``ragged_rows`` a tree
row shares a run with any other rows; without, it runs alone like every multi-token row after a past);
``keep_path`` then moves the accepted path's KV into place before the driver rewinds.

**The lone slot.** Beside its ``slots``, the backend keeps one more KV cache that no pass of ``run_pass`` can name:
:meth:`OrtBatchBackend.lone` is the one-sequence ``Backend`` protocol on it (``LoneSlot``), with its own logits
buffer, so an Engine can measure, check and generate one sequence on the same session (one copy of the weights)
while a batch driver runs the other slots, from another thread if need be (ONNX Runtime runs a session from several
threads; the two never write the same buffer).

Out of scope (refused with ``BackendError`` naming why): hybrid models (recurrent states), folders without the
shared-buffer layout, graphs without an ``attention_mask`` input; static shapes, CUDA graphs and the CUDA provider
(``ValueError``). Every contract violation raises ``BackendError`` (``check_batch``) before any slot changes; a
failure inside ONNX Runtime raises ``BackendError`` and leaves every slot's length and resident KV as it was.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..base import (
    BackendError,
    BatchRow,
    check_batch,
    check_position,
    check_slot,
    check_tokens,
    kept_path_moves,
)
from .arrays import ArrayModule, HostArrays
from .config import BackendConfig
from .folder import ModelFolder
from .graph_rewrites import LoadedGraph, load_rewrites
from .kv import KV_KINDS, move_rows
from .model_graph import DecoderGraph, inspect_graph, read_graph_facts
from .pass_inputs import Outputs, PassInputs, pass_groups, ragged_groups
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


class OrtBatchBackend:
    """``slots`` KV caches of one decoder session, run by one pass over a ragged batch of rows (``BatchBackend``;
    see the module docstring). Public attributes: ``session``, ``folder``, ``config``, ``graph`` (the checked
    :class:`DecoderGraph`), ``threads`` (intra-op), ``keys`` / ``values`` (per layer, ``[slots, kv_heads,
    max_length, head_size]`` host arrays, owned here) and ``runs`` (session runs so far; a pass takes one or
    more). The logits that ``run_pass`` returns are views of the backend's buffer, valid until its next call.

    For a shared-KV drafter bound to one slot (:meth:`slot_target`): ``hidden_row(slot, position)``, the hidden
    state a row that asked for them (``BatchRow.hidden_states``) computed, kept until the slot's next row, and
    ``kv_pointer(slot, layer, which, head)``, the address of a KV head of the slot inside the buffers."""

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
        self.graph_facts = facts  # what the graph holds (the quantized kernels' accuracy levels: Measurements)
        self.folder = folder
        self.config = config
        self.graph = inspect_graph(session, folder, facts)
        why_not = refusal(self.graph, folder, config)
        if why_not:
            raise BackendError(f"{folder.model_path}: OrtBatchBackend cannot batch this model: {why_not}")
        self.threads = session.get_session_options().intra_op_num_threads
        self.provider = CPU
        self.variant = "; ".join(["batched", *(loaded.rewrites if loaded is not None else ())])
        self._max_length = config.capacity(folder.context_length, batched=True)
        self._vocab = folder.vocab_size
        shape = (slots + 1, folder.num_kv_heads, self._max_length, folder.head_size)  # + the lone slot
        self.keys = [np.zeros(shape, self.graph.kv_dtype) for _ in self.graph.kv_names]
        self.values = [np.zeros(shape, self.graph.kv_dtype) for _ in self.graph.kv_names]
        self._slots = slots
        self._lengths = [0] * (slots + 1)  # the last is the lone slot's
        self._pass_outputs = Outputs.of(self.graph)
        self._lone_outputs = Outputs.of(self.graph)
        # per slot (the lone one too): the first position and the rows of the hidden states its last row kept
        self._hidden: dict[int, tuple[int, np.ndarray]] = {}
        self._bindings: dict[tuple[int, int], Any] = {}  # (first slot, count) -> IO binding with the KV bound
        self._lone: LoneSlot | None = None
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
        ``BackendConfig()``), with ``slots`` KV caches of ``config.capacity(..., batched=True)`` positions each
        (``max_length``, else the model's context up to ``SLOT_LENGTH``). ``session_options``:
        a ready ``onnxruntime.SessionOptions`` replacing the config's session settings. Errors as
        ``OrtBackend.from_folder``, plus ``ValueError`` for the CUDA provider or static shapes and ``BackendError``
        for a model that cannot be batched (module docstring)."""
        config = config if config is not None else BackendConfig()
        _check_cpu_only(config)
        folder = folder_or_path if isinstance(folder_or_path, ModelFolder) else ModelFolder.load(folder_or_path)
        config.capacity(folder.context_length)  # ValueError before any work
        loaded = load_rewrites(folder, config, keep_logits=True, trees=True, ragged=True)
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
        return self._slots

    def reset(self, slot: int) -> None:
        check_slot(slot, self.slots)
        self._lengths[slot] = 0
        self._hidden.pop(slot, None)

    def current_len(self, slot: int) -> int:
        check_slot(slot, self.slots)
        return self._lengths[slot]

    def rewind(self, slot: int, length: int) -> None:
        check_slot(slot, self.slots)
        held = self._lengths[slot]
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or not 0 <= length <= held:
            raise BackendError(f"rewind({slot}, {length!r}) but slot {slot} holds {held} positions")
        self._lengths[slot] = int(length)

    @property
    def tree_rows(self) -> bool:
        """Whether a row may be a token tree (``BatchRow.parents``): the graph was opened with the tree inputs
        (``BackendConfig.tree_rows``)."""
        return self.graph.tree_bias_name is not None

    @property
    def ragged_rows(self) -> bool:
        """Whether one session run carries rows of any lengths at any positions (the graph was opened with the
        query lengths, ``BackendConfig.ragged_rows``), so a draft row joins the pass's run (``batches_drafts``)."""
        return self.graph.query_lengths_name is not None

    def keep_path(self, slot: int, start: int, nodes: Sequence[int]) -> None:
        """After a tree row at ``start``, move the KV (and any kept hidden state) of position ``start + 1 +
        nodes[d]`` to ``start + 1 + d`` for each ``d`` (``backends/base.py``: ``BatchTreeRows``)."""
        check_slot(slot, self.slots)
        moves = kept_path_moves(start, nodes, self._lengths[slot])
        for source, target in moves:
            for buffer in (*self.keys, *self.values):
                buffer[slot, :, target] = buffer[slot, :, source]
        first, states = self._hidden.get(slot, (0, None))
        if states is not None:
            move_rows(states, first, moves)

    def run_pass(self, rows: Sequence[BatchRow]) -> list[np.ndarray]:
        """The rows' session runs (one per group: see the module docstring); returns each row's
        ``[len(tokens), vocab]`` float32 logits, views valid until the next call."""
        check_batch(rows, self)
        for row in rows:
            if row.parents is not None and row.position < 1:
                raise BackendError(f"the tree row of slot {row.slot} starts at position 0; a tree needs a past")
        if self.graph.hidden_name is None and any(row.hidden_states for row in rows):
            raise BackendError(f"{self.folder.model_path} has no hidden-states output, which a row asked for")
        groups = ragged_groups(rows, self._max_length) if self.ragged_rows else pass_groups(rows)
        if len(groups) == 1:  # views of the pass's buffers, in the order of ``rows``
            group = groups[0]
            outputs = self._run_group(group.rows, group.idle_at_zero)
            answers = dict(zip((row.slot for row in group.rows), outputs, strict=True))
            return [answers[row.slot] for row in rows]
        lengths = self._lengths[: self._slots]
        done: dict[int, np.ndarray] = {}
        try:
            for group in groups:
                outputs = self._run_group(group.rows, group.idle_at_zero)
                done.update((row.slot, out.copy()) for row, out in zip(group.rows, outputs, strict=True))
        except BaseException:
            self._lengths[: self._slots] = lengths  # positions already written are past the lengths: forgotten
            raise
        return [done[row.slot] for row in rows]

    # ------------------------------------------------------------------------------------------------------------
    def lone(self) -> LoneSlot:
        """The one-sequence ``Backend`` on the lone slot (module docstring); the same object every time."""
        if self._lone is None:
            self._lone = LoneSlot(self)
        return self._lone

    def _run_lone(self, tokens: Sequence[int], position: int, last_logits: int | None, what: str) -> np.ndarray:
        """One run of ``tokens`` at ``position`` in the lone slot (the protocol's checks first); its logits rows."""
        check_tokens(tokens, self._vocab)
        check_position(int(position), self._lengths[self._slots], len(tokens), self._max_length, what)
        hidden = self.graph.hidden_name is not None  # kept as views of the lone buffers: no copy
        row = BatchRow(self._slots, tokens, int(position), last_logits=last_logits, hidden_states=hidden)
        return self._run_group([row], False, self._lone_outputs)[0]

    def _run_group(
        self, rows: Sequence[BatchRow], idle_at_zero: bool, outputs: Outputs | None = None
    ) -> list[np.ndarray]:
        """One session run over the checked ``rows`` of one group; idle slots of the bound range start at 0 when
        ``idle_at_zero`` (a prefill group: every row must start there), else at their own length. ``outputs``: the
        buffers to write (the passes' unless given: then the hidden states a row keeps are copied out, since the
        pass's next group may overwrite them)."""
        lo = min(row.slot for row in rows)
        hi = max(row.slot for row in rows)
        width = max(len(row.tokens) for row in rows)
        # the last `kept` of the padded width's positions cover every row's wanted ones (row b's are its last
        # logits_rows real positions, which end at len(tokens_b) - 1)
        kept = max(width - len(row.tokens) + row.logits_rows for row in rows)
        in_pass = {row.slot: len(row.tokens) for row in rows}
        trees = {row.slot - lo: row.parents for row in rows if row.parents is not None}
        span = range(lo, hi + 1)
        if self.graph.query_lengths_name is not None:  # idle rows: one position held, none written
            valid = np.array([in_pass.get(slot, 0) for slot in span], dtype=np.int64)
            starts = np.array([self._lengths[slot] if slot in in_pass else 1 for slot in span], dtype=np.int64)
            inputs, saved = PassInputs(self.graph, starts, width, kept, trees, valid), []
        else:
            starts = np.array(
                [self._lengths[s] if s in in_pass else self._idle_start(s, width, idle_at_zero) for s in span],
                dtype=np.int64,
            )
            inputs = PassInputs(self.graph, starts, width, kept, trees)
            saved = self._save_overwritten(lo, starts, width)
        for row in rows:
            inputs.ids[row.slot - lo, : len(row.tokens)] = row.tokens
        try:
            out, hidden = self._run(lo, inputs, outputs if outputs is not None else self._pass_outputs)
        finally:
            self._restore(saved)
        self.runs += 1
        skipped = width - inputs.kept  # positions before the first with logits
        answers = []
        for row in rows:
            first = len(row.tokens) - row.logits_rows  # the row's first position with logits, from its start
            answers.append(out[row.slot - lo, first - skipped : len(row.tokens) - skipped])
            self._hidden.pop(row.slot, None)
            if row.hidden_states and hidden is not None:
                states = hidden[row.slot - lo, first - skipped : len(row.tokens) - skipped]
                self._hidden[row.slot] = (row.position + first, states if outputs is not None else states.copy())
            self._lengths[row.slot] += len(row.tokens)
        return answers

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

    def _run(self, lo: int, inputs: PassInputs, buffers: Outputs) -> tuple[np.ndarray, np.ndarray | None]:
        """Bind the slot range starting at ``lo`` and ``inputs``, run the session, return the logits
        ``[B, kept, vocab]`` (of the last ``inputs.kept`` positions) as float32 and the hidden states of the same
        positions ``[B, kept, hidden]`` (None when the graph has none)."""
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
        if inputs.query_lengths is not None:
            assert graph.query_lengths_name is not None
            lengths = inputs.query_lengths
            binding.bind_input(graph.query_lengths_name, CPU, 0, np.int32, [count], lengths.ctypes.data)
        if inputs.tree_positions is not None and inputs.tree_bias is not None:
            assert graph.tree_positions_name is not None and graph.tree_bias_name is not None
            positions, bias = inputs.tree_positions, inputs.tree_bias
            shape = list(positions.shape)
            binding.bind_input(graph.tree_positions_name, CPU, 0, np.int64, shape, positions.ctypes.data)
            binding.bind_input(graph.tree_bias_name, CPU, 0, bias.dtype, list(bias.shape), bias.ctypes.data)
        logits = buffers.logits.view(count, inputs.kept, self._vocab)
        shape = list(logits.shape)
        binding.bind_output(graph.logits_name, CPU, 0, graph.logits_dtype, shape, logits.ctypes.data)
        hidden = None
        if graph.hidden_name and buffers.hidden is not None:
            # without the keep_logits rewrite the output holds every position: kept == width then
            hidden = buffers.hidden.view(count, inputs.kept, graph.hidden_size)
            shape = list(hidden.shape)
            binding.bind_output(graph.hidden_name, CPU, 0, graph.hidden_dtype, shape, hidden.ctypes.data)
        try:
            self.session.run_with_iobinding(binding)
        except Exception as exc:  # noqa: BLE001 - ORT raises its own exception types
            raise BackendError(f"onnxruntime failed on a batched pass of {count} x {width} tokens: {exc}") from exc
        return (logits if logits.dtype == np.float32 else logits.astype(np.float32)), hidden

    # ------------------------------------------------------------------------------------------------------------
    # a slot as a shared-KV drafter's target
    @property
    def hidden_size(self) -> int:
        """Width of a hidden state (0: the graph has no hidden-states output)."""
        return self.graph.hidden_size

    @property
    def hidden_features(self) -> tuple[int, ...]:
        """The layers whose residual streams follow the final state in a hidden row (``BackendConfig``)."""
        return self.config.hidden_features

    def slot_target(self, slot: int) -> SlotTarget:
        """``slot`` (``slots`` names the lone slot) as a shared-KV drafter's target (:class:`SlotTarget`)."""
        self._check_any_slot(slot)
        return SlotTarget(self, slot)

    def hidden_row(self, slot: int, position: int) -> np.ndarray:
        """The final hidden state at ``position`` that ``slot``'s last row computed and kept (it asked for them:
        ``BatchRow.hidden_states``; the lone slot's rows always do), ``[hidden_size]`` of ``graph.hidden_dtype``,
        valid until the slot's next row; ``BackendError`` for a position that row did not keep or past the
        slot's length."""
        self._check_any_slot(slot)
        first, rows = self._hidden.get(slot, (0, np.empty((0, 0))))
        if not first <= position < min(first + len(rows), self._lengths[slot]):
            raise BackendError(
                f"hidden_row({slot}, {position}): the slot's last row kept the hidden states of positions "
                f"[{first}, {first + len(rows)}) and the slot holds {self._lengths[slot]}"
            )
        return rows[position - first]

    def kv_pointer(self, slot: int, layer: int, which: str, head: int) -> int:
        """The address of KV head ``head`` of ``layer`` (``which``: ``"key"`` or ``"value"``) of ``slot`` at
        position 0, inside the batch buffers: ``[max_length, head_size]`` elements of ``graph.kv_dtype``, the first
        ``current_len(slot)`` valid and contiguous. ``ValueError`` for a bad index."""
        self._check_any_slot(slot)
        heads = self.folder.num_kv_heads
        if not 0 <= layer < len(self.keys) or not 0 <= head < heads or which not in KV_KINDS:
            raise ValueError(
                f"kv_pointer({slot}, {layer}, {which!r}, {head}): expected layer in [0, {len(self.keys)}), which "
                f"'key' or 'value', head in [0, {heads})"
            )
        return int((self.keys if which == "key" else self.values)[layer][slot, head].ctypes.data)

    def _check_any_slot(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) or not 0 <= slot <= self._slots:
            raise ValueError(f"slot must be an int in [0, {self._slots}] ({self._slots}: the lone slot), got {slot!r}")

    def __repr__(self) -> str:
        return (
            f"OrtBatchBackend({str(self.folder.path)!r}, slots={self.slots}, max_length={self._max_length}, "
            f"lengths={self._lengths}, kv={self.graph.kv_dtype})"
        )


class LoneSlot:
    """The one-sequence ``Backend`` protocol (``backends/base.py``) on an ``OrtBatchBackend``'s lone slot: what an
    Engine opened for batching measures and generates on, with the batch backend's session (no second copy of
    the weights). ``decode`` asks the run for its last position's logits only. Attributes for the Engine's
    measurement cache: ``provider``, ``threads``, ``variant`` and ``graph_facts`` (the batch backend's)."""

    def __init__(self, batch: OrtBatchBackend) -> None:
        self.batch = batch
        self.provider, self.threads, self.variant = batch.provider, batch.threads, batch.variant
        self.graph_facts = batch.graph_facts

    @property
    def vocab_size(self) -> int:
        return self.batch.vocab_size

    @property
    def max_length(self) -> int:
        return self.batch.max_length

    def reset(self) -> None:
        self.batch._lengths[self.batch.slots] = 0
        self.batch._hidden.pop(self.batch.slots, None)

    def current_len(self) -> int:
        return self.batch._lengths[self.batch.slots]

    def decode(self, tokens: Sequence[int], past: int) -> np.ndarray:
        return self.batch._run_lone(tokens, past, 1, "past")[-1]

    def decode_verify(self, tokens: Sequence[int], base: int) -> np.ndarray:
        return self.batch._run_lone(tokens, base, None, "base")

    def rewind(self, length: int) -> None:
        held = self.current_len()
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or not 0 <= length <= held:
            raise BackendError(f"cannot rewind the lone slot to {length!r}: it holds {held} positions")
        self.batch._lengths[self.batch.slots] = int(length)

    def __repr__(self) -> str:
        return f"LoneSlot({self.batch!r})"


class SlotTarget:
    """One slot of an ``OrtBatchBackend`` (the lone one too) as what a shared-KV drafter reads
    (``backends/onnx/drafter.py``'s ``SharedKvTarget``): the slot's length, the hidden states its last row kept
    (``BatchRow.hidden_states``) and the address of each of its KV heads inside the batch's buffers (layer ``l``'s
    ``[slots + 1, kv_heads, max_length, head_size]``: head ``h`` of slot ``s`` starts at ``[s, h, 0]``). A view:
    it owns nothing, and another slot's rows never change what it reads."""

    def __init__(self, batch: OrtBatchBackend, slot: int) -> None:
        self.batch = batch
        self.slot = slot
        self.folder = batch.folder
        self.provider = CPU
        self.device_id = batch.config.device_id
        self.device_type = CPU
        self.array_module: ArrayModule = HostArrays(batch.config.device_id)

    @property
    def vocab_size(self) -> int:
        return self.batch.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.batch.hidden_size

    @property
    def hidden_features(self) -> tuple[int, ...]:
        return self.batch.hidden_features

    @property
    def kv_dtype(self) -> np.dtype:
        return self.batch.graph.kv_dtype

    def current_len(self) -> int:
        return self.batch._lengths[self.slot]

    def hidden_row(self, position: int) -> np.ndarray:
        return self.batch.hidden_row(self.slot, position)

    def kv_pointer(self, layer: int, which: str, head: int) -> int:
        return self.batch.kv_pointer(self.slot, layer, which, head)

    def __repr__(self) -> str:
        return f"SlotTarget(slot={self.slot}, {self.batch!r})"
