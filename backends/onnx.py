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
* **CUDA.** ``provider="cuda"`` keeps the KV, the inputs and the logits in device memory (CuPy arrays, or torch
  CUDA tensors where CuPy is missing), binds them by pointer, and copies to the host only the rows asked for;
  ``verify_picks`` reduces each row to its argmax and top-1/top-2 margin on the device.

Errors: every contract violation raises ``BackendError`` before any state changes; a failure inside ONNX Runtime
also raises ``BackendError`` and leaves ``current_len()`` where it was (positions past it are never read).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..adapters.model_dir import ModelFolder, ModelFolderError
from .base import BackendError, check_position, check_tokens

logger = logging.getLogger(__name__)

DEFAULT_PREFILL_CHUNK = 256

_ORT_TYPES = {
    "tensor(float)": np.dtype(np.float32),
    "tensor(float16)": np.dtype(np.float16),
    "tensor(int64)": np.dtype(np.int64),
    "tensor(int32)": np.dtype(np.int32),
}
_KV_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))
_ID_DTYPES = (np.dtype(np.int64), np.dtype(np.int32))


# ----------------------------------------------------------------------------------------------------------------
# Threads and session options
# ----------------------------------------------------------------------------------------------------------------


def physical_cores() -> int:
    """Physical CPU cores: psutil if installed, else distinct (physical id, core id) pairs in /proc/cpuinfo."""
    try:
        import psutil

        n = psutil.cpu_count(logical=False)
        if n:
            return int(n)
    except Exception:  # noqa: BLE001 - psutil is optional
        pass
    try:
        cores: set[tuple[str, str]] = set()
        phys = core = ""
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "physical id":
                    phys = value.strip()
                elif key == "core id":
                    core = value.strip()
                elif not key:  # blank line ends one logical processor
                    if core:
                        cores.add((phys, core))
                    phys = core = ""
        if core:
            cores.add((phys, core))
        if cores:
            return len(cores)
    except OSError:
        pass
    return os.cpu_count() or 1


_OPT_LEVELS = {
    "disable": "ORT_DISABLE_ALL",
    "basic": "ORT_ENABLE_BASIC",
    "extended": "ORT_ENABLE_EXTENDED",
    "layout": "ORT_ENABLE_LAYOUT",
    "all": "ORT_ENABLE_ALL",
}


