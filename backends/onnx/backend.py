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
  ``verify_picks`` reduces each row to its argmax and top-1/top-2 margin on the device.

Errors: every contract violation raises ``BackendError`` before any state changes; a failure inside ONNX Runtime
also raises ``BackendError`` and leaves ``current_len()`` where it was (positions past it are never read).

The parts: ``folder`` reads the model folder, ``session`` opens the session, ``graph`` checks the graph against
the folder, ``arrays`` holds the buffers of each device and the argmax/margin reductions.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence

import numpy as np

from ..base import BackendError, check_position, check_tokens
from .arrays import ArrayModule, HostArrays, cuda_arrays
from .folder import ModelFolder, ModelFolderError
from .graph import inspect_graph
from .session import execution_providers, make_session_options, open_session

logger = logging.getLogger(__name__)

DEFAULT_PREFILL_CHUNK = 256


class OrtBackend:
    """One sequence's KV cache and decoder session on ONNX Runtime (CPU or CUDA execution provider).

    Public attributes: ``session`` (the ``InferenceSession``), ``folder`` (its :class:`ModelFolder`), ``graph``
    (the checked :class:`~ortspec.backends.onnx.graph.DecoderGraph`), ``provider`` (``"cpu"`` or ``"cuda"``),
    ``prefill_chunk``, ``threads`` (intra-op), ``share_buffer`` (True: the in-place KV path) and
    ``picks_on_device`` (the ``DevicePicks`` capability: True on CUDA). The backend owns its buffers: the logits
    that ``decode`` and ``decode_verify`` return are views of them, valid until its next call."""

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
        array_module: str = "auto",
    ) -> None:
        """Wrap an open ``session`` of ``folder``'s decoder (see :meth:`from_folder`, which opens one)."""
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
        self._max_length = int(max_length)
        self._vocab = folder.vocab_size
        self._len = 0
        # DevicePicks: the driver asks for picks (verify_picks) when the logits live on a device.
        self.picks_on_device = provider == "cuda"
        self.threads = session.get_session_options().intra_op_num_threads

        self.graph = inspect_graph(session, folder)
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

        self._arrays: ArrayModule = HostArrays(device_id) if provider == "cpu" else cuda_arrays(device_id, array_module)
        self._device_type = self._arrays.device_type
        self._device_id = device_id
        arrays, graph = self._arrays, self.graph
        # per layer, [1, kv_heads, max_length, head_size] of graph.kv_dtype; positions >= current_len() are stale
        self._kv_shape = (1, folder.num_kv_heads, self._max_length, folder.head_size)
        self._keys = [arrays.zeros(self._kv_shape, graph.kv_dtype) for _ in range(folder.num_layers)]
        self._values = [arrays.zeros(self._kv_shape, graph.kv_dtype) for _ in range(folder.num_layers)]
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
        self._rows = 0
        self._alloc_rows(max(self.prefill_chunk, 1))

        self._binding = session.io_binding()
        if self.share_buffer:
            for layer, names in enumerate(graph.kv_names):
                for past_name, present_name, buffer in (
                    (names.past_key, names.present_key, self._keys[layer]),
                    (names.past_value, names.present_value, self._values[layer]),
                ):
                    address = arrays.ptr(buffer)
                    shape = list(self._kv_shape)
                    self._binding.bind_input(past_name, self._device_type, device_id, graph.kv_dtype, shape, address)
                    self._binding.bind_output(
                        present_name, self._device_type, device_id, graph.kv_dtype, shape, address
                    )

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
    ) -> OrtBackend:
        """Open the decoder in a builder-written folder.

        ``provider``: ``"cpu"`` or ``"cuda"``. ``threads``: intra-op threads (default: physical cores).
        ``max_length``: KV capacity (default and maximum: the model's ``context_length``). ``share_buffer``:
        force the grow/copy KV path with ``False`` (default: the folder's ``past_present_share_buffer``).
        ``session_options``: a ready ``onnxruntime.SessionOptions`` that replaces all the option arguments.
        ``array_module`` (CUDA only): ``"cupy"``, ``"torch"`` or ``"auto"`` (CuPy, else torch).
        A folder or session problem raises ``BackendError``; a bad argument ``ValueError``.
        """
        import onnxruntime  # noqa: F401 - fail here, before any work, when it is missing

        try:
            folder = folder_or_path if isinstance(folder_or_path, ModelFolder) else ModelFolder.load(folder_or_path)
        except ModelFolderError as exc:
            raise BackendError(str(exc)) from exc
        provider = provider.lower()
        if provider not in ("cpu", "cuda"):
            raise ValueError(f"provider must be 'cpu' or 'cuda', got {provider!r}")
        providers = execution_providers(provider, device_id)
        options = session_options
        if options is None:
            options = make_session_options(
                threads=threads,
                graph_optimization_level=graph_optimization_level,
                allow_spinning=allow_spinning,
                config_entries=config_entries,
                genai_session_options=folder.session_options,
            )
        session = open_session(folder.model_path, providers=providers, session_options=options)
        return cls(
            session,
            folder,
            provider=provider,
            device_id=device_id,
            max_length=max_length,
            prefill_chunk=prefill_chunk,
            share_buffer=share_buffer,
            array_module=array_module,
        )

    def _alloc_rows(self, rows: int) -> None:
        """(Re)allocate the per-pass buffers for up to ``rows`` tokens: ids (host, and device on CUDA), logits
        ``[rows, vocab]`` in the graph's dtype, and the host float32 logits handed out (the logits buffer itself
        when it is already a float32 host array)."""
        if rows <= self._rows:
            return
        if self._rows:
            logger.info("OrtBackend: growing the logits buffer from %d to %d rows", self._rows, rows)
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

    def rewind(self, length: int) -> None:
        length = int(length)
        if not 0 <= length <= self._len:
            raise BackendError(f"rewind({length}) but the KV cache holds {self._len} positions")
        self._len = length

    def decode(self, tokens: Sequence[int], past: int) -> np.ndarray:
        ids = self._validate(tokens, past, "past")
        count = len(ids)
        start_len = self._len
        try:
            start = 0
            while start < count:
                chunk = min(self.prefill_chunk, count - start)
                self._run(ids[start : start + chunk])
                start += chunk
        except BaseException:
            self._len = start_len  # chunks already folded in are forgotten: the call had no effect
            self._hidden_rows = (0, 0)
            raise
        return self._host_row(chunk - 1)

    def decode_verify(self, tokens: Sequence[int], base: int) -> np.ndarray:
        ids = self._validate(tokens, base, "base")
        self._alloc_rows(len(ids))
        self._run(ids)
        return self._host_rows(len(ids))

    def verify_picks(self, tokens: Sequence[int], base: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``decode_verify`` pass, reduced where the logits live to each row's argmax id (lowest on ties;
        int64 ``[len(tokens)]``, always in ``[0, vocab)``) and top-1/top-2 gap (float32 ``[len(tokens)]``; NaN for
        a row that is not finite where its pick is made); fresh host arrays."""
        ids = self._validate(tokens, base, "base")
        count = len(ids)
        self._alloc_rows(count)
        self._run(ids)
        return self._arrays.argmax_margin(self._logits[:count])

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

    def _run(self, tokens: np.ndarray) -> None:
        """One session run over ``tokens`` at position ``current_len()``; on success the length grows."""
        binding, graph, arrays = self._binding, self.graph, self._arrays
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
        binding.bind_output(
            graph.logits_name, device, device_id, graph.logits_dtype, [1, count, self._vocab], arrays.ptr(self._logits)
        )
        if graph.hidden_name:
            shape = [1, count, graph.hidden_size]
            binding.bind_output(
                graph.hidden_name, device, device_id, graph.hidden_dtype, shape, arrays.ptr(self._hidden)
            )
            self._hidden_rows = (0, 0)  # overwritten by this run

        presents = None
        if not self.share_buffer:
            presents = self._bind_grow_copy(past, total)
        arrays.sync()
        try:
            self.session.run_with_iobinding(binding)
            binding.synchronize_outputs()
        except Exception as exc:  # noqa: BLE001 - ORT raises its own exception types
            raise BackendError(f"onnxruntime failed on {count} tokens at position {past}: {exc}") from exc
        if presents is not None:
            for layer, (present_key, present_value) in enumerate(presents):
                arrays.copy_positions(self._keys[layer], present_key, past, total)
                arrays.copy_positions(self._values[layer], present_value, past, total)
        self._len = total
        if graph.hidden_name:
            self._hidden_rows = (past, count)

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
        return (
            f"OrtBackend({str(self.folder.path)!r}, provider={self.provider!r}, max_length={self._max_length}, "
            f"len={self._len}, share_buffer={self.share_buffer}, kv={self.graph.kv_dtype})"
        )
