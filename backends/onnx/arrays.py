"""Array modules: where the backend's buffers live and how bytes move between them and the host, plus the
per-row argmax/margin reductions behind ``verify_picks``.

* :class:`HostArrays` (numpy, for the CPU provider), :class:`CupyArrays` and :class:`TorchArrays` (CUDA device
  memory) share the :class:`ArrayModule` interface; :func:`cuda_arrays` picks a CUDA one.
* The picks contract (``DevicePicks`` in ``backends/base.py``), which every reduction here honours: for each row of
  a ``[rows, vocab]`` array, the argmax id (the lowest id among equal maxima; always in ``[0, vocab)``) as int64,
  and the gap between the two largest values (0 on a tie) as float32. The margin is NaN when the row is not
  finite where its pick is made: it holds a NaN, or its largest value is +inf, or every value is -inf (the rows
  ``core.state.step`` refuses). The id of such a row is in range but otherwise unspecified.
  :func:`argmax_margin` (numpy), :func:`xp_argmax_margin` (numpy or CuPy reductions), :func:`torch_argmax_margin`
  (torch tensors on any device) and the fused CUDA kernel (:data:`ARGMAX_MARGIN_SOURCE`).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import numpy as np

from ..base import BackendError, argmax_margin

logger = logging.getLogger(__name__)


class ArrayModule(Protocol):
    """Buffers on one device, addressed by raw pointers for ONNX Runtime's IO binding.

    Arrays are C-contiguous, shaped and typed as asked (numpy dtypes name the element types). KV buffers are
    ``[1, kv_heads, positions, head_size]``. Host arrays passed in are numpy and are never kept.
    """

    device_type: str  # the IO-binding device name: "cpu" or "cuda"
    name: str  # "numpy", "cupy" or "torch"
    device_id: int

    def empty(self, shape, dtype) -> Any:
        """An uninitialised buffer."""
        ...

    def zeros(self, shape, dtype) -> Any:
        """A zero-filled buffer."""
        ...

    def from_host(self, host: np.ndarray) -> Any:
        """A new buffer holding a copy of ``host``."""
        ...

    def ptr(self, array) -> int:
        """The address of ``array``'s first element."""
        ...

    def upload(self, destination, host: np.ndarray) -> None:
        """Copy ``host`` into ``destination`` (same shape; converted to its dtype)."""
        ...

    def download(self, source, out: np.ndarray) -> None:
        """Copy ``source`` into the host array ``out`` (same shape; converted to its dtype)."""
        ...

    def sync(self) -> None:
        """Wait until the device has finished the work queued so far."""
        ...

    def prefix(self, kv, positions: int) -> Any:
        """A new contiguous buffer holding the first ``positions`` positions of a KV buffer."""
        ...

    def copy_positions(self, destination, source, start: int, stop: int) -> None:
        """Copy KV positions ``[start, stop)`` from ``source`` into ``destination``."""
        ...

    def copy(self, destination, source) -> None:
        """Copy ``source`` into ``destination`` (arrays of this module, same shape; converted to its dtype)."""
        ...

    def argmax_margin(self, rows) -> tuple[np.ndarray, np.ndarray]:
        """The picks contract (module docstring) on ``rows`` ``[count, vocab]``, returned as host arrays."""
        ...

    # The stream-ordered path (``BackendConfig(static_shapes=True)`` on CUDA): ONNX Runtime runs on this module's
    # stream, so the copies below need no host synchronisation to be ordered with its runs.
    def own_stream(self) -> int | None:
        """Make a new stream this module enqueues its work on from now on; return its handle (None on the host,
        which has no streams)."""
        ...

    def stream_ptr(self) -> int | None:
        """The handle of the stream this module enqueues its work on, or None (the default stream; the host)."""
        ...

    def pinned_empty(self, shape, dtype) -> np.ndarray:
        """An uninitialised host array in page-locked memory (a plain numpy array on the host), so that copies
        from it are asynchronous."""
        ...

    def copy_from_host(self, destination, host: np.ndarray) -> None:
        """Enqueue a copy of ``host`` (same shape and dtype) into ``destination`` on this module's stream. The copy
        is asynchronous when ``host`` is pinned: ``host`` must then not change until the stream has passed it."""
        ...

    def end_capture(self) -> bool:
        """End and discard a CUDA graph capture left open on this module's stream (after a failed capture); True
        if one was open. The host has none: False."""
        ...


