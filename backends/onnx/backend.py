"""``OrtBackend``: the backend protocol (see ``backends/base.py``) on an ONNX Runtime decoder folder.

The folder is the one the onnxruntime-genai model builder writes (``model.onnx`` + ``genai_config.json``), used
as is. One ``InferenceSession`` runs with IO binding:

* **KV cache.** One preallocated buffer per layer for keys and one for values, ``[1, kv_heads, max_length,
  head_size]``. When the graph's attention is ``GroupQueryAttention`` and the config asks for
  ``past_present_share_buffer``, ``past_key_values.N`` and ``present.N`` are bound to the *same* buffer: the
  operator appends the new positions in place and reads the length from ``attention_mask`` (ones, shape
  ``[1, total_len]``). Then ``rewind`` only changes an integer and a step allocates and copies nothing
  KV-sized. Otherwise (another attention op, or sharing turned off) a grow/copy path feeds the first
  ``current_len()`` positions as their own tensors and copies the new ones back after each run; it is correct but
  slower, and logged once.
* **Recurrent state** (hybrid models such as LFM2, whose ``conv`` layers carry a state instead of a KV cache):
  two buffers per state, bound as past and present in turn, so the state before the last pass survives it.
  ``rewind`` into the last pass restores that state and replays the kept tokens (one pass over them); a rewind
  further back replays from the start. Speculation stays exact; a partly accepted draft costs one extra pass.
* **Load-time rewrites** (:meth:`from_folder`): a folder whose ``genai_config.json`` names a sliding window
  that its graph's attention nodes ignore gets the window applied (``sliding_window="config"``, the default) or
  runs as written (``"graph"``); ``matmul_accuracy_level`` sets every ``MatMulNBits`` node's accuracy level
  (1: float32 compute, which makes a quantized model's verify passes agree with its one-token decodes).
* **Logits.** Bound to a preallocated ``[rows, vocab]`` buffer (``rows`` = the prefill chunk, 256 by default,
  grown once if ``decode_verify`` is asked for more rows), so nothing vocab-sized is allocated per step. Prompts
  longer than a chunk are prefilled chunk by chunk.
* **Hidden states.** When the graph has the ``hidden_states`` output (the builder's ``include_hidden_states=true``
  extra option; ``ortspec convert`` sets it), it is bound to a preallocated ``[rows, hidden]`` buffer too, and the
  backend offers the ``HiddenStates`` capability: ``hidden_at(position)`` for a position of the last pass (a
  host float32 row), and for a drafter on the same device ``hidden_pointer(position)`` (the row's address) and
  ``kv_pointer(layer, which, head)`` (the address of one KV head's first position; its first ``current_len()``
  positions are contiguous). Without the output ``hidden_size`` is 0 and those raise ``BackendError``.
* **CUDA.** ``provider="cuda"`` keeps the KV, the inputs and the logits in device memory (CuPy arrays, or torch
  CUDA tensors where CuPy is missing), binds them by pointer, and copies to the host only the rows asked for;
  ``verify_picks`` reduces each row to its argmax and top-1/top-2 margin on the device. float16 rows asked for on
  the host are converted in a preallocated float32 device buffer (no allocation per step).
* **Static shapes** (``static_shapes=True``, off by default; needs the shared-buffer GroupQueryAttention path):
  ``attention_mask`` is bound as ``[1, max_length]`` and the length is carried by its values (ones, then zeros):
  the builder's graph feeds GroupQueryAttention ``seqlens_k = ReduceSum(mask) - 1`` and ``total_sequence_length =
  Shape(mask)[1]``, and with the KV buffer bound as both past and present the op reads the real length from
  ``seqlens_k`` (it takes the rotary positions from it too). Ids (and position ids, for graphs that take them) go
  to fixed buffers, and each pass width keeps its own IO binding, so every pass of a width has identical shapes
  and addresses. On the CPU the logits are bit for bit those of the default binding (tested). On CUDA this path
  also runs ONNX Runtime on the array module's own stream (``user_compute_stream``) with the run-config entry
  ``disable_synchronize_execution_providers=1``: the host never waits for the device except when it reads the
  picks or rows back (and, with graphs, inside ONNX Runtime's graph replay, which synchronises its stream).
  Inputs are staged in page-locked memory, indexed by position, so chunked prefill never overwrites a staged
  chunk before the device has copied it.
* **CUDA graphs** (``cuda_graphs=True``, CUDA only, off by default; implies static shapes): the session is opened
  with ``enable_cuda_graph=1`` and each pass width of up to ``graph_max_tokens`` tokens (the pending token plus up
  to 16 draft tokens by default) gets its own graph id (``graphs.GraphBook``); greedy steps are width 1. Wider
  passes (prefill chunks) run eagerly. :meth:`OrtBackend.capture_graphs` warms up and captures every width up
  front. When ONNX Runtime refuses graph capture for the session, or a run with a graph id fails, the backend logs
  why, reopens its session without graphs (same buffers, same stream) and carries on eagerly.
  **The static-shape and graph paths on CUDA are written but not yet run on a GPU** (see ``scripts/gpu_check.sh``).
* **Timing.** ``timer`` (None by default) takes a ``graphs.PhaseTimer`` that adds up each pass's host work,
  session run, explicit syncs and read-back.

Errors: every contract violation raises ``BackendError`` before any state changes; a failure inside ONNX Runtime
also raises ``BackendError`` and leaves ``current_len()`` where it was (positions past it are never read).

The parts: ``folder`` reads the model folder, ``session`` opens the session, ``graph`` checks the graph against
the folder, ``arrays`` holds the buffers of each device and the argmax/margin reductions.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from ..base import BackendError, check_position, check_tokens
from .arrays import ArrayModule, HostArrays, cuda_arrays
from .folder import CONFIG_NAME, ModelFolder
from .graph import GraphFacts, inspect_graph, read_graph_facts, rewritten_model
from .graphs import EAGER, GraphBook, PhaseTimer
from .session import cuda_provider_options, execution_providers, make_session_options, open_session

logger = logging.getLogger(__name__)
R = TypeVar("R")

DEFAULT_PREFILL_CHUNK = 256
DEFAULT_GRAPH_MAX_TOKENS = 17  # the pending token + up to 16 draft tokens (the cost-aware width policy's widest)


SLIDING_WINDOW_POLICIES = ("config", "graph")


def window_rewrites(folder: ModelFolder, facts: GraphFacts, max_length: int, policy: str) -> dict[str, int]:
    """The ``local_window_size`` to set per attention node (by its past-key input) so that the graph applies the
    sliding window ``genai_config.json`` names: for every layer the config's ``sliding_window.layers`` lists
    (every KV layer when it lists none) whose ``GroupQueryAttention`` node attends to everything. Empty when the
    window cannot matter (``max_length`` <= the window) or ``policy`` is ``"graph"``. Raises ``BackendError``
    when the graph sets a different window, or has no such node to set it on."""
    if policy not in SLIDING_WINDOW_POLICIES:
        raise ValueError(f"sliding_window must be one of {SLIDING_WINDOW_POLICIES}, got {policy!r}")
    window = folder.sliding_window
    if window is None or policy == "graph" or max_length <= window:
        return {}
    config = folder.path / CONFIG_NAME
    layers = folder.sliding_window_layers or folder.kv_layers
    rewrites: dict[str, int] = {}
    for layer in layers:
        past_key = folder.past_key_pattern % layer
        graph_window = facts.window_of(past_key)
        if graph_window is None:
            raise BackendError(
                f"{config}: model.decoder.sliding_window.window_size = {window} (layer {layer}), but "
                f"{folder.model_path} has no GroupQueryAttention node reading {past_key!r} to apply it to; pass "
                f"sliding_window='graph' to run the graph as written, or max_length <= {window}"
            )
        if graph_window > 0 and graph_window != window:
            raise BackendError(
                f"{config}: model.decoder.sliding_window.window_size = {window}, but {folder.model_path}'s "
                f"GroupQueryAttention on layer {layer} has local_window_size = {graph_window}; pass "
                f"sliding_window='graph' to run the graph as written, or max_length <= {min(window, graph_window)}"
            )
        if graph_window <= 0:
            rewrites[past_key] = window
    if rewrites:
        logger.warning(
            "%s: model.decoder.sliding_window.window_size = %d, but %s's GroupQueryAttention nodes have "
            "local_window_size = -1 (full attention) on %d layer(s); applying the window of %d at load "
            "(sliding_window='graph' runs the graph as written)",
            config,
            window,
            folder.model_path,
            len(rewrites),
            window,
        )
    return rewrites


class OrtBackend:
    """One sequence's KV cache and decoder session on ONNX Runtime (CPU or CUDA execution provider).

    Public attributes: ``session`` (the ``InferenceSession``), ``folder`` (its :class:`ModelFolder`), ``graph``
    (the checked :class:`~ortspec.backends.onnx.graph.DecoderGraph`), ``provider`` (``"cpu"`` or ``"cuda"``),
    ``prefill_chunk``, ``threads`` (intra-op), ``share_buffer`` (True: the in-place KV path),
    ``picks_on_device`` (the ``DevicePicks`` capability: True on CUDA), ``static_shapes``, ``stream_ordered``
    (CUDA: ONNX Runtime runs on the array module's stream and nothing waits for the device but the read-back),
    ``graphs`` (a :class:`~ortspec.backends.onnx.graphs.GraphBook`, or None without CUDA graphs), ``timer``
    (None, or a :class:`~ortspec.backends.onnx.graphs.PhaseTimer`), ``stateful`` (the graph carries a recurrent
    state: a rewind replays tokens), ``graph_facts`` (what the graph file says beyond its interface: attention
    windows, MatMulNBits accuracy levels), ``rewrites`` (the load-time rewrites applied, in words) and ``variant``
    (those and the session config entries given, in one string: "" for the folder as written). The backend owns
    its buffers: the logits that ``decode`` and ``decode_verify`` return are views of them, valid until its next
    call."""

    def __init__(
        self,
        session,
        folder: ModelFolder,
        *,
        provider: str = "cpu",
        device_id: int = 0,
        max_length: int | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        share_buffer: bool | None = None,
        array_module: str | ArrayModule = "auto",
        static_shapes: bool = False,
        cuda_graphs: bool = False,
        graph_max_tokens: int = DEFAULT_GRAPH_MAX_TOKENS,
        stream_ordered: bool = False,
        reopen_session: Callable[[], Any] | None = None,
        facts: GraphFacts | None = None,
        rewrites: tuple[str, ...] = (),
        config_entries: Mapping[str, str] | None = None,
    ) -> None:
        """Wrap an open ``session`` of ``folder``'s decoder (see :meth:`from_folder`, which opens one).

        ``array_module``: a name (``"cupy"``, ``"torch"``, ``"auto"``; CUDA only) or a ready array module.
        ``static_shapes`` / ``cuda_graphs``: see the module docstring (``cuda_graphs`` implies ``static_shapes``;
        the session must have been opened with ``enable_cuda_graph=1`` for graphs to be captured: it is then given
        a ``gpu_graph_id`` per pass width). ``stream_ordered``: the session runs on the array module's stream
        (opened with ``user_compute_stream`` = its ``stream_ptr()``), so no host synchronisation is needed around
        runs; only meaningful with ``static_shapes`` on CUDA. ``reopen_session``: opens the same model without
        CUDA graphs (the fallback when graphs fail); without it a graph failure raises ``BackendError``.
        ``facts``: the session's graph as ``read_graph_facts`` reads it (default: read from
        ``folder.model_path``); ``rewrites`` and ``config_entries``: what ``from_folder`` changed (for
        ``variant``)."""
        import onnxruntime as ort

        self._ort = ort
        self.session = session
        self.folder = folder
        self.provider = provider
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.prefill_chunk = int(prefill_chunk)
        context_length = folder.context_length
        if max_length is None:
            max_length = context_length
        if not 1 <= max_length <= context_length:
            raise ValueError(
                f"max_length must be in [1, {context_length}] (the model's context_length), got {max_length}"
            )
        if graph_max_tokens < 1:
            raise ValueError(f"graph_max_tokens must be >= 1, got {graph_max_tokens}")
        self._max_length = int(max_length)
        self._vocab = folder.vocab_size
        self._len = 0
        # DevicePicks: the driver asks for picks (verify_picks) when the logits live on a device.
        self.picks_on_device = provider == "cuda"
        self.threads = session.get_session_options().intra_op_num_threads
        self.timer: PhaseTimer | None = None

        self.graph_facts = facts if facts is not None else read_graph_facts(folder.model_path)
        self.graph = inspect_graph(session, folder, self.graph_facts)
        self.rewrites = tuple(rewrites)
        # what makes this session compute differently from the folder as written ("" when nothing does)
        self.variant = "; ".join(
            [*self.rewrites, *(f"{key}={value}" for key, value in sorted(dict(config_entries or {}).items()))]
        )
        self.stateful = bool(self.graph.states)
        wants_sharing = folder.past_present_share_buffer if share_buffer is None else bool(share_buffer)
        self.share_buffer = wants_sharing and self.graph.group_query_attention
        if not self.share_buffer:
            why = (
                "the graph has no GroupQueryAttention op"
                if wants_sharing
                else "past/present buffer sharing is off (search.past_present_share_buffer or share_buffer=False)"
            )
            logger.warning(
                "OrtBackend(%s): %s; using the grow/copy KV path (slower, copies the KV each step)", folder.path, why
            )
        self.static_shapes = bool(static_shapes or cuda_graphs)
        if self.static_shapes:
            why_not = static_shapes_unsupported(self.graph, self.share_buffer)
            if why_not:
                raise BackendError(f"{folder.model_path}: static shapes are not possible: {why_not}")

        if isinstance(array_module, str):
            self._arrays: ArrayModule = (
                HostArrays(device_id) if provider == "cpu" else cuda_arrays(device_id, array_module)
            )
        else:
            self._arrays = array_module
        self._device_type = self._arrays.device_type
        self._device_id = device_id
        self.stream_ordered = bool(stream_ordered and self.static_shapes and self._device_type != "cpu")
        self.graphs: GraphBook | None = GraphBook(graph_max_tokens) if cuda_graphs else None
        self._reopen = reopen_session
        arrays, graph = self._arrays, self.graph
        # per layer, [1, kv_heads, max_length, head_size] of graph.kv_dtype; positions >= current_len() are stale
        self._kv_shape = (1, folder.num_kv_heads, self._max_length, folder.head_size)
        self._keys = [arrays.zeros(self._kv_shape, graph.kv_dtype) for _ in graph.kv_names]
        self._values = [arrays.zeros(self._kv_shape, graph.kv_dtype) for _ in graph.kv_names]
        # recurrent states: a pair of buffers each; _state_cur says which holds the state after current_len()
        # positions; the other holds the state after _snapshot_len positions (None: nothing usable)
        self._states = [[arrays.zeros((1, *st.shape), st.dtype) for _ in range(2)] for st in graph.states]
        self._state_cur = 0
        self._snapshot_len: int | None = None
        self._history = np.zeros(self._max_length if self.stateful else 0, np.int64)  # the tokens at each position
        self._ids_host = np.empty(0, graph.ids_dtype)
        # [max_length] ones and 0..max_length-1: a pass binds the prefix (mask) or the slice at its position
        self._mask = arrays.from_host(np.ones(self._max_length, graph.mask_dtype)) if graph.mask_name else None
        self._positions = (
            arrays.from_host(np.arange(self._max_length, dtype=graph.position_dtype)) if graph.position_name else None
        )
        # HiddenStates: the hidden rows of the last pass, for positions [start, start + count); (0, 0) when none
        self.hidden_size = graph.hidden_size
        self._hidden_rows = (0, 0)
        self._hidden_host = np.empty(max(graph.hidden_size, 1), np.float32)
        self._positions_fixed: Any = None  # the static path's position ids, for graphs that take them
        if self.static_shapes:
            self._init_static()
        self._rows = 0
        first_rows = max(self.prefill_chunk, graph_max_tokens if cuda_graphs else 1)
        self._alloc_rows(first_rows)
        self._bind_session()

    def _bind_session(self) -> None:
        """A fresh IO binding of the session with the shared KV buffers bound (the default path), and an empty
        cache of per-width static bindings."""
        self._binding = self.session.io_binding()
        self._passes: dict[int, _StaticPass] = {}
        if self.share_buffer:
            self._bind_kv(self._binding)

    def _bind_row_outputs(self, binding, count: int) -> None:
        """Bind the per-row outputs of a pass of ``count`` tokens: the logits, and the hidden states when the graph
        has them, to the preallocated row buffers."""
        arrays, graph, device, device_id = self._arrays, self.graph, self._device_type, self._device_id
        binding.bind_output(
            graph.logits_name, device, device_id, graph.logits_dtype, [1, count, self._vocab], arrays.ptr(self._logits)
        )
        if graph.hidden_name:
            shape = [1, count, graph.hidden_size]
            binding.bind_output(
                graph.hidden_name, device, device_id, graph.hidden_dtype, shape, arrays.ptr(self._hidden)
            )

    def _bind_kv(self, binding) -> None:
        """Bind each layer's KV buffers to ``binding`` as both the past input and the present output."""
        arrays, graph, device_id = self._arrays, self.graph, self._device_id
        shape = list(self._kv_shape)
        for layer, names in enumerate(graph.kv_names):
            for past_name, present_name, buffer in (
                (names.past_key, names.present_key, self._keys[layer]),
                (names.past_value, names.present_value, self._values[layer]),
            ):
                address = arrays.ptr(buffer)
                binding.bind_input(past_name, self._device_type, device_id, graph.kv_dtype, shape, address)
                binding.bind_output(present_name, self._device_type, device_id, graph.kv_dtype, shape, address)

    # ------------------------------------------------------------------------------------------------------------
    @classmethod
    def from_folder(
        cls,
        folder_or_path: ModelFolder | str | os.PathLike[str],
        *,
        provider: str = "cpu",
        threads: int | None = None,
        max_length: int | None = None,
        device_id: int = 0,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        share_buffer: bool | None = None,
        session_options=None,
        graph_optimization_level: str = "all",
        allow_spinning: bool | None = None,
        config_entries: Mapping[str, str] | None = None,
        array_module: str = "auto",
        static_shapes: bool = False,
        cuda_graphs: bool = False,
        graph_max_tokens: int = DEFAULT_GRAPH_MAX_TOKENS,
        sliding_window: str = "config",
        matmul_accuracy_level: int | None = None,
    ) -> OrtBackend:
        """Open the decoder in a builder-written folder.

        ``provider``: ``"cpu"`` or ``"cuda"``. ``threads``: intra-op threads (default: physical cores).
        ``max_length``: KV capacity (default and maximum: the model's ``context_length``). ``share_buffer``:
        force the grow/copy KV path with ``False`` (default: the folder's ``past_present_share_buffer``).
        ``session_options``: a ready ``onnxruntime.SessionOptions`` that replaces all the option arguments.
        ``array_module`` (CUDA only): ``"cupy"``, ``"torch"`` or ``"auto"`` (CuPy, else torch).
        ``static_shapes`` (off by default): fixed-shape binding (module docstring); on CUDA it also runs the session
        on the array module's own stream without host synchronisation around runs. ``cuda_graphs`` (CUDA only, off
        by default; implies ``static_shapes``): one captured CUDA graph per pass width up to ``graph_max_tokens``
        tokens, with an eager fallback when ONNX Runtime cannot capture. The CUDA parts of both are not yet run on a
        GPU. ``sliding_window``: ``"config"`` applies the sliding window that ``genai_config.json`` names where the
        graph's attention ignores it (see :func:`window_rewrites`; logged), ``"graph"`` runs the graph as written.
        ``matmul_accuracy_level``: set every ``MatMulNBits`` node's ``accuracy_level`` (1 = float32 compute: a
        verify pass then agrees with one-token decodes; 4 = int8 activations, faster on CPU but batch-dependent);
        None keeps the graph's.
        A folder problem raises ``ModelFolderError`` naming the file and the key or tensor (``ModelFileError``,
        also a ``BackendError``, for the model file); another session problem ``BackendError``; a bad argument
        ``ValueError``.
        """
        import onnxruntime  # noqa: F401 - fail here, before any work, when it is missing

        folder = folder_or_path if isinstance(folder_or_path, ModelFolder) else ModelFolder.load(folder_or_path)
        provider = provider.lower()
        if provider not in ("cpu", "cuda"):
            raise ValueError(f"provider must be 'cpu' or 'cuda', got {provider!r}")
        if cuda_graphs and provider != "cuda":
            raise ValueError("cuda_graphs=True needs provider='cuda'")
        if matmul_accuracy_level is not None and matmul_accuracy_level not in (0, 1, 2, 3, 4):
            raise ValueError(f"matmul_accuracy_level must be 0..4 or None, got {matmul_accuracy_level!r}")
        if max_length is not None and not 1 <= max_length <= folder.context_length:
            raise ValueError(
                f"max_length must be in [1, {folder.context_length}] (the model's context_length), got {max_length}"
            )
        facts = read_graph_facts(folder.model_path)
        windows = window_rewrites(folder, facts, max_length or folder.context_length, sliding_window)
        rewrites = [f"local_window_size={w} on the attention reading {name}" for name, w in windows.items()]
        levels = {level for (_, level) in facts.matmul_nbits}
        set_level = matmul_accuracy_level is not None and levels and levels != {matmul_accuracy_level}
        if set_level:
            rewrites.append(f"MatMulNBits accuracy_level {sorted(levels)} -> {matmul_accuracy_level}")
        model_bytes = None
        if windows or set_level:
            model_bytes, facts = rewritten_model(
                folder.model_path, windows=windows, accuracy_level=matmul_accuracy_level if set_level else None
            )
        options = session_options
        if options is None:
            options = make_session_options(
                threads=threads,
                graph_optimization_level=graph_optimization_level,
                allow_spinning=allow_spinning,
                config_entries=config_entries,
                genai_session_options=folder.session_options,
            )
        static = bool(static_shapes or cuda_graphs)
        backend_for = functools.partial(
            cls,
            folder=folder,
            provider=provider,
            device_id=device_id,
            max_length=max_length,
            prefill_chunk=prefill_chunk,
            share_buffer=share_buffer,
            facts=facts,
            rewrites=tuple(rewrites),
            config_entries=config_entries,
        )
        if provider == "cpu" or not static:
            session = open_session(
                folder.model_path,
                providers=execution_providers(provider, device_id),
                session_options=options,
                model_bytes=model_bytes,
            )
            return backend_for(session, array_module=array_module, static_shapes=static)
        # CUDA, stream-ordered: the array module's own stream becomes ONNX Runtime's compute stream.
        arrays = cuda_arrays(device_id, array_module)
        stream = arrays.own_stream()

        def open_cuda(graphs: bool):
            providers = execution_providers(
                provider, device_id, cuda_provider_options(stream=stream, cuda_graphs=graphs)
            )
            return open_session(
                folder.model_path, providers=providers, session_options=options, model_bytes=model_bytes
            )

        refused = None
        if cuda_graphs:
            try:
                session = open_cuda(True)
            except BackendError as exc:  # e.g. "cannot use the graph capture feature": nodes off the CUDA EP
                refused = str(exc)
                logger.warning("OrtBackend: CUDA graphs refused (%s); running eagerly", refused.splitlines()[0])
                session = open_cuda(False)
        else:
            session = open_cuda(False)
        backend = backend_for(
            session,
            array_module=arrays,
            static_shapes=True,
            cuda_graphs=cuda_graphs,
            graph_max_tokens=graph_max_tokens,
            stream_ordered=True,
            reopen_session=(lambda: open_cuda(False)) if cuda_graphs else None,
        )
        if backend.graphs is not None and refused is not None:
            backend.graphs.disable(f"session refused graph capture: {refused}")
        return backend

    def _alloc_rows(self, rows: int) -> None:
        """(Re)allocate the per-pass buffers for up to ``rows`` tokens: ids (host, and device on CUDA), logits
        ``[rows, vocab]`` in the graph's dtype, and the host float32 logits handed out (the logits buffer itself
        when it is already a float32 host array). Growing moves the buffers, so static bindings are dropped and
        captured CUDA graphs (which write to the old addresses) are given up first."""
        if rows <= self._rows:
            return
        if self._rows:
            logger.info("OrtBackend: growing the logits buffer from %d to %d rows", self._rows, rows)
            if self.graphs is not None and self.graphs.enabled:
                self._give_up_graphs(f"the logits buffer grew from {self._rows} to {rows} rows")
            self._passes = {}
        arrays, graph = self._arrays, self.graph
        self._rows = rows
        self._ids_host = np.zeros(rows, graph.ids_dtype)
        self._ids = self._ids_host if self._device_type == "cpu" else arrays.zeros(rows, graph.ids_dtype)
        self._logits = arrays.empty((rows, self._vocab), graph.logits_dtype)
        float32_on_host = self._device_type == "cpu" and graph.logits_dtype == np.float32
        self._host_logits = self._logits if float32_on_host else np.empty((rows, self._vocab), np.float32)
        if graph.hidden_name:
            self._hidden = arrays.empty((rows, graph.hidden_size), graph.hidden_dtype)
            self._hidden_rows = (0, 0)  # the old buffer's rows are gone
        if self.static_shapes and self._positions_fixed is not None:
            self._positions_fixed = arrays.zeros(rows, graph.position_dtype)

    # ------------------------------------------------------------------------------------------------------------
    # protocol
    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def max_length(self) -> int:
        return self._max_length

    def current_len(self) -> int:
        return self._len

    def reset(self) -> None:
        self._len = 0
        self._hidden_rows = (0, 0)
        self._zero_states()

    def rewind(self, length: int) -> None:
        """Keep the first ``length`` positions. With a recurrent state (``stateful``) this is not free: the state
        before the last pass is restored and the kept tokens after it are replayed in one pass (from the start
        when ``length`` lies before the last pass)."""
        length = int(length)
        if not 0 <= length <= self._len:
            raise BackendError(f"rewind({length}) but the KV cache holds {self._len} positions")
        if not self.stateful or length == self._len:
            self._len = length
            return
        if self._snapshot_len is not None and self._snapshot_len <= length:
            self._state_cur = 1 - self._state_cur  # the state before the last pass
            self._len, self._snapshot_len = self._snapshot_len, None
        else:
            self._len = 0
            self._zero_states()
        start = self._len
        while start < length:  # replay the kept tokens, prefill-chunk by chunk
            chunk = min(self.prefill_chunk, length - start)
            self._run(self._history[start : start + chunk].copy(), 0.0)
            start += chunk

    def _restore_after_failure(self, length: int) -> None:
        """After a chunked prefill failed part way: bring the recurrent state back to ``length`` positions (by
        replay); if that fails too, to an empty sequence, which the caller then sees as ``current_len()`` 0."""
        try:
            self.rewind(length)
        except BackendError:
            logger.exception("OrtBackend: could not restore the recurrent state to %d positions; emptied it", length)
            self.reset()
            raise

    def _zero_states(self) -> None:
        """The recurrent states of an empty sequence (zeros), in the current buffers."""
        for pair in self._states:
            pair[self._state_cur][...] = 0
        self._snapshot_len = None

    def decode(self, tokens: Sequence[int], past: int) -> np.ndarray:
        timer = self.timer
        t0 = time.perf_counter() if timer is not None else 0.0
        ids = self._validate(tokens, past, "past")
        count = len(ids)
        start_len = self._len
        try:
            start = 0
            while start < count:
                chunk = min(self.prefill_chunk, count - start)
                self._run(ids[start : start + chunk], t0)
                t0 = time.perf_counter() if timer is not None else 0.0
                start += chunk
        except BaseException:
            if self.stateful and self._len != start_len:
                self._restore_after_failure(start_len)
            self._len = start_len  # chunks already folded in are forgotten: the call had no effect
            self._hidden_rows = (0, 0)
            raise
        row = self._host_row(chunk - 1)
        if timer is not None:
            timer.add("readback", time.perf_counter() - t0)
        return row

    def decode_verify(self, tokens: Sequence[int], base: int) -> np.ndarray:
        return self._verify_pass(tokens, base, self._host_rows)

    def verify_picks(self, tokens: Sequence[int], base: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``decode_verify`` pass, reduced where the logits live to each row's argmax id (lowest on ties;
        int64 ``[len(tokens)]``, always in ``[0, vocab)``) and top-1/top-2 gap (float32 ``[len(tokens)]``; NaN for
        a row that is not finite where its pick is made); fresh host arrays."""
        return self._verify_pass(tokens, base, lambda count: self._arrays.argmax_margin(self._logits[:count]))

    def _verify_pass(self, tokens: Sequence[int], base: int, read: Callable[[int], R]) -> R:
        """One pass over ``tokens`` at ``base`` (the contract's checks first), then ``read(len(tokens))`` of its
        logits, timed as the pass's read-back when a timer is set."""
        timer = self.timer
        t0 = time.perf_counter() if timer is not None else 0.0
        ids = self._validate(tokens, base, "base")
        self._alloc_rows(len(ids))
        self._run(ids, t0)
        t0 = time.perf_counter() if timer is not None else 0.0
        out = read(len(ids))
        if timer is not None:
            timer.add("readback", time.perf_counter() - t0)
        return out

    def capture_graphs(self, counts: Iterable[int] | None = None) -> dict[str, Any]:
        """Warm up and capture the CUDA graph of each pass width in ``counts`` (default: 1 to ``graph_max_tokens``)
        now, so that no capture happens during a generation: each width runs at position 0 until ONNX Runtime has
        captured it. Resets the backend; returns ``graphs.summary()`` (``{"enabled": False, ...}`` without graphs).
        Not yet run on a GPU."""
        book = self.graphs
        if book is None:
            return {"enabled": False, "disabled_reason": "cuda_graphs is off"}
        widths = list(counts) if counts is not None else list(range(1, book.max_tokens + 1))
        for count in widths:
            if count > self._max_length:
                continue
            zeros = np.zeros(count, np.int64)
            while book.enabled and book.runs_to_capture(count) > 0:
                self._len = 0
                self._alloc_rows(count)
                self._run(zeros, 0.0)
        self._len = 0
        self._arrays.sync()
        return book.summary()

    # ------------------------------------------------------------------------------------------------------------
    def _validate(self, tokens: Sequence[int], position: int, what: str) -> np.ndarray:
        """``tokens`` as a flat int64 array after the protocol's checks (``BackendError`` names the problem)."""
        try:
            array = np.asarray(tokens)
        except Exception as exc:  # noqa: BLE001
            raise BackendError(f"tokens must be a sequence of ints: {exc}") from exc
        if array.ndim != 1:
            raise BackendError(f"tokens must be a flat sequence of ids, got shape {array.shape}")
        if array.size and not np.issubdtype(array.dtype, np.integer):
            if not all(float(t).is_integer() for t in array.tolist()):
                raise BackendError(f"tokens must be integer ids, got dtype {array.dtype}")
        if array.size == 0 or int(array.min()) < 0 or int(array.max()) >= self._vocab:
            check_tokens(array.tolist(), self._vocab)  # raises, naming the problem
        check_position(int(position), self._len, int(array.size), self._max_length, what)
        return array.astype(np.int64, copy=False)

    def _run(self, tokens: np.ndarray, t0: float) -> None:
        """One session run over ``tokens`` at position ``current_len()``; on success the length grows. ``t0``: when
        the caller's host work for this pass began (read only when a timer is set)."""
        timer = self.timer
        if timer is not None:
            timer.begin(len(tokens))
        if self.static_shapes:
            self._run_static(tokens, t0)
        else:
            self._run_dynamic(tokens, t0)

    def _run_dynamic(self, tokens: np.ndarray, t0: float) -> None:
        """The default binding: mask ``[1, total]`` (a prefix of ones), ids and positions bound per pass."""
        binding, graph, arrays, timer = self._binding, self.graph, self._arrays, self.timer
        device, device_id = self._device_type, self._device_id
        count = len(tokens)
        past = self._len
        total = past + count
        self._alloc_rows(count)
        self._ids_host[:count] = tokens
        if device != "cpu":
            arrays.upload(self._ids[:count], self._ids_host[:count])
        binding.bind_input(graph.ids_name, device, device_id, graph.ids_dtype, [1, count], arrays.ptr(self._ids))
        if graph.mask_name:
            binding.bind_input(graph.mask_name, device, device_id, graph.mask_dtype, [1, total], arrays.ptr(self._mask))
        if graph.position_name:
            binding.bind_input(
                graph.position_name,
                device,
                device_id,
                graph.position_dtype,
                [1, count],
                arrays.ptr(self._positions) + past * np.dtype(graph.position_dtype).itemsize,
            )
        self._bind_row_outputs(binding, count)
        self._hidden_rows = (0, 0)  # overwritten by this run

        presents = None
        if not self.share_buffer:
            presents = self._bind_grow_copy(past, total)
        cur = self._state_cur
        for names, pair in zip(graph.states, self._states, strict=True):
            shape = [1, *names.shape]
            binding.bind_input(names.past, device, device_id, names.dtype, shape, arrays.ptr(pair[cur]))
            binding.bind_output(names.present, device, device_id, names.dtype, shape, arrays.ptr(pair[1 - cur]))
        self._snapshot_len = None  # the run overwrites the other state buffers
        if timer is not None:
            t1 = time.perf_counter()
            timer.add("host", t1 - t0)
        arrays.sync()
        if timer is not None:
            t2 = time.perf_counter()
            timer.add("sync", t2 - t1)
        try:
            self.session.run_with_iobinding(binding)
            if timer is not None:
                t3 = time.perf_counter()
                timer.add("run", t3 - t2)
            binding.synchronize_outputs()
            if timer is not None:
                timer.add("sync", time.perf_counter() - t3)
        except Exception as exc:  # noqa: BLE001 - ORT raises its own exception types
            what = f"{count} token" + ("s" if count != 1 else "")
            raise BackendError(f"onnxruntime failed on {what} at position {past} [onnxruntime: {exc}]") from exc
        if presents is not None:
            for layer, (present_key, present_value) in enumerate(presents):
                arrays.copy_positions(self._keys[layer], present_key, past, total)
                arrays.copy_positions(self._values[layer], present_value, past, total)
        if self.stateful:
            self._state_cur, self._snapshot_len = 1 - cur, past
            self._history[past:total] = tokens
        self._len = total
        if graph.hidden_name:
            self._hidden_rows = (past, count)

    # ------------------------------------------------------------------------------------------------------------
    # static shapes
    def _init_static(self) -> None:
        """Buffers of the static path: the ``[max_length]`` mask (its leading ``_mask_ones`` values are ones, the
        rest zeros), page-locked sources of ones and zeros to copy from, the page-locked ids staging indexed by
        position, the constant positions ``0..max_length-1`` and the fixed position-ids buffer."""
        arrays, graph, n = self._arrays, self.graph, self._max_length
        self._static_mask = arrays.zeros(n, graph.mask_dtype)
        self._mask_ones = 0
        self._mask_one_src = arrays.pinned_empty(n, graph.mask_dtype)
        self._mask_one_src[...] = 1
        self._mask_zero_src = arrays.pinned_empty(n, graph.mask_dtype)
        self._mask_zero_src[...] = 0
        self._stage_ids = arrays.pinned_empty(n, graph.ids_dtype)
        if graph.position_name:
            self._positions_src = arrays.pinned_empty(n, graph.position_dtype)
            self._positions_src[...] = np.arange(n)
            self._positions_fixed = arrays.zeros(1, graph.position_dtype)  # sized by _alloc_rows

    def _static_pass(self, count: int) -> _StaticPass:
        """The IO binding and run options of passes of ``count`` tokens (made once per width)."""
        found = self._passes.get(count)
        if found is not None:
            return found
        arrays, graph, device, device_id = self._arrays, self.graph, self._device_type, self._device_id
        binding = self.session.io_binding()
        self._bind_kv(binding)
        binding.bind_input(graph.ids_name, device, device_id, graph.ids_dtype, [1, count], arrays.ptr(self._ids))
        binding.bind_input(
            graph.mask_name, device, device_id, graph.mask_dtype, [1, self._max_length], arrays.ptr(self._static_mask)
        )
        if graph.position_name:
            binding.bind_input(
                graph.position_name,
                device,
                device_id,
                graph.position_dtype,
                [1, count],
                arrays.ptr(self._positions_fixed),
            )
        self._bind_row_outputs(binding, count)
        graph_id = self.graphs.graph_id(count) if self.graphs is not None else EAGER
        options = self._ort.RunOptions()
        if self.graphs is not None:
            options.add_run_config_entry("gpu_graph_id", str(graph_id))
        if self.stream_ordered:
            options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        found = _StaticPass(count=count, binding=binding, run_options=options, graph_id=graph_id)
        self._passes[count] = found
        return found

    def _stage_static(self, tokens: np.ndarray, past: int, total: int) -> None:
        """Enqueue this pass's inputs: ids (staged at their positions, so a later chunk never overwrites an
        earlier one before its copy), position ids, and the mask's ones/zeros boundary moved to ``total``."""
        arrays, count = self._arrays, total - past
        stage = self._stage_ids[past:total]
        stage[...] = tokens
        arrays.copy_from_host(self._ids[:count], stage)
        if self._positions_fixed is not None:
            arrays.copy_from_host(self._positions_fixed[:count], self._positions_src[past:total])
        ones = self._mask_ones
        if total > ones:
            arrays.copy_from_host(self._static_mask[ones:total], self._mask_one_src[ones:total])
        elif total < ones:
            arrays.copy_from_host(self._static_mask[total:ones], self._mask_zero_src[total:ones])
        self._mask_ones = total

    def _run_static(self, tokens: np.ndarray, t0: float) -> None:
        """Static binding: every input at a fixed address and shape per width; on the stream-ordered CUDA path no
        host synchronisation; with CUDA graphs the width's graph id (and the eager fallback on failure)."""
        timer, arrays = self.timer, self._arrays
        count = len(tokens)
        past = self._len
        total = past + count
        self._alloc_rows(count)
        self._hidden_rows = (0, 0)  # overwritten by this run
        step = self._static_pass(count)
        self._stage_static(tokens, past, total)
        if timer is not None:
            t1 = time.perf_counter()
            timer.add("host", t1 - t0)
        if not self.stream_ordered:
            arrays.sync()
            if timer is not None:
                t2 = time.perf_counter()
                timer.add("sync", t2 - t1)
                t1 = t2
        try:
            self.session.run_with_iobinding(step.binding, step.run_options)
            if timer is not None:
                t2 = time.perf_counter()
                timer.add("run", t2 - t1)
            if not self.stream_ordered:
                step.binding.synchronize_outputs()
                if timer is not None:
                    timer.add("sync", time.perf_counter() - t2)
        except Exception as exc:  # noqa: BLE001 - ORT raises its own exception types
            if step.graph_id == EAGER or self.graphs is None or not self.graphs.enabled:
                raise BackendError(f"onnxruntime failed on {count} tokens at position {past}: {exc}") from exc
            self._give_up_graphs(f"a run with gpu_graph_id={step.graph_id} ({count} tokens) failed: {exc}")
            self._run_static(tokens, time.perf_counter() if timer is not None else 0.0)  # eager now
            return
        if self.graphs is not None:
            self.graphs.record(count)
        self._len = total
        if self.graph.hidden_name:
            self._hidden_rows = (past, count)

    def _give_up_graphs(self, reason: str) -> None:
        """The eager fallback: end a capture left open on the stream, reopen the session without CUDA graphs and
        rebind everything (the KV and every other buffer are kept). ``BackendError`` without ``reopen_session``."""
        book = self.graphs
        assert book is not None
        logger.warning("OrtBackend: giving up CUDA graphs (%s); running eagerly", reason.splitlines()[0][:500])
        book.disable(reason)
        try:
            self._arrays.end_capture()
        except Exception as exc:  # noqa: BLE001 - reported with the reason
            raise BackendError(f"CUDA graphs failed ({reason}) and the capture could not be ended: {exc}") from exc
        if self._reopen is None:
            raise BackendError(f"CUDA graphs failed and no eager session can be opened: {reason}")
        self.session = self._reopen()
        self._bind_session()

    # ------------------------------------------------------------------------------------------------------------
    def _bind_grow_copy(self, past: int, total: int) -> list[tuple]:
        """Grow/copy KV path: bind copies of the first ``past`` positions as the past inputs and fresh
        ``total``-position buffers as the present outputs; return the (key, value) outputs per layer."""
        binding, graph, arrays = self._binding, self.graph, self._arrays
        device, device_id = self._device_type, self._device_id
        _, kv_heads, _, head_size = self._kv_shape
        presents = []
        self._fed_pasts = []  # keep the fed copies alive through the run
        for layer, names in enumerate(graph.kv_names):
            pair = []
            for past_name, present_name, buffer in (
                (names.past_key, names.present_key, self._keys[layer]),
                (names.past_value, names.present_value, self._values[layer]),
            ):
                fed = arrays.prefix(buffer, past)
                self._fed_pasts.append(fed)
                if past == 0:
                    # a zero-length tensor may have a null data pointer; bind it as an OrtValue instead
                    host = np.zeros((1, kv_heads, 0, head_size), graph.kv_dtype)
                    self._fed_pasts.append(host)
                    binding.bind_ortvalue_input(past_name, self._ort.OrtValue.ortvalue_from_numpy(host))
                else:
                    binding.bind_input(
                        past_name, device, device_id, graph.kv_dtype, [1, kv_heads, past, head_size], arrays.ptr(fed)
                    )
                out = arrays.empty((1, kv_heads, total, head_size), graph.kv_dtype)
                binding.bind_output(
                    present_name, device, device_id, graph.kv_dtype, [1, kv_heads, total, head_size], arrays.ptr(out)
                )
                pair.append(out)
            presents.append(tuple(pair))
        return presents

    # ------------------------------------------------------------------------------------------------------------
    # HiddenStates, and the buffers a drafter on the same device reads in place
    def _hidden_row(self, position: int) -> int:
        """The row of the hidden buffer holding ``position``; ``BackendError`` unless the last pass computed it and
        its KV is still resident."""
        if not self.hidden_size:
            raise BackendError(
                f"{self.folder.model_path} has no {self.folder.hidden_states_name!r} output; rebuild the folder with "
                "the builder's include_hidden_states=true extra option (ortspec convert does)"
            )
        start, count = self._hidden_rows
        if not start <= position < min(start + count, self._len):
            raise BackendError(
                f"hidden_at({position}): the last pass computed positions [{start}, {start + count}) and "
                f"{self._len} are resident"
            )
        return position - start

    def hidden_at(self, position: int) -> np.ndarray:
        """The final hidden state at ``position`` (a position of the last pass, below ``current_len()``), a float32
        host ``[hidden_size]`` array valid until the next call (``HiddenStates``)."""
        row = self._hidden_row(int(position))
        if self._device_type == "cpu" and self.graph.hidden_dtype == np.float32:
            return self._hidden[row]
        self._arrays.download(self._hidden[row], self._hidden_host)
        return self._hidden_host

    def hidden_row(self, position: int):
        """``hidden_at(position)``'s row as a view of the backend's own buffer (an array of ``array_module``, on
        this backend's device, ``[hidden_size]`` of ``graph.hidden_dtype``), valid until the next call; for a
        drafter on the same device to copy from without a trip through the host. Same checks as ``hidden_at``."""
        return self._hidden[self._hidden_row(int(position))]

    def hidden_pointer(self, position: int) -> int:
        """The address (on this backend's device) of ``hidden_at(position)``'s row, ``hidden_size`` elements of
        ``graph.hidden_dtype``, valid until the next call; same checks as ``hidden_at``."""
        row = self._hidden_row(int(position))
        return self._arrays.ptr(self._hidden) + row * self.hidden_size * np.dtype(self.graph.hidden_dtype).itemsize

    def kv_pointer(self, layer: int, which: str, head: int) -> int:
        """The address (on this backend's device) of KV head ``head`` of ``layer`` (``which``: ``"key"`` or
        ``"value"``) at position 0: ``[max_length, head_size]`` elements of ``graph.kv_dtype``, of which the first
        ``current_len()`` positions are valid and contiguous. The buffers are the backend's (shared, never copied);
        a reader must not write them and must not read past ``current_len()``. ``ValueError`` for a bad index."""
        _, kv_heads, max_length, head_size = self._kv_shape
        if not 0 <= layer < len(self._keys) or not 0 <= head < kv_heads or which not in ("key", "value"):
            raise ValueError(
                f"kv_pointer({layer}, {which!r}, {head}): expected layer in [0, {len(self._keys)}), "
                f"which 'key' or 'value', head in [0, {kv_heads})"
            )
        buffer = (self._keys if which == "key" else self._values)[layer]
        return self._arrays.ptr(buffer) + head * max_length * head_size * np.dtype(self.graph.kv_dtype).itemsize

    @property
    def device_type(self) -> str:
        """Where the buffers live, in IO-binding words: ``"cpu"`` or ``"cuda"``."""
        return self._device_type

    @property
    def device_id(self) -> int:
        return self._device_id

    @property
    def array_module(self) -> ArrayModule:
        """The buffers' array module (allocation, pointers, copies on this backend's device)."""
        return self._arrays

    def _host_row(self, row: int) -> np.ndarray:
        """Logits row ``row`` of the last pass as a float32 host ``[vocab]`` view (copied there on a device)."""
        if self._host_logits is self._logits:
            return self._logits[row]
        out = self._host_logits[row]
        self._arrays.download(self._logits[row], out)
        return out

    def _host_rows(self, count: int) -> np.ndarray:
        """The last pass's first ``count`` logits rows as a float32 host ``[count, vocab]`` view."""
        if self._host_logits is self._logits:
            return self._logits[:count]
        out = self._host_logits[:count]
        self._arrays.download(self._logits[:count], out)
        return out

    def __repr__(self) -> str:
        extra = ""
        if self.static_shapes:
            extra = ", static_shapes=True"
        if self.graphs is not None:
            extra += f", cuda_graphs={'on' if self.graphs.enabled else 'off (fell back)'}"
        return (
            f"OrtBackend({str(self.folder.path)!r}, provider={self.provider!r}, max_length={self._max_length}, "
            f"len={self._len}, share_buffer={self.share_buffer}, kv={self.graph.kv_dtype}, stateful={self.stateful}"
            f"{extra})"
        )


class _StaticPass:
    """One pass width's fixed IO binding and run options, and the graph id they carry."""

    __slots__ = ("binding", "count", "graph_id", "run_options")

    def __init__(self, *, count: int, binding, run_options, graph_id: int) -> None:
        self.count, self.binding, self.run_options, self.graph_id = count, binding, run_options, graph_id


def static_shapes_unsupported(graph, share_buffer: bool) -> str | None:
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
