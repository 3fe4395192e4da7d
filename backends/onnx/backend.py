"""``OrtBackend``: the backend protocol (see ``backends/base.py``) on an ONNX Runtime decoder folder.

The folder is the one the onnxruntime-genai model builder writes (``model.onnx`` + ``genai_config.json``), used
as is, opened as a :class:`~ortspec.backends.onnx.config.BackendConfig` says. One ``InferenceSession`` runs with
IO binding; this class composes the parts, each in its own module:

* ``kv.py`` (:class:`KvStore`): the per-layer KV buffers, their length, the in-place (shared past/present) and
  grow/copy paths, the per-head addresses a drafter reads.
* ``binding.py``: the per-pass row buffers (logits, ids, hidden states), the default binding and the static-shape
  binding (one IO binding per pass width, the length carried by the mask's values).
* ``recurrent.py`` (:class:`RecurrentStates`): hybrid models' recurrent states, the snapshot a rewind restores and
  the tokens it replays.
* ``static_passes.py``: the static-shape passes (one binding per width, stream-ordered, CUDA graphs with the eager
  fallback).
* ``cuda_graphs.py``: CUDA graphs per pass width (:class:`GraphBook`), the stream-ordered session and its eager
  fallback, the per-phase timer.
* ``model_graph.py``: the graph checked against the folder; ``graph_rewrites.py``: the load-time rewrites
  (sliding window, ``MatMulNBits`` accuracy level, and on the CPU with dynamic shapes the LM head over the last
  positions only).

What the backend adds on top: prompts longer than a prefill chunk are prefilled chunk by chunk, and where the graph
takes ``model_graph.KEEP_LOGITS_INPUT`` (the CPU with dynamic shapes, a builder LM head) each chunk runs the LM head
over its last position only; ``rewind`` into a stateful model replays; and the capabilities. **DevicePicks**: on CUDA
the KV, the inputs and the logits live in device memory (CuPy arrays, or torch CUDA tensors where CuPy is missing),
bound by pointer, and ``verify_picks`` reduces each row to its argmax and top-1/top-2 margin on the device, copying to
the host only what is asked for. **TreeRows** (``BackendConfig(tree_rows=True)``, the dynamic binding): the graph
rewritten with the tree inputs (``tree_rewrite.py``), fed consecutive positions and a zero bias on every pass and a
tree's positions and bias on ``verify_tree``; ``keep_path`` moves the accepted path's KV into place.
**HiddenStates**: when the graph has the ``hidden_states`` output (the builder's
``include_hidden_states=true`` extra option; ``ortspec convert`` sets it), ``hidden_at(position)`` for a position of the
last pass that kept its row (every position of a ``decode_verify``; the last of a ``decode`` when the LM head keeps the
last position only; a host float32 row), and for a drafter on the same device (the ``SharedKvTarget`` protocol of
``drafter.py``) ``hidden_row``/``hidden_pointer(position)`` and ``kv_pointer(layer, which, head)``. Without the output
``hidden_size`` is 0 and those raise ``BackendError``. **Timing**: ``timer`` (None by default) takes a
``cuda_graphs.PhaseTimer`` that adds up each pass's host work, session run, explicit syncs and read-back.

Errors: every contract violation raises ``BackendError`` before any state changes; a failure inside ONNX Runtime
also raises ``BackendError`` and leaves ``current_len()`` where it was (positions past it are never read).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import numpy as np

from ..base import BackendError, check_position, check_tokens, check_tree_row, kept_path_moves
from .arrays import ArrayModule, HostArrays, cuda_arrays
from .binding import DefaultBinding, RowBuffers, StaticBinding, static_shapes_unsupported
from .config import BackendConfig
from .cuda_graphs import GraphBook, PhaseTimer, open_stream_ordered
from .folder import ModelFolder
from .graph_rewrites import LoadedGraph, load_rewrites
from .kv import KvStore, move_rows
from .model_graph import inspect_graph, read_graph_facts
from .recurrent import RecurrentStates
from .session import execution_providers, open_session
from .static_passes import give_up_graphs, run_static

logger = logging.getLogger(__name__)
R = TypeVar("R")


def _refuse_batch_only(config: BackendConfig) -> None:
    if config.tree_rows and config.static:
        raise ValueError(
            "tree_rows: a token-tree pass binds its own positions and bias, which the static-shape binding "
            "(static_shapes, cuda_graphs) does not; use the dynamic binding"
        )
    if config.ragged_rows:
        raise ValueError("ragged_rows: ragged passes run on the batch backend (OrtBatchBackend) only")


class OrtBackend:
    """One sequence's KV cache and decoder session on ONNX Runtime (CPU or CUDA execution provider).

    Public attributes: ``session`` (the ``InferenceSession``), ``folder`` (its :class:`ModelFolder`), ``config``
    (the :class:`BackendConfig` it was opened with), ``graph`` (the checked
    :class:`~ortspec.backends.onnx.model_graph.DecoderGraph`), ``provider`` (``"cpu"`` or ``"cuda"``),
    ``prefill_chunk``, ``threads`` (intra-op), ``share_buffer`` (True: the in-place KV path), ``kv`` (the
    :class:`KvStore`), ``picks_on_device`` (the ``DevicePicks`` capability: True on CUDA), ``static_shapes``,
    ``static_binding`` (the :class:`StaticBinding`, or None), ``stream_ordered`` (CUDA: ONNX Runtime runs on the
    array module's stream and nothing waits for the device but the read-back), ``graphs`` (a :class:`GraphBook`,
    or None without CUDA graphs), ``timer`` (None, or a :class:`PhaseTimer`), ``stateful`` (the graph carries a
    recurrent state: a rewind replays tokens), ``graph_facts`` (what the graph file says beyond its interface:
    attention windows, MatMulNBits accuracy levels), ``rewrites`` (the load-time rewrites applied, in words) and
    ``variant`` (those and the session config entries given, in one string: "" for the folder as written). The
    backend owns its buffers: the logits that ``decode`` and ``decode_verify`` return are views of them, valid
    until its next call."""

    def __init__(
        self,
        session,
        folder: ModelFolder,
        config: BackendConfig | None = None,
        *,
        arrays: ArrayModule | None = None,
        loaded: LoadedGraph | None = None,
        stream_ordered: bool = False,
        reopen_session: Callable[[], Any] | None = None,
    ) -> None:
        """Wrap an open ``session`` of ``folder``'s decoder (see :meth:`from_folder`, which opens one), set up as
        ``config`` says (default: ``BackendConfig()``; its session settings are the session's business).

        ``arrays``: a ready array module (default: made from ``config``: host arrays on the CPU, else
        ``config.array_module`` on ``config.device_id``). With ``config.cuda_graphs`` the session must have been
        opened with ``enable_cuda_graph=1`` for graphs to be captured: it is then given a ``gpu_graph_id`` per
        pass width. ``loaded``: the session's graph facts and the rewrites applied (default: the facts read from
        ``folder.model_path``, no rewrites). ``stream_ordered``: the session runs on the array module's stream
        (opened with ``user_compute_stream`` = its ``stream_ptr()``), so no host synchronisation is needed around
        runs; only meaningful with static shapes on CUDA. ``reopen_session``: opens the same model without CUDA
        graphs (the fallback when graphs fail); without it a graph failure raises ``BackendError``."""
        import onnxruntime as ort

        config = config if config is not None else BackendConfig()
        _refuse_batch_only(config)
        self._ort = ort
        self.config = config
        self.session = session
        self.folder = folder
        self.provider = config.provider
        self.prefill_chunk = config.prefill_chunk
        max_length = config.capacity(folder.context_length)
        self._vocab = folder.vocab_size
        # DevicePicks: the driver asks for picks (verify_picks) when the logits live on a device.
        self.picks_on_device = config.provider == "cuda"
        self.threads = session.get_session_options().intra_op_num_threads
        self.timer: PhaseTimer | None = None

        loaded = loaded if loaded is not None else LoadedGraph(read_graph_facts(folder.model_path))
        self.graph_facts = loaded.facts
        self.graph = inspect_graph(session, folder, self.graph_facts)
        self.rewrites = loaded.rewrites
        # what makes this session compute differently from the folder as written ("" when nothing does)
        self.variant = "; ".join([*self.rewrites, *(f"{key}={value}" for key, value in config.config_entries)])
        self.stateful = bool(self.graph.states)
        if self.stateful and self.graph.tree_bias_name is not None:
            raise BackendError(f"{folder.model_path}: token-tree rows on a model with recurrent states")
        self._parents: tuple[int, ...] | None = None  # the tree of the pass being bound (``verify_tree``)
        self.share_buffer = self._shares_buffer(config.share_buffer)
        self.static_shapes = config.static
        if self.static_shapes:
            why_not = static_shapes_unsupported(self.graph, self.share_buffer)
            if why_not:
                raise BackendError(f"{folder.model_path}: static shapes are not possible: {why_not}")

        if arrays is None:
            arrays = (
                HostArrays(config.device_id)
                if config.provider == "cpu"
                else cuda_arrays(config.device_id, config.array_module)
            )
        self._arrays = arrays
        self.stream_ordered = bool(stream_ordered and self.static_shapes and arrays.device_type != "cpu")
        self.graphs: GraphBook | None = GraphBook(config.graph_max_tokens) if config.cuda_graphs else None
        self._reopen = reopen_session
        graph = self.graph
        self.kv = KvStore(arrays, graph, folder.num_kv_heads, max_length, folder.head_size)
        self._recurrent = RecurrentStates(arrays, graph.states, max_length) if self.stateful else None
        self.hidden_size = graph.hidden_size
        self.hidden_features = config.hidden_features  # the residual streams after the final state in a hidden row
        self._rows = RowBuffers(arrays, graph, self._vocab)
        self._default = DefaultBinding(arrays, graph, max_length)
        self.static_binding = StaticBinding(arrays, graph, max_length) if self.static_shapes else None
        self._alloc_rows(max(self.prefill_chunk, config.graph_max_tokens if config.cuda_graphs else 1))
        self._bind_session()

    def _shares_buffer(self, asked: bool | None) -> bool:
        """Whether the KV takes the in-place path: the folder (or ``asked``) wants it and the graph can (logged
        when not)."""
        wants_sharing = self.folder.past_present_share_buffer if asked is None else bool(asked)
        if wants_sharing and self.graph.group_query_attention:
            return True
        why = (
            "the graph has no GroupQueryAttention op"
            if wants_sharing
            else "past/present buffer sharing is off (search.past_present_share_buffer or share_buffer=False)"
        )
        logger.warning(
            "OrtBackend(%s): %s; using the grow/copy KV path (slower, copies the KV each step)", self.folder.path, why
        )
        return False

    def _bind_session(self) -> None:
        """A fresh IO binding of the session with the shared KV buffers bound (the default path), and an empty
        cache of per-width static bindings."""
        binding = self._default.open(self.session)
        if self.static_binding is not None:
            self.static_binding.forget_passes()
        if self.share_buffer:
            self.kv.bind_shared(binding)

    @classmethod
    def from_folder(
        cls,
        folder_or_path: ModelFolder | str | os.PathLike[str],
        config: BackendConfig | None = None,
        *,
        session_options=None,
    ) -> OrtBackend:
        """Open the decoder in a builder-written folder as ``config`` says (default: ``BackendConfig()``: the CPU,
        physical cores, the model's whole context, the folder's settings).

        ``session_options``: a ready ``onnxruntime.SessionOptions`` that replaces the config's session settings
        (``threads``, ``graph_optimization_level``, ``allow_spinning``, ``config_entries``). With
        ``config.static_shapes`` on CUDA the session runs on the array module's own stream without host
        synchronisation around runs; with ``config.cuda_graphs`` it captures one CUDA graph per pass width, with an
        eager fallback when ONNX Runtime cannot capture (``cuda_graphs.py``). The load-time rewrites are
        ``graph_rewrites.load_rewrites``'s (logged).
        A folder problem raises ``ModelFolderError`` naming the file and the key or tensor (``ModelFileError``,
        also a ``BackendError``, for the model file); another session problem ``BackendError``; a bad setting
        ``ValueError`` (when the config is made, or here for ``max_length`` past the model's context).
        """
        import onnxruntime  # noqa: F401 - fail here, before any work, when it is missing

        config = config if config is not None else BackendConfig()
        _refuse_batch_only(config)
        folder = folder_or_path if isinstance(folder_or_path, ModelFolder) else ModelFolder.load(folder_or_path)
        config.capacity(folder.context_length)  # ValueError before any work
        keep_logits = config.provider == "cpu" and not config.static
        loaded = load_rewrites(folder, config, keep_logits=keep_logits, trees=config.tree_rows is True)
        options = session_options if session_options is not None else config.session_options(folder.session_options)
        if config.provider == "cpu" or not config.static:
            providers = execution_providers(config.provider, config.device_id)
            session = open_session(
                folder.model_path, providers=providers, session_options=options, model_bytes=loaded.model_bytes
            )
            return cls(session, folder, config, loaded=loaded)
        # CUDA, stream-ordered: the array module's own stream becomes ONNX Runtime's compute stream.
        opened = open_stream_ordered(
            folder.model_path,
            device_id=config.device_id,
            array_module=config.array_module,
            graphs=config.cuda_graphs,
            session_options=options,
            model_bytes=loaded.model_bytes,
        )
        backend = cls(
            opened.session,
            folder,
            config,
            arrays=opened.arrays,
            loaded=loaded,
            stream_ordered=True,
            reopen_session=opened.reopen,
        )
        if backend.graphs is not None and opened.refused is not None:
            backend.graphs.disable(f"session refused graph capture: {opened.refused}")
        return backend

    def _alloc_rows(self, rows: int) -> None:
        """Make the row buffers hold passes of up to ``rows`` tokens (see ``RowBuffers.allocate``). Growing moves
        the buffers, so static bindings are dropped and captured CUDA graphs (which write to the old addresses)
        are given up first."""
        if rows <= self._rows.capacity:
            return
        if self._rows.capacity:
            logger.info("OrtBackend: growing the logits buffer from %d to %d rows", self._rows.capacity, rows)
            if self.graphs is not None and self.graphs.enabled:
                give_up_graphs(self, f"the logits buffer grew from {self._rows.capacity} to {rows} rows")
            if self.static_binding is not None:
                self.static_binding.forget_passes()
        self._rows.allocate(rows)
        if self.static_binding is not None:
            self.static_binding.allocate(rows)

    # ------------------------------------------------------------------------------------------------------------
    # protocol
    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def max_length(self) -> int:
        return self.kv.shape[2]

    def current_len(self) -> int:
        return self.kv.length

    def reset(self) -> None:
        self.kv.length = 0
        self._rows.hidden_span = (0, 0)
        if self._recurrent is not None:
            self._recurrent.zero()

    def rewind(self, length: int) -> None:
        """Keep the first ``length`` positions. With a recurrent state (``stateful``) this is not free: the state
        before the last pass is restored and the kept tokens after it are replayed in one pass (from the start
        when ``length`` lies before the last pass)."""
        length = int(length)
        self.kv.check_rewind(length)
        if self._recurrent is None or length == self.kv.length:
            self.kv.length = length
            return
        self.kv.length = start = self._recurrent.restore(length)
        while start < length:  # replay the kept tokens, prefill-chunk by chunk
            chunk = min(self.prefill_chunk, length - start)
            self._run(self._recurrent.tokens(start, start + chunk), 0.0)
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

    def decode(self, tokens: Sequence[int], past: int) -> np.ndarray:
        timer = self.timer
        t0 = time.perf_counter() if timer is not None else 0.0
        ids = self._validate(tokens, past, "past")
        count = len(ids)
        start_len = self.kv.length
        try:
            start = 0
            while start < count:
                chunk = min(self.prefill_chunk, count - start)
                kept = self._run(ids[start : start + chunk], t0, last=1)
                t0 = time.perf_counter() if timer is not None else 0.0
                start += chunk
        except BaseException:
            if self.stateful and self.kv.length != start_len:
                self._restore_after_failure(start_len)
            self.kv.length = start_len  # chunks already folded in are forgotten: the call had no effect
            self._rows.hidden_span = (0, 0)
            raise
        row = self._rows.host_row(kept - 1)
        if timer is not None:
            timer.add("readback", time.perf_counter() - t0)
        return row

    def decode_verify(self, tokens: Sequence[int], base: int) -> np.ndarray:
        return self._verify_pass(tokens, base, self._rows.host_rows)

    def verify_picks(self, tokens: Sequence[int], base: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``decode_verify`` pass, reduced where the logits live to each row's argmax id (lowest on ties;
        int64 ``[len(tokens)]``, always in ``[0, vocab)``) and top-1/top-2 gap (float32 ``[len(tokens)]``; NaN for
        a row that is not finite where its pick is made); fresh host arrays."""
        return self._verify_pass(tokens, base, lambda count: self._arrays.argmax_margin(self._rows.logits[:count]))

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

    @property
    def tree_rows(self) -> bool:
        """Whether ``verify_tree`` and ``keep_path`` may be called (``TreeRows``): the graph was opened with the
        tree inputs (``BackendConfig(tree_rows=True)``; the dynamic binding, on the CPU or CUDA)."""
        return self.graph.tree_bias_name is not None

    def verify_tree(self, tokens: Sequence[int], parents: Sequence[int], base: int) -> np.ndarray:
        """One pass over a token tree ``tokens = (pending, *nodes)`` at ``base`` (``backends/base.py``:
        ``TreeRows``): every row's logits, row ``j + 1`` those after node ``j``'s path. ``BackendError`` without the
        tree inputs, for parents that are not a tree's, or at position 0 (the attention needs a past)."""
        if not self.tree_rows:
            raise BackendError("verify_tree: this backend was opened without the tree inputs (tree_rows=True)")
        check_tree_row(tokens, parents, "verify_tree")
        if int(base) < 1:
            raise BackendError("verify_tree: a token tree at position 0 (the tree's attention needs a past)")
        self._parents = tuple(int(p) for p in parents)
        try:
            return self._verify_pass(tokens, base, self._rows.host_rows)
        finally:
            self._parents = None

    def keep_path(self, start: int, nodes: Sequence[int]) -> None:
        """After ``verify_tree`` at ``start``, move the KV (and the kept hidden state) of position ``start + 1 +
        nodes[d]`` to ``start + 1 + d`` for each ``d`` (``TreeRows``); ``BackendError``, nothing moved, for a path
        that is not one."""
        moves = kept_path_moves(start, nodes, self.kv.length)
        self.kv.move_positions(moves)
        first, count = self._rows.hidden_span
        if count and self._rows.hidden is not None:
            move_rows(self._rows.hidden[:count], first, moves)

    def capture_graphs(self, counts: Iterable[int] | None = None) -> dict[str, Any]:
        """Warm up and capture the CUDA graph of each pass width in ``counts`` (default: 1 to ``graph_max_tokens``)
        now, so that no capture happens during a generation: each width runs at position 0 until ONNX Runtime has
        captured it. Resets the backend; returns ``graphs.summary()`` (``{"enabled": False, ...}`` without graphs)."""
        book = self.graphs
        if book is None:
            return {"enabled": False, "disabled_reason": "cuda_graphs is off"}
        widths = list(counts) if counts is not None else list(range(1, book.max_tokens + 1))
        for count in widths:
            if count > self.max_length:
                continue
            zeros = np.zeros(count, np.int64)
            while book.enabled and book.runs_to_capture(count) > 0:
                self.kv.length = 0
                self._alloc_rows(count)
                self._run(zeros, 0.0)
        self.kv.length = 0
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
        check_position(int(position), self.kv.length, int(array.size), self.max_length, what)
        return array.astype(np.int64, copy=False)

    def _run(self, tokens: np.ndarray, t0: float, last: int | None = None) -> int:
        """One session run over ``tokens`` at position ``current_len()``; on success the length grows. ``t0``: when
        the caller's host work for this pass began (read only when a timer is set). ``last``: the caller needs the
        logits of the last ``last`` positions only (None: every position); the graph computes those alone when it
        takes ``KEEP_LOGITS_INPUT``. Returns the rows the pass wrote (the logits rows, and the hidden states of
        the same positions): ``min(last, len(tokens))`` then, else ``len(tokens)``."""
        timer = self.timer
        if timer is not None:
            timer.begin(len(tokens))
        if self.static_shapes:
            run_static(self, tokens, t0)
            return len(tokens)
        kept = len(tokens) if last is None or self.graph.keep_name is None else min(last, len(tokens))
        self._run_dynamic(tokens, t0, kept)
        return kept

    def _run_dynamic(self, tokens: np.ndarray, t0: float, kept: int) -> None:
        """The default binding: mask ``[1, total]`` (a prefix of ones), ids and positions bound per pass, and the
        logits (and hidden states) of the last ``kept`` positions."""
        arrays, timer = self._arrays, self.timer
        count = len(tokens)
        past = self.kv.length
        total = past + count
        self._alloc_rows(count)
        binding = self._default.binding
        self._default.bind_pass(self._rows, tokens, past, kept, self._parents)
        self._rows.hidden_span = (0, 0)  # overwritten by this run
        presents = None if self.share_buffer else self.kv.bind_grow_copy(binding, self._ort, past, total)
        if self._recurrent is not None:
            self._recurrent.bind(binding)
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
            self.kv.copy_back(presents, past, total)
        if self._recurrent is not None:
            self._recurrent.commit(tokens, past)
        self.kv.length = total
        if self.graph.hidden_name:
            self._rows.hidden_span = (total - kept, kept)

    # ------------------------------------------------------------------------------------------------------------
    # HiddenStates, and what a drafter on the same device reads in place (drafter.SharedKvTarget)
    def _hidden_row(self, position: int) -> int:
        """The row of the hidden buffer holding ``position``; ``BackendError`` unless the last pass computed it and
        its KV is still resident."""
        if not self.hidden_size:
            raise BackendError(
                f"{self.folder.model_path} has no {self.folder.hidden_states_name!r} output; rebuild the folder with "
                "the builder's include_hidden_states=true extra option (ortspec convert does)"
            )
        start, count = self._rows.hidden_span
        if not start <= position < min(start + count, self.kv.length):
            raise BackendError(
                f"hidden_at({position}): the last pass computed positions [{start}, {start + count}) and "
                f"{self.kv.length} are resident"
            )
        return position - start

    def hidden_at(self, position: int) -> np.ndarray:
        """The final hidden state at ``position`` (a position of the last pass, below ``current_len()``), a float32
        host ``[hidden_size]`` array valid until the next call (``HiddenStates``)."""
        row = self._hidden_row(int(position))
        hidden = self._rows.hidden
        if self._arrays.device_type == "cpu" and self.graph.hidden_dtype == np.float32:
            return hidden[row]
        self._arrays.download(hidden[row], self._rows.hidden_host)
        return self._rows.hidden_host

    def hidden_row(self, position: int):
        """``hidden_at(position)``'s row as a view of the backend's own buffer (an array of ``array_module``, on
        this backend's device, ``[hidden_size]`` of ``graph.hidden_dtype``), valid until the next call; for a
        drafter on the same device to copy from without a trip through the host. Same checks as ``hidden_at``."""
        return self._rows.hidden[self._hidden_row(int(position))]

    def hidden_pointer(self, position: int) -> int:
        """The address (on this backend's device) of ``hidden_at(position)``'s row, ``hidden_size`` elements of
        ``graph.hidden_dtype``, valid until the next call; same checks as ``hidden_at``."""
        row = self._hidden_row(int(position))
        itemsize = np.dtype(self.graph.hidden_dtype).itemsize
        return self._arrays.ptr(self._rows.hidden) + row * self.hidden_size * itemsize

    def kv_pointer(self, layer: int, which: str, head: int) -> int:
        """The address (on this backend's device) of KV head ``head`` of ``layer`` (``which``: ``"key"`` or
        ``"value"``) at position 0: ``[max_length, head_size]`` elements of ``kv_dtype``, of which the first
        ``current_len()`` positions are valid and contiguous. The buffers are the backend's (shared, never copied);
        a reader must not write them and must not read past ``current_len()``. ``ValueError`` for a bad index."""
        return self.kv.pointer(layer, which, head)

    @property
    def kv_dtype(self) -> np.dtype:
        """The KV buffers' element type (the graph's)."""
        return self.graph.kv_dtype

    @property
    def device_type(self) -> str:
        """Where the buffers live, in IO-binding words: ``"cpu"`` or ``"cuda"``."""
        return self._arrays.device_type

    @property
    def device_id(self) -> int:
        return self.config.device_id

    @property
    def array_module(self) -> ArrayModule:
        """The buffers' array module (allocation, pointers, copies on this backend's device)."""
        return self._arrays

    @property
    def rows(self) -> RowBuffers:
        """The per-pass row buffers (the logits and hidden states of the last pass)."""
        return self._rows

    def __repr__(self) -> str:
        extra = ""
        if self.static_shapes:
            extra = ", static_shapes=True"
        if self.graphs is not None:
            extra += f", cuda_graphs={'on' if self.graphs.enabled else 'off (fell back)'}"
        return (
            f"OrtBackend({str(self.folder.path)!r}, provider={self.provider!r}, max_length={self.max_length}, "
            f"len={self.kv.length}, share_buffer={self.share_buffer}, kv={self.graph.kv_dtype}, "
            f"stateful={self.stateful}{extra})"
        )