# ----------------------------------------------------------------------------------------------------------------
# Reductions
# ----------------------------------------------------------------------------------------------------------------


def xp_argmax_margin(xp, rows):
    """:func:`argmax_margin` with reductions of the array module ``xp`` (numpy or CuPy; several kernels on a device).

    ``rows``: a float ``[count, vocab]`` array of ``xp``. Returns ``(ids, margins)`` as ``xp`` arrays (integer ids,
    margins of ``rows``' dtype). A row holding a NaN picks its first NaN, as ``numpy.argmax`` does."""
    count, vocab = rows.shape
    top = rows.max(axis=1)  # NaN for a row that holds one
    at_top = (rows == top[:, None]) | xp.isnan(rows)
    ids = xp.where(at_top, xp.arange(vocab), vocab).min(axis=1)  # < vocab: every row has an element at its top
    rest = rows.copy()
    rest[xp.arange(count), ids] = -xp.inf
    second = rest.max(axis=1)
    finite = xp.isfinite(top)
    gaps = xp.where(finite, top, 0) - xp.where(finite, second, 0)
    return ids, xp.where(finite, gaps, xp.nan).astype(rows.dtype)


def torch_argmax_margin(rows) -> tuple[np.ndarray, np.ndarray]:
    """:func:`argmax_margin` on a torch tensor ``[count, vocab]`` on any device (computed there in float32);
    returns host numpy arrays (int64 ids, float32 margins). A row holding a NaN picks its first NaN."""
    import torch

    rows = rows.to(torch.float32)
    count, vocab = rows.shape
    top = rows.max(dim=1).values  # NaN for a row that holds one
    at_top = (rows == top[:, None]) | rows.isnan()
    columns = torch.arange(vocab, device=rows.device)
    ids = torch.where(at_top, columns, vocab).min(dim=1).values  # < vocab: every row has an element at its top
    rest = rows.clone()
    rest[torch.arange(count, device=rows.device), ids] = -float("inf")
    second = rest.max(dim=1).values
    finite = torch.isfinite(top)
    gaps = torch.where(finite, top, 0.0) - torch.where(finite, second, 0.0)
    margins = torch.where(finite, gaps, float("nan"))
    return ids.cpu().numpy().astype(np.int64), margins.cpu().numpy().astype(np.float32)