def make_session_options(
    *,
    threads: int | None = None,
    inter_op_threads: int | None = None,
    graph_optimization_level: str = "all",
    allow_spinning: bool | None = None,
    enable_mem_pattern: bool | None = None,
    enable_cpu_mem_arena: bool | None = None,
    config_entries: Mapping[str, str] | None = None,
    genai_session_options: Mapping[str, Any] | None = None,
):
    """Build ``onnxruntime.SessionOptions`` for one decoder.

    ``threads`` (intra-op) defaults to :func:`physical_cores`. ``genai_session_options`` is the folder's
    ``model.decoder.session_options``: its thread counts, optimisation level, memory flags and
    ``config_entries`` apply first, and explicit arguments here override them.
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    g = dict(genai_session_options or {})
    if "log_id" in g:
        so.logid = str(g["log_id"])
    if "log_severity_level" in g:
        so.log_severity_level = int(g["log_severity_level"])
    else:
        so.log_severity_level = 3  # errors only: ORT warns about every node it leaves on the CPU
    if g.get("enable_profiling"):
        so.enable_profiling = True
    if "enable_cpu_mem_arena" in g:
        so.enable_cpu_mem_arena = bool(g["enable_cpu_mem_arena"])
    if "enable_mem_pattern" in g:
        so.enable_mem_pattern = bool(g["enable_mem_pattern"])
    for key, value in dict(g.get("config_entries", {}) or {}).items():
        so.add_session_config_entry(str(key), str(value))

    so.intra_op_num_threads = (
        int(threads) if threads is not None else int(g.get("intra_op_num_threads") or physical_cores())
    )
    if inter_op_threads is None:
        inter_op_threads = int(g.get("inter_op_num_threads") or 1)
    so.inter_op_num_threads = int(inter_op_threads)
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    level = graph_optimization_level.lower()
    if level not in _OPT_LEVELS:
        raise ValueError(
            f"graph_optimization_level must be one of {sorted(_OPT_LEVELS)}, got {graph_optimization_level!r}"
        )
    level_enum = getattr(ort.GraphOptimizationLevel, _OPT_LEVELS[level], None)
    if level_enum is None:  # older onnxruntime without ORT_ENABLE_LAYOUT
        level_enum = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.graph_optimization_level = level_enum
    if allow_spinning is not None:
        so.add_session_config_entry("session.intra_op.allow_spinning", "1" if allow_spinning else "0")
        so.add_session_config_entry("session.inter_op.allow_spinning", "1" if allow_spinning else "0")
    if enable_mem_pattern is not None:
        so.enable_mem_pattern = enable_mem_pattern
    if enable_cpu_mem_arena is not None:
        so.enable_cpu_mem_arena = enable_cpu_mem_arena
    for key, value in dict(config_entries or {}).items():
        so.add_session_config_entry(str(key), str(value))
    return so


_PRELOADED = False


def _preload_cuda_libraries(ort) -> None:
    """Let onnxruntime-gpu find CUDA libraries installed as nvidia-* pip packages (``onnxruntime.preload_dlls``)."""
    global _PRELOADED
    if _PRELOADED or not hasattr(ort, "preload_dlls"):
        return
    _PRELOADED = True
    import contextlib
    import io

    try:
        with contextlib.redirect_stdout(io.StringIO()):
            ort.preload_dlls()
    except Exception as exc:  # noqa: BLE001 - best effort: the session creation reports the real failure
        logger.debug("onnxruntime.preload_dlls() failed: %s", exc)


def _graph_uses_gqa(model_path: Path) -> bool:
    """True if the ONNX file mentions the GroupQueryAttention op (a scan of the graph file's bytes)."""
    needle = b"GroupQueryAttention"
    tail = b""
    try:
        with open(model_path, "rb") as f:
            while chunk := f.read(1 << 22):
                if needle in tail + chunk:
                    return True
                tail = chunk[-len(needle) :]
    except OSError:
        return False
    return False


# ----------------------------------------------------------------------------------------------------------------
# Array modules: numpy on the host, CuPy (or torch) on a CUDA device
# ----------------------------------------------------------------------------------------------------------------


class _HostArrays:
    device_type = "cpu"
    name = "numpy"

    def __init__(self, device_id: int = 0) -> None:
        self.device_id = device_id

    def empty(self, shape, dtype):
        return np.empty(shape, dtype)

    def zeros(self, shape, dtype):
        return np.zeros(shape, dtype)

    def from_host(self, host: np.ndarray):
        return np.array(host, copy=True)

    @staticmethod
    def ptr(a) -> int:
        return a.__array_interface__["data"][0]

    def upload(self, dst, host: np.ndarray) -> None:
        dst[...] = host

    def download(self, src, out: np.ndarray) -> None:
        out[...] = src

    def sync(self) -> None:
        pass

    def prefix(self, a, n: int):
        return np.ascontiguousarray(a[:, :, :n])

    def copy_positions(self, dst, src, start: int, stop: int) -> None:
        dst[:, :, start:stop] = src[:, :, start:stop]

    def argmax_margin(self, rows) -> tuple[np.ndarray, np.ndarray]:
        return argmax_margin(np.asarray(rows, dtype=np.float32))


class _CupyArrays(_HostArrays):
    device_type = "cuda"
    name = "cupy"

    def __init__(self, device_id: int = 0) -> None:
        import cupy

        self.cp = cupy
        self.device_id = device_id
        self._device = cupy.cuda.Device(device_id)
        self._am_out = None
        self._am_host = None
        self._kernel_failed = False

    def empty(self, shape, dtype):
        with self._device:
            return self.cp.empty(shape, dtype)

    def zeros(self, shape, dtype):
        with self._device:
            return self.cp.zeros(shape, dtype)

    def from_host(self, host):
        with self._device:
            return self.cp.asarray(host)

    @staticmethod
    def ptr(a) -> int:
        return int(a.data.ptr)

    def upload(self, dst, host):
        dst.set(np.ascontiguousarray(host, dtype=dst.dtype))

    def download(self, src, out):
        if src.dtype != out.dtype:
            src = src.astype(out.dtype)
        src.get(out=out)

    def sync(self):
        self._device.synchronize()

    def prefix(self, a, n):
        return self.cp.ascontiguousarray(a[:, :, :n])

    def copy_positions(self, dst, src, start, stop):
        dst[:, :, start:stop] = src[:, :, start:stop]

    def argmax_margin(self, rows):
        """One fused kernel (a block per row), then one device-to-host copy of ``2 * rows`` float64 numbers."""
        cp = self.cp
        k, n = rows.shape
        with self._device:
            if not rows.flags.c_contiguous:
                rows = cp.ascontiguousarray(rows)
            try:
                kernel = _cupy_argmax_kernel(cp, str(rows.dtype)) if not self._kernel_failed else None
            except Exception as exc:  # noqa: BLE001 - NVRTC missing or failing: use plain CuPy reductions
                logger.warning(
                    "OrtBackend: the fused argmax kernel did not compile (%s); using CuPy reductions",
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                )
                self._kernel_failed = True
                kernel = None
            if kernel is None:
                ids, margins = _xp_argmax_margin(cp, rows.astype(cp.float32, copy=False))
                return cp.asnumpy(ids).astype(np.int64), cp.asnumpy(margins).astype(np.float32)
            if self._am_out is None or self._am_out.shape[0] < 2 * k:
                self._am_out = cp.empty(2 * max(k, 16), cp.float64)
                self._am_host = np.empty(2 * max(k, 16), np.float64)
            kernel((k,), (_ARGMAX_THREADS,), (rows, np.int32(n), self._am_out))
            host = self._am_host[: 2 * k]
            self._am_out[: 2 * k].get(out=host)
        return host[0::2].astype(np.int64), host[1::2].astype(np.float32)


def _shape(shape) -> tuple[int, ...]:
    return tuple(int(d) for d in shape) if isinstance(shape, (tuple, list)) else (int(shape),)


class _TorchArrays(_HostArrays):
    device_type = "cuda"
    name = "torch"

    def __init__(self, device_id: int = 0) -> None:
        import torch

        self.torch = torch
        self.device_id = device_id
        self.dev = torch.device("cuda", device_id)
        self._types = {
            np.dtype(np.float32): torch.float32,
            np.dtype(np.float16): torch.float16,
            np.dtype(np.int64): torch.int64,
            np.dtype(np.int32): torch.int32,
        }

    def empty(self, shape, dtype):
        return self.torch.empty(_shape(shape), dtype=self._types[np.dtype(dtype)], device=self.dev)

    def zeros(self, shape, dtype):
        return self.torch.zeros(_shape(shape), dtype=self._types[np.dtype(dtype)], device=self.dev)

    def from_host(self, host):
        return self.torch.from_numpy(np.ascontiguousarray(host)).to(self.dev)

    @staticmethod
    def ptr(a) -> int:
        return int(a.data_ptr())

    def upload(self, dst, host):
        dst.copy_(self.torch.from_numpy(np.ascontiguousarray(host)))

    def download(self, src, out):
        self.torch.from_numpy(out).copy_(src)

    def sync(self):
        self.torch.cuda.synchronize(self.dev)

    def prefix(self, a, n):
        return a[:, :, :n].contiguous()

    def copy_positions(self, dst, src, start, stop):
        dst[:, :, start:stop].copy_(src[:, :, start:stop])

    def argmax_margin(self, rows):
        torch = self.torch
        rows = rows.to(torch.float32)
        n = rows.shape[1]
        arange = torch.arange(n, device=self.dev)
        top = rows.max(dim=1).values
        ids = torch.where(rows == top[:, None], arange, n).min(dim=1).values
        masked = rows.clone()
        masked[torch.arange(rows.shape[0], device=self.dev), ids] = -float("inf")
        margins = top - masked.max(dim=1).values
        return ids.cpu().numpy().astype(np.int64), margins.cpu().numpy().astype(np.float32)


def _xp_argmax_margin(xp, rows):
    """Argmax (lowest id on ties) and top-1/top-2 gap with array-module reductions (several kernels)."""
    n = rows.shape[1]
    top = rows.max(axis=1)
    ids = xp.where(rows == top[:, None], xp.arange(n), n).min(axis=1)
    masked = rows.copy()
    masked[xp.arange(rows.shape[0]), ids] = -xp.inf
    return ids, top - masked.max(axis=1)


_ARGMAX_THREADS = 256
# Per row (one block): the largest value, its lowest index, and the second largest value counting a repeat of the
# largest (so a tie gives a margin of 0). out[2*row] = index, out[2*row+1] = largest - second.
_ARGMAX_SOURCE = r"""
#define NT 256
extern "C" __global__ void ortspec_argmax_margin(const T* rows, const int n, double* out) {
    __shared__ float s1[NT];
    __shared__ float s2[NT];
    __shared__ int si[NT];
    const T* row = rows + (size_t)blockIdx.x * n;
    float v1 = __int_as_float(0xff800000), v2 = __int_as_float(0xff800000);  // -inf
    int i1 = 0x7fffffff;
    for (int j = threadIdx.x; j < n; j += NT) {
        float x = (float)row[j];
        if (x > v1) { v2 = v1; v1 = x; i1 = j; }
        else if (x > v2) { v2 = x; }
    }
    s1[threadIdx.x] = v1; s2[threadIdx.x] = v2; si[threadIdx.x] = i1;
    __syncthreads();
    for (int stride = NT / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
            const int o = threadIdx.x + stride;
            float a1 = s1[threadIdx.x], a2 = s2[threadIdx.x], b1 = s1[o], b2 = s2[o];
            int ai = si[threadIdx.x], bi = si[o];
            if (b1 > a1 || (b1 == a1 && bi < ai)) {
                s1[threadIdx.x] = b1; si[threadIdx.x] = bi; s2[threadIdx.x] = fmaxf(b2, a1);
            } else {
                s2[threadIdx.x] = fmaxf(a2, b1);
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        out[2 * blockIdx.x] = (double)si[0];
        out[2 * blockIdx.x + 1] = (double)(s1[0] - s2[0]);
    }
}
"""
_ARGMAX_KERNELS: dict[str, Any] = {}


def _cupy_argmax_kernel(cp, dtype: str):
    kernel = _ARGMAX_KERNELS.get(dtype)
    if kernel is None:
        head = {"float32": "#define T float\n", "float16": "#include <cuda_fp16.h>\n#define T __half\n"}[dtype]
        kernel = cp.RawKernel(head + _ARGMAX_SOURCE, "ortspec_argmax_margin")
        kernel.compile()
        _ARGMAX_KERNELS[dtype] = kernel
    return kernel


def argmax_margin(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the argmax (lowest id among ties) and the gap between the two largest values (0 on a tie)."""
    rows = np.asarray(rows)
    if rows.ndim != 2 or rows.shape[1] < 2:
        raise ValueError(f"argmax_margin needs a [rows, vocab>=2] array, got shape {rows.shape}")
    ids = np.argmax(rows, axis=1)  # numpy returns the first occurrence: the lowest id on ties
    two = np.partition(rows, rows.shape[1] - 2, axis=1)[:, -2:]
    margins = (two[:, 1] - two[:, 0]).astype(np.float32)
    return ids.astype(np.int64), margins


def _cuda_arrays(device_id: int, array_module: str):
    errors = []
    order = ("cupy", "torch") if array_module == "auto" else (array_module,)
    for name in order:
        try:
            if name == "cupy":
                return _CupyArrays(device_id)
            if name == "torch":
                arr = _TorchArrays(device_id)
                if not arr.torch.cuda.is_available():
                    raise RuntimeError("torch.cuda.is_available() is False")
                return arr
            raise ValueError(f"array_module must be 'auto', 'cupy' or 'torch', got {name!r}")
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - report why each option failed
            errors.append(f"{name}: {exc}")
    raise BackendError(
        "provider='cuda' needs CuPy (pip install 'ortspec[cuda]') or torch with CUDA for device buffers; "
        + "; ".join(errors)
    )


# ----------------------------------------------------------------------------------------------------------------
# The backend
# ----------------------------------------------------------------------------------------------------------------


class OrtBackend:
    """One sequence's KV cache and decoder session on ONNX Runtime (CPU or CUDA execution provider)."""

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
        import onnxruntime as ort

        self._ort = ort
        self.session = session
        self.folder = folder
        self.provider = provider
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.prefill_chunk = int(prefill_chunk)
        cap = folder.context_length
        if max_length is None:
            max_length = cap
        if not 1 <= max_length <= cap:
            raise ValueError(f"max_length must be in [1, {cap}] (the model's context_length), got {max_length}")
        self._max_length = int(max_length)
        self._vocab = folder.vocab_size
        self._len = 0
        # DevicePicks: the driver asks for picks (verify_picks) when the logits live on a device.
        self.picks_on_device = provider == "cuda"
        self.threads = session.get_session_options().intra_op_num_threads

        self._inspect_graph()
        want_share = folder.past_present_share_buffer if share_buffer is None else bool(share_buffer)
        gqa = _graph_uses_gqa(folder.model_path)
        self.share_buffer = want_share and gqa
        if not self.share_buffer:
            why = (
                "the graph has no GroupQueryAttention op"
                if want_share and not gqa
                else "past/present buffer sharing is off (search.past_present_share_buffer or share_buffer=False)"
            )
            logger.warning(
                "OrtBackend(%s): %s; using the grow/copy KV path (slower, copies the KV each step)", folder.path, why
            )

        self._xp = _HostArrays(device_id) if provider == "cpu" else _cuda_arrays(device_id, array_module)
        self._device_type = self._xp.device_type
        self._device_id = device_id
        xp = self._xp
        self._kv_shape = (1, folder.num_kv_heads, self._max_length, folder.head_size)
        self._keys = [xp.zeros(self._kv_shape, self._kv_dtype) for _ in range(folder.num_layers)]
        self._values = [xp.zeros(self._kv_shape, self._kv_dtype) for _ in range(folder.num_layers)]
        self._ids_host = np.empty(0, self._ids_dtype)
        self._mask = xp.from_host(np.ones(self._max_length, self._mask_dtype)) if self._mask_name else None
        self._pos = xp.from_host(np.arange(self._max_length, dtype=self._pos_dtype)) if self._pos_name else None
        self._rows = 0
        self._alloc_rows(max(self.prefill_chunk, 1))

        self._io = session.io_binding()
        if self.share_buffer:
            for layer in range(folder.num_layers):
                for pattern_in, pattern_out, buf in (
                    (folder.past_key_pattern, folder.present_key_pattern, self._keys[layer]),
                    (folder.past_value_pattern, folder.present_value_pattern, self._values[layer]),
                ):
                    ptr = xp.ptr(buf)
                    self._io.bind_input(
                        pattern_in % layer, self._device_type, device_id, self._kv_dtype, list(self._kv_shape), ptr
                    )
                    self._io.bind_output(
                        pattern_out % layer, self._device_type, device_id, self._kv_dtype, list(self._kv_shape), ptr
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
        """
        import onnxruntime as ort

        try:
            folder = folder_or_path if isinstance(folder_or_path, ModelFolder) else ModelFolder.load(folder_or_path)
        except ModelFolderError as exc:
            raise BackendError(str(exc)) from exc
        provider = provider.lower()
        if provider not in ("cpu", "cuda"):
            raise ValueError(f"provider must be 'cpu' or 'cuda', got {provider!r}")
        if provider == "cuda":
            available = ort.get_available_providers()
            if "CUDAExecutionProvider" not in available:
                raise BackendError(
                    "provider='cuda' but this onnxruntime has no CUDAExecutionProvider (available: "
                    + ", ".join(available)
                    + "); install onnxruntime-gpu (pip install 'ortspec[cuda]')"
                )
            _preload_cuda_libraries(ort)
            providers = [("CUDAExecutionProvider", {"device_id": str(device_id)}), "CPUExecutionProvider"]
        else:
            providers = ["CPUExecutionProvider"]
        so = session_options
        if so is None:
            so = make_session_options(
                threads=threads,
                graph_optimization_level=graph_optimization_level,
                allow_spinning=allow_spinning,
                config_entries=config_entries,
                genai_session_options=folder.session_options,
            )
        try:
            session = ort.InferenceSession(str(folder.model_path), sess_options=so, providers=providers)
        except Exception as exc:  # noqa: BLE001 - ORT raises its own exception types
            raise BackendError(f"onnxruntime could not load {folder.model_path}: {exc}") from exc
        if provider == "cuda" and "CUDAExecutionProvider" not in session.get_providers():
            raise BackendError(
                f"the session for {folder.model_path} did not get the CUDA execution provider: onnxruntime could "
                "not load its CUDA libraries (CUDA/cuBLAS of the major version this onnxruntime-gpu was built for, "
                "e.g. the nvidia-* pip packages that torch installs)"
            )
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

    # ------------------------------------------------------------------------------------------------------------
    def _inspect_graph(self) -> None:
        """Check the session declares what genai_config.json names, with dtypes this backend can feed."""
        f = self.folder
        where = f"{f.model_path}"
        inputs = {i.name: i for i in self.session.get_inputs()}
        outputs = {o.name: o for o in self.session.get_outputs()}

        def dtype_of(arg, allowed, what):
            dt = _ORT_TYPES.get(arg.type)
            if dt is None or dt not in allowed:
                raise BackendError(
                    f"{where}: {what} {arg.name!r} has type {arg.type}; supported: "
                    + ", ".join(str(a) for a in allowed)
                )
            return dt

        def need(table, name, what):
            if name not in table:
                raise BackendError(
                    f"{where}: the graph has no {what} named {name!r} (genai_config.json names it); "
                    f"it declares {sorted(table)[:8]}{' ...' if len(table) > 8 else ''}"
                )
            return table[name]

        fed: set[str] = set()
        ids = need(inputs, f.input_ids_name, "input")
        self._ids_name = ids.name
        self._ids_dtype = dtype_of(ids, _ID_DTYPES, "input")
        fed.add(ids.name)

        mask_name = f.attention_mask_name or "attention_mask"
        self._mask_name = mask_name if mask_name in inputs else None
        self._mask_dtype = dtype_of(inputs[mask_name], _ID_DTYPES, "input") if self._mask_name else None
        pos_name = f.position_ids_name or "position_ids"
        self._pos_name = pos_name if pos_name in inputs else None
        self._pos_dtype = dtype_of(inputs[pos_name], _ID_DTYPES, "input") if self._pos_name else None
        fed.update(n for n in (self._mask_name, self._pos_name) if n)
        if self._mask_name is None and self._pos_name is None:
            raise BackendError(
                f"{where}: the graph declares neither {mask_name!r} nor {pos_name!r}, so this backend cannot tell "
                "it the sequence length"
            )

        kv_dtype = None
        for layer in range(f.num_layers):
            for pattern, table, what in (
                (f.past_key_pattern, inputs, "input"),
                (f.past_value_pattern, inputs, "input"),
                (f.present_key_pattern, outputs, "output"),
                (f.present_value_pattern, outputs, "output"),
            ):
                arg = need(table, pattern % layer, what)
                dt = dtype_of(arg, _KV_DTYPES, what)
                if kv_dtype is None:
                    kv_dtype = dt
                elif dt != kv_dtype:
                    raise BackendError(
                        f"{where}: {what} {arg.name!r} is {arg.type} but other KV tensors are {kv_dtype}"
                    )
                shape = list(arg.shape)
                if len(shape) != 4:
                    raise BackendError(
                        f"{where}: {what} {arg.name!r} has rank {len(shape)}, expected 4 "
                        "([batch, kv_heads, length, head_size])"
                    )
                for axis, expect, label in ((1, f.num_kv_heads, "num_key_value_heads"), (3, f.head_size, "head_size")):
                    if isinstance(shape[axis], int) and shape[axis] != expect:
                        raise BackendError(
                            f"{where}: {what} {arg.name!r} has dim {axis} = {shape[axis]} but genai_config.json "
                            f"says {label} = {expect}"
                        )
                if table is inputs:
                    fed.add(arg.name)
        if f.num_layers and (f.past_key_pattern % f.num_layers) in inputs:
            raise BackendError(
                f"{where}: the graph has more layers than genai_config.json's num_hidden_layers = {f.num_layers}"
            )
        self._kv_dtype = kv_dtype

        logits = need(outputs, f.logits_name, "output")
        self._logits_dtype = dtype_of(logits, _KV_DTYPES, "output")
        lshape = list(logits.shape)
        if len(lshape) != 3:
            raise BackendError(
                f"{where}: output {logits.name!r} has rank {len(lshape)}, expected 3 ([batch, sequence, vocab])"
            )
        if isinstance(lshape[2], int) and lshape[2] != f.vocab_size:
            raise BackendError(
                f"{where}: output {logits.name!r} has vocab dim {lshape[2]} but genai_config.json "
                f"says vocab_size = {f.vocab_size}"
            )
        self._logits_name = logits.name

        extra = sorted(set(inputs) - fed)
        if extra:
            raise BackendError(f"{where}: the graph declares inputs this backend does not know how to feed: {extra}")

    def _alloc_rows(self, rows: int) -> None:
        """(Re)allocate the per-pass buffers for up to ``rows`` tokens: ids, logits, host float32 logits."""
        if rows <= self._rows:
            return
        if self._rows:
            logger.info("OrtBackend: growing the logits buffer from %d to %d rows", self._rows, rows)
        xp = self._xp
        self._rows = rows
        self._ids_host = np.zeros(rows, self._ids_dtype)
        self._ids = self._ids_host if self._device_type == "cpu" else xp.zeros(rows, self._ids_dtype)
        self._logits = xp.empty((rows, self._vocab), self._logits_dtype)
        on_host_f32 = self._device_type == "cpu" and self._logits_dtype == np.float32
        self._host_logits = self._logits if on_host_f32 else np.empty((rows, self._vocab), np.float32)

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

    def rewind(self, length: int) -> None:
        length = int(length)
        if not 0 <= length <= self._len:
            raise BackendError(f"rewind({length}) but the KV cache holds {self._len} positions")
        self._len = length

    def decode(self, tokens: Sequence[int], past: int) -> np.ndarray:
        tokens = self._validate(tokens, past, "past")
        n = len(tokens)
        start_len = self._len
        try:
            start = 0
            while start < n:
                rows = min(self.prefill_chunk, n - start)
                self._run(tokens[start : start + rows])
                start += rows
        except BaseException:
            self._len = start_len  # chunks already folded in are forgotten: the call had no effect
            raise
        return self._fetch_row(rows - 1)

    def decode_verify(self, tokens: Sequence[int], base: int) -> np.ndarray:
        tokens = self._validate(tokens, base, "base")
        self._alloc_rows(len(tokens))
        self._run(tokens)
        return self._fetch_rows(len(tokens))

    def verify_picks(self, tokens: Sequence[int], base: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``decode_verify`` pass, reduced to each row's argmax id (lowest on ties) and top-1/top-2 gap."""
        tokens = self._validate(tokens, base, "base")
        k = len(tokens)
        self._alloc_rows(k)
        self._run(tokens)
        return self._xp.argmax_margin(self._logits[:k])

    # ------------------------------------------------------------------------------------------------------------
    def _validate(self, tokens: Sequence[int], position: int, what: str) -> np.ndarray:
        try:
            arr = np.asarray(tokens)
        except Exception as exc:  # noqa: BLE001
            raise BackendError(f"tokens must be a sequence of ints: {exc}") from exc
        if arr.ndim != 1:
            raise BackendError(f"tokens must be a flat sequence of ids, got shape {arr.shape}")
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            if not all(float(t).is_integer() for t in arr.tolist()):
                raise BackendError(f"tokens must be integer ids, got dtype {arr.dtype}")
        if arr.size == 0 or int(arr.min()) < 0 or int(arr.max()) >= self._vocab:
            check_tokens(arr.tolist(), self._vocab)  # raises, naming the problem
        check_position(int(position), self._len, int(arr.size), self._max_length, what)
        return arr.astype(np.int64, copy=False)

    def _run(self, tokens: np.ndarray) -> None:
        """One session run over ``tokens`` at position ``current_len()``; on success the length grows."""
        io = self._io
        dev, dev_id, xp = self._device_type, self._device_id, self._xp
        s = len(tokens)
        past = self._len
        total = past + s
        self._alloc_rows(s)
        self._ids_host[:s] = tokens
        if dev != "cpu":
            xp.upload(self._ids[:s], self._ids_host[:s])
        io.bind_input(self._ids_name, dev, dev_id, self._ids_dtype, [1, s], xp.ptr(self._ids))
        if self._mask_name:
            io.bind_input(self._mask_name, dev, dev_id, self._mask_dtype, [1, total], xp.ptr(self._mask))
        if self._pos_name:
            io.bind_input(
                self._pos_name,
                dev,
                dev_id,
                self._pos_dtype,
                [1, s],
                xp.ptr(self._pos) + past * self._pos_dtype.itemsize,
            )
        io.bind_output(self._logits_name, dev, dev_id, self._logits_dtype, [1, s, self._vocab], xp.ptr(self._logits))

        presents = None
        if not self.share_buffer:
            presents = self._bind_grow_copy(past, total)
        xp.sync()
        try:
            self.session.run_with_iobinding(io)
            io.synchronize_outputs()
        except Exception as exc:  # noqa: BLE001 - ORT raises its own exception types
            raise BackendError(f"onnxruntime failed on {s} tokens at position {past}: {exc}") from exc
        if presents is not None:
            for layer, (pk, pv) in enumerate(presents):
                xp.copy_positions(self._keys[layer], pk, past, total)
                xp.copy_positions(self._values[layer], pv, past, total)
        self._len = total

    def _bind_grow_copy(self, past: int, total: int):
        """Grow/copy KV path: feed the first ``past`` positions, collect ``total`` into fresh buffers."""
        f, io, xp = self.folder, self._io, self._xp
        dev, dev_id = self._device_type, self._device_id
        _, kv_heads, _, head_size = self._kv_shape
        presents = []
        self._pasts = []  # keep the fed copies alive through the run
        for layer in range(f.num_layers):
            pair = []
            for pattern_in, pattern_out, buf in (
                (f.past_key_pattern, f.present_key_pattern, self._keys[layer]),
                (f.past_value_pattern, f.present_value_pattern, self._values[layer]),
            ):
                fed = xp.prefix(buf, past)
                self._pasts.append(fed)
                if past == 0:
                    # a zero-length tensor may have a null data pointer; bind it as an OrtValue instead
                    host = np.zeros((1, kv_heads, 0, head_size), self._kv_dtype)
                    self._pasts.append(host)
                    io.bind_ortvalue_input(pattern_in % layer, self._ort.OrtValue.ortvalue_from_numpy(host))
                else:
                    io.bind_input(
                        pattern_in % layer, dev, dev_id, self._kv_dtype, [1, kv_heads, past, head_size], xp.ptr(fed)
                    )
                out = xp.empty((1, kv_heads, total, head_size), self._kv_dtype)
                io.bind_output(
                    pattern_out % layer, dev, dev_id, self._kv_dtype, [1, kv_heads, total, head_size], xp.ptr(out)
                )
                pair.append(out)
            presents.append(tuple(pair))
        return presents

    def _fetch_row(self, row: int) -> np.ndarray:
        if self._host_logits is self._logits:
            return self._logits[row]
        out = self._host_logits[row]
        self._xp.download(self._logits[row], out)
        return out

    def _fetch_rows(self, k: int) -> np.ndarray:
        if self._host_logits is self._logits:
            return self._logits[:k]
        out = self._host_logits[:k]
        self._xp.download(self._logits[:k], out)
        return out

    def __repr__(self) -> str:
        return (
            f"OrtBackend({str(self.folder.path)!r}, provider={self.provider!r}, max_length={self._max_length}, "
            f"len={self._len}, share_buffer={self.share_buffer}, kv={self._kv_dtype})"
        )
