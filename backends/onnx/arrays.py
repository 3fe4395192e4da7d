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


class CupyArrays:
    """CuPy buffers on CUDA device ``device_id``; picks by the fused kernel, or by CuPy reductions if it fails to
    compile (logged once)."""

    device_type = "cuda"
    name = "cupy"

    def __init__(self, device_id: int = 0) -> None:
        import cupy

        self.cp = cupy
        self.device_id = device_id
        self._device = cupy.cuda.Device(device_id)
        self._picks_out: Any = None  # device float64 [2 * rows]: the kernel's output, grown as needed
        self._picks_host: Any = None  # its host copy
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
    def ptr(array) -> int:
        return int(array.data.ptr)

    def upload(self, destination, host):
        destination.set(np.ascontiguousarray(host, dtype=destination.dtype))

    def download(self, source, out):
        if source.dtype != out.dtype:
            source = source.astype(out.dtype)
        source.get(out=out)

    def sync(self):
        self._device.synchronize()

    def prefix(self, kv, positions):
        return self.cp.ascontiguousarray(kv[:, :, :positions])

    def copy_positions(self, destination, source, start, stop):
        destination[:, :, start:stop] = source[:, :, start:stop]

    def copy(self, destination, source):
        with self._device:
            destination[...] = source

    def argmax_margin(self, rows):
        """One fused kernel (a block per row), then one device-to-host copy of ``2 * rows`` float64 numbers."""
        cp = self.cp
        count, vocab = rows.shape
        with self._device:
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
                ids, margins = xp_argmax_margin(cp, rows.astype(cp.float32, copy=False))
                return cp.asnumpy(ids).astype(np.int64), cp.asnumpy(margins).astype(np.float32)
            if self._picks_out is None or self._picks_out.shape[0] < 2 * count:
                self._picks_out = cp.empty(2 * max(count, 16), cp.float64)
                self._picks_host = np.empty(2 * max(count, 16), np.float64)
            kernel((count,), (ARGMAX_THREADS,), (rows, np.int32(vocab), self._picks_out))
            host = self._picks_host[: 2 * count]
            self._picks_out[: 2 * count].get(out=host)
        return host[0::2].astype(np.int64), host[1::2].astype(np.float32)


def _shape_tuple(shape) -> tuple[int, ...]:
    return tuple(int(d) for d in shape) if isinstance(shape, (tuple, list)) else (int(shape),)


class TorchArrays:
    """torch CUDA tensors on device ``device_id`` (where CuPy is missing); picks by :func:`torch_argmax_margin`."""

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
            np.dtype(np.int64): torch.int64,
            np.dtype(np.int32): torch.int32,
        }

    def empty(self, shape, dtype):
        return self.torch.empty(_shape_tuple(shape), dtype=self._torch_dtypes[np.dtype(dtype)], device=self.device)

    def zeros(self, shape, dtype):
        return self.torch.zeros(_shape_tuple(shape), dtype=self._torch_dtypes[np.dtype(dtype)], device=self.device)

    def from_host(self, host):
        return self.torch.from_numpy(np.ascontiguousarray(host)).to(self.device)

    @staticmethod
    def ptr(array) -> int:
        return int(array.data_ptr())

    def upload(self, destination, host):
        destination.copy_(self.torch.from_numpy(np.ascontiguousarray(host)))

    def download(self, source, out):
        self.torch.from_numpy(out).copy_(source)

    def sync(self):
        self.torch.cuda.synchronize(self.device)

    def prefix(self, kv, positions):
        return kv[:, :, :positions].contiguous()

    def copy_positions(self, destination, source, start, stop):
        destination[:, :, start:stop].copy_(source[:, :, start:stop])

    def copy(self, destination, source):
        destination.copy_(source)

    def argmax_margin(self, rows):
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