ARGMAX_THREADS = 256  # threads per block; the kernel source's THREADS
# One block per row, ``THREADS`` threads striding over it. Each thread keeps its largest value, that value's
# lowest index, the second largest value counting a repeat of the largest (so a tie gives a margin of 0), and
# whether it saw a NaN (NaN compares false, so it never enters the running values); a tree reduction in shared
# memory merges the threads, and ``__syncthreads_or`` ORs their NaN flags. Output ``out`` (float64,
# ``[2 * rows]``): ``out[2 * row]`` the index (0 when nothing compared greater than -inf: an all -inf or NaN
# row), ``out[2 * row + 1]`` largest - second, or NaN when the row holds a NaN or its largest value is +-inf.
# ``T`` (the element type) is defined in front of this source.
ARGMAX_MARGIN_SOURCE = r"""
extern "C" __global__ void ortspec_argmax_margin(const T* rows, const int vocab, double* out) {
    __shared__ float block_top[THREADS];
    __shared__ float block_second[THREADS];
    __shared__ int block_top_id[THREADS];
    const int thread = threadIdx.x;
    const int no_id = 0x7fffffff;
    const float negative_infinity = __int_as_float(0xff800000);
    const float positive_infinity = __int_as_float(0x7f800000);
    const T* row = rows + (size_t)blockIdx.x * vocab;
    float top = negative_infinity, second = negative_infinity;
    int top_id = no_id;
    int saw_nan = 0;
    for (int j = thread; j < vocab; j += THREADS) {
        const float x = (float)row[j];
        saw_nan |= (x != x);
        if (x > top) { second = top; top = x; top_id = j; }
        else if (x > second) { second = x; }
    }
    block_top[thread] = top; block_second[thread] = second; block_top_id[thread] = top_id;
    const int row_has_nan = __syncthreads_or(saw_nan);  // also the barrier before the reduction
    for (int stride = THREADS / 2; stride > 0; stride >>= 1) {
        if (thread < stride) {
            const int other = thread + stride;
            const float mine = block_top[thread], theirs = block_top[other];
            const int my_id = block_top_id[thread], their_id = block_top_id[other];
            if (theirs > mine || (theirs == mine && their_id < my_id)) {
                block_top[thread] = theirs; block_top_id[thread] = their_id;
                block_second[thread] = fmaxf(block_second[other], mine);
            } else {
                block_second[thread] = fmaxf(block_second[thread], theirs);
            }
        }
        __syncthreads();
    }
    if (thread == 0) {
        const float best = block_top[0];
        const bool finite = best > negative_infinity && best < positive_infinity;
        out[2 * blockIdx.x] = (double)(block_top_id[0] == no_id ? 0 : block_top_id[0]);
        out[2 * blockIdx.x + 1] = (row_has_nan || !finite) ? __longlong_as_double(0x7ff8000000000000LL)
                                                           : (double)(best - block_second[0]);
    }
}
"""
_ELEMENT_TYPES = {"float32": "#define T float\n", "float16": "#include <cuda_fp16.h>\n#define T __half\n"}
_compiled_kernels: dict[str, Any] = {}


def cupy_argmax_kernel(cp, dtype: str):
    """The compiled kernel for rows of ``dtype`` (``"float32"`` or ``"float16"``), compiled once per process.
    Raises (``KeyError`` for another dtype, CuPy's errors when NVRTC fails)."""
    kernel = _compiled_kernels.get(dtype)
    if kernel is None:
        head = _ELEMENT_TYPES[dtype] + f"#define THREADS {ARGMAX_THREADS}\n"
        kernel = cp.RawKernel(head + ARGMAX_MARGIN_SOURCE, "ortspec_argmax_margin")
        kernel.compile()
        _compiled_kernels[dtype] = kernel
    return kernel


# ----------------------------------------------------------------------------------------------------------------
# Array modules
# ----------------------------------------------------------------------------------------------------------------


class HostArrays:
    """numpy buffers in host memory (the CPU provider)."""

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
    def ptr(array) -> int:
        return array.__array_interface__["data"][0]

    def upload(self, destination, host: np.ndarray) -> None:
        destination[...] = host

    def download(self, source, out: np.ndarray) -> None:
        out[...] = source

    def sync(self) -> None:
        pass

    def prefix(self, kv, positions: int):
        return np.ascontiguousarray(kv[:, :, :positions])

    def copy_positions(self, destination, source, start: int, stop: int) -> None:
        destination[:, :, start:stop] = source[:, :, start:stop]

    def copy(self, destination, source) -> None:
        destination[...] = source

    def argmax_margin(self, rows) -> tuple[np.ndarray, np.ndarray]:
        return argmax_margin(np.asarray(rows, dtype=np.float32))

    def own_stream(self) -> int | None:
        return None

    def stream_ptr(self) -> int | None:
        return None

    def pinned_empty(self, shape, dtype) -> np.ndarray:
        return np.empty(shape, dtype)

    def copy_from_host(self, destination, host: np.ndarray) -> None:
        destination[...] = host

    def end_capture(self) -> bool:
        return False


class ConversionBuffer:
    """A float32 scratch buffer on a device, reused across calls and grown only when more rows are asked for than
    ever before (so a decode loop converts its float16 rows without allocating). ``make(elements)`` allocates."""

    def __init__(self, make) -> None:
        self._make = make
        self._flat: Any = None
        self.grown = 0  # how many times it was (re)allocated

    def rows(self, count: int, width: int):
        """A ``[count, width]`` float32 view of the buffer (contents unspecified)."""
        need = count * width
        if self._flat is None or self._flat.shape[0] < need:
            self._flat = self._make(need)
            self.grown += 1
        return self._flat[:need].reshape(count, width)


class CupyArrays:
    """CuPy buffers on CUDA device ``device_id``; picks by the fused kernel, or by CuPy reductions if it fails to
    compile (logged once).

    Work is enqueued on the default stream until :meth:`own_stream` gives the module a stream of its own (the
    stream-ordered path: ONNX Runtime is then told to run on it). float16 rows are converted to float32 in a
    preallocated device buffer (:class:`ConversionBuffer`) and the picks come back through a page-locked host
    buffer, so a decode step allocates nothing. Written against CuPy 13 and 14; ``scripts/gpu_check.sh`` runs the
    CUDA tests on a GPU.
    """

    device_type = "cuda"
    name = "cupy"

    def __init__(self, device_id: int = 0) -> None:
        import cupy

        self.cp = cupy
        self.device_id = device_id
        self._device = cupy.cuda.Device(device_id)
        self._stream: Any = None  # None: CuPy's current stream (the default stream unless a caller set one)
        self._picks_out: Any = None  # device float64 [2 * rows]: the kernel's output, grown as needed
        self._picks_host: Any = None  # its page-locked host copy
        self._kernel_failed = False
        self._convert = ConversionBuffer(self._float32_flat)

    def _float32_flat(self, elements: int):
        with self._device:
            return self.cp.empty(elements, self.cp.float32)

    def _on_stream(self):
        """A context: this module's device, and its stream when it has one."""
        import contextlib

        stack = contextlib.ExitStack()
        stack.enter_context(self._device)
        if self._stream is not None:
            stack.enter_context(self._stream)
        return stack

    def empty(self, shape, dtype):
        with self._device:
            return self.cp.empty(shape, dtype)

    def zeros(self, shape, dtype):
        with self._on_stream():
            return self.cp.zeros(shape, dtype)

    def from_host(self, host):
        with self._on_stream():
            return self.cp.asarray(host)

    @staticmethod
    def ptr(array) -> int:
        return int(array.data.ptr)

    def upload(self, destination, host):
        destination.set(np.ascontiguousarray(host, dtype=destination.dtype))

    def download(self, source, out):
        """Copy ``source`` to the host array ``out``; a dtype change (float16 logits to float32) goes through the
        preallocated conversion buffer on the device, then one device-to-host copy (which waits for the stream)."""
        with self._on_stream():
            if source.dtype != out.dtype:
                if out.dtype != np.float32 or source.ndim not in (1, 2):
                    source = source.astype(out.dtype)
                else:
                    rows = source if source.ndim == 2 else source.reshape(1, -1)
                    converted = self._convert.rows(rows.shape[0], rows.shape[1])
                    self.cp.copyto(converted, rows)
                    source = converted.reshape(source.shape)
            source.get(out=out, stream=self._stream)

    def sync(self):
        self._device.synchronize()

    def prefix(self, kv, positions):
        return self.cp.ascontiguousarray(kv[:, :, :positions])

    def copy_positions(self, destination, source, start, stop):
        destination[:, :, start:stop] = source[:, :, start:stop]

    def own_stream(self) -> int | None:
        with self._device:
            self._stream = self.cp.cuda.Stream(non_blocking=True)
        return int(self._stream.ptr)

    def stream_ptr(self) -> int | None:
        return int(self._stream.ptr) if self._stream is not None else None

    def pinned_empty(self, shape, dtype) -> np.ndarray:
        import cupyx

        return cupyx.empty_pinned(shape, dtype)

    def copy_from_host(self, destination, host: np.ndarray) -> None:
        if host.dtype != destination.dtype or not host.flags.c_contiguous:
            host = np.ascontiguousarray(host, dtype=destination.dtype)  # then a synchronous copy from pageable memory
        with self._device:
            destination.set(host, stream=self._stream)

    def end_capture(self) -> bool:
        runtime = self.cp.cuda.runtime
        handle = self._stream.ptr if self._stream is not None else 0
        with self._device:
            if not runtime.streamIsCapturing(handle):  # cudaStreamCaptureStatusNone
                return False
            try:
                graph = runtime.streamEndCapture(handle)
            except runtime.CUDARuntimeError:  # an invalidated capture: ending it reports the error, but it ends
                graph = 0
            if graph:
                runtime.graphDestroy(graph)
        return True

    def copy(self, destination, source):
        with self._on_stream():
            destination[...] = source

    def argmax_margin(self, rows):
        """One fused kernel (a block per row), then one device-to-host copy of ``2 * rows`` float64 numbers (into a
        page-locked buffer; the copy waits for the stream: the step's one synchronisation)."""
        cp = self.cp
        count, vocab = rows.shape
        with self._on_stream():
            if not rows.flags.c_contiguous:
                rows = cp.ascontiguousarray(rows)
            try:
                kernel = cupy_argmax_kernel(cp, str(rows.dtype)) if not self._kernel_failed else None
            except Exception as exc:  # noqa: BLE001 - NVRTC missing or failing: use plain CuPy reductions
                logger.warning(
                    "OrtBackend: the fused argmax kernel did not compile (%s); using CuPy reductions",
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                )
                self._kernel_failed = True
                kernel = None
            if kernel is None:
                if rows.dtype != cp.float32:
                    converted = self._convert.rows(count, vocab)
                    cp.copyto(converted, rows)
                    rows = converted
                ids, margins = xp_argmax_margin(cp, rows)
                return cp.asnumpy(ids).astype(np.int64), cp.asnumpy(margins).astype(np.float32)
            if self._picks_out is None or self._picks_out.shape[0] < 2 * count:
                size = 2 * max(count, 32)
                self._picks_out = cp.empty(size, cp.float64)
                self._picks_host = self.pinned_empty(size, np.float64)
            kernel((count,), (ARGMAX_THREADS,), (rows, np.int32(vocab), self._picks_out))
            host = self._picks_host[: 2 * count]
            self._picks_out[: 2 * count].get(out=host, stream=self._stream)
        return host[0::2].astype(np.int64), host[1::2].astype(np.float32)


def _shape_tuple(shape) -> tuple[int, ...]:
    return tuple(int(d) for d in shape) if isinstance(shape, (tuple, list)) else (int(shape),)


class TorchArrays:
    """torch CUDA tensors on device ``device_id`` (where CuPy is missing); picks by :func:`torch_argmax_margin`.

    As :class:`CupyArrays`: the default stream until :meth:`own_stream`; float16 rows converted in a preallocated
    float32 buffer (the reductions' own temporaries come from torch's caching allocator, which stops calling
    ``cudaMalloc`` once warm)."""

    device_type = "cuda"
    name = "torch"

    def __init__(self, device_id: int = 0) -> None:
        import torch

        self.torch = torch
        self.device_id = device_id
        self.device = torch.device("cuda", device_id)
        self._torch_dtypes = {
            np.dtype(np.float32): torch.float32,
            np.dtype(np.float16): torch.float16,
            np.dtype(np.float64): torch.float64,
            np.dtype(np.int64): torch.int64,
            np.dtype(np.int32): torch.int32,
        }
        self._stream: Any = None
        self._convert = ConversionBuffer(lambda n: torch.empty(n, dtype=torch.float32, device=self.device))
        self._pinned: list[Any] = []  # keeps the tensors behind pinned_empty's arrays alive

    def _on_stream(self):
        import contextlib

        return self.torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    def empty(self, shape, dtype):
        return self.torch.empty(_shape_tuple(shape), dtype=self._torch_dtypes[np.dtype(dtype)], device=self.device)

    def zeros(self, shape, dtype):
        with self._on_stream():
            return self.torch.zeros(_shape_tuple(shape), dtype=self._torch_dtypes[np.dtype(dtype)], device=self.device)

    def from_host(self, host):
        with self._on_stream():
            return self.torch.from_numpy(np.ascontiguousarray(host)).to(self.device)

    @staticmethod
    def ptr(array) -> int:
        return int(array.data_ptr())

    def upload(self, destination, host):
        destination.copy_(self.torch.from_numpy(np.ascontiguousarray(host)))

    def download(self, source, out):
        """As :meth:`CupyArrays.download`: a float16 source is converted in the preallocated float32 buffer first."""
        with self._on_stream():
            if source.dtype != self._torch_dtypes[np.dtype(out.dtype)]:
                if out.dtype == np.float32 and source.dim() in (1, 2):
                    rows = source if source.dim() == 2 else source.reshape(1, -1)
                    converted = self._convert.rows(rows.shape[0], rows.shape[1])
                    converted.copy_(rows)
                    source = converted.reshape(source.shape)
            self.torch.from_numpy(out).copy_(source)

    def sync(self):
        self.torch.cuda.synchronize(self.device)

    def prefix(self, kv, positions):
        return kv[:, :, :positions].contiguous()

    def copy_positions(self, destination, source, start, stop):
        destination[:, :, start:stop].copy_(source[:, :, start:stop])

    def own_stream(self) -> int | None:
        self._stream = self.torch.cuda.Stream(device=self.device)
        return int(self._stream.cuda_stream)

    def stream_ptr(self) -> int | None:
        return int(self._stream.cuda_stream) if self._stream is not None else None

    def pinned_empty(self, shape, dtype) -> np.ndarray:
        tensor = self.torch.empty(_shape_tuple(shape), dtype=self._torch_dtypes[np.dtype(dtype)], pin_memory=True)
        self._pinned.append(tensor)
        return tensor.numpy()

    def copy_from_host(self, destination, host: np.ndarray) -> None:
        source = self.torch.from_numpy(np.ascontiguousarray(host, dtype=np.dtype(host.dtype)))
        with self._on_stream():
            destination.copy_(source, non_blocking=True)  # asynchronous only from pinned memory

    def end_capture(self) -> bool:
        with self._on_stream():
            if not self.torch.cuda.is_current_stream_capturing():
                return False
        raise BackendError(
            "a CUDA graph capture failed and left the stream capturing; torch offers no call to end it here "
            "(use array_module='cupy', or cuda_graphs=False)"
        )

    def copy(self, destination, source):
        with self._on_stream():
            destination.copy_(source)

    def argmax_margin(self, rows):
        with self._on_stream():
            if rows.dtype != self.torch.float32:
                converted = self._convert.rows(rows.shape[0], rows.shape[1])
                converted.copy_(rows)
                rows = converted
            return torch_argmax_margin(rows)


def cuda_arrays(device_id: int, array_module: str) -> CupyArrays | TorchArrays:
    """The CUDA array module named by ``array_module``: ``"cupy"``, ``"torch"``, or ``"auto"`` (CuPy, else torch).
    ``ValueError`` for another name; ``BackendError`` naming why each candidate failed when none works."""
    errors = []
    order = ("cupy", "torch") if array_module == "auto" else (array_module,)
    for name in order:
        try:
            if name == "cupy":
                return CupyArrays(device_id)
            if name == "torch":
                arrays = TorchArrays(device_id)
                if not arrays.torch.cuda.is_available():
                    raise RuntimeError("torch.cuda.is_available() is False")
                return arrays
            raise ValueError(f"array_module must be 'auto', 'cupy' or 'torch', got {name!r}")
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - report why each option failed
            errors.append(f"{name}: {exc}")
    raise BackendError(
        "provider='cuda' needs CuPy (pip install 'ortspec[cuda]') or torch with CUDA for device buffers; "
        + "; ".join(errors)
    )
