"""``OrtBackend``'s static-shape passes (``BackendConfig.static_shapes``; the fast CUDA path): one IO binding per
pass width with every input at a fixed address and shape (``binding.StaticBinding``), run stream-ordered without
host synchronisation where the session allows, with a CUDA graph per width (``cuda_graphs.GraphBook``) and the eager
fallback when ONNX Runtime cannot run one. Functions of the backend, which owns every buffer they bind."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from ..base import BackendError
from .binding import StaticBinding, StaticPass
from .cuda_graphs import EAGER

if TYPE_CHECKING:
    from .backend import OrtBackend

logger = logging.getLogger("ortspec.backends.onnx.backend")


def static_pass(backend: OrtBackend, static: StaticBinding, count: int) -> StaticPass:
    """The IO binding and run options of passes of ``count`` tokens (made once per width)."""
    found = static.passes.get(count)
    if found is not None:
        return found
    binding = backend.session.io_binding()
    backend.kv.bind_shared(binding)
    backend._rows.bind_outputs(binding, count)
    graph_id = backend.graphs.graph_id(count) if backend.graphs is not None else EAGER
    options = backend._ort.RunOptions()
    if backend.graphs is not None:
        options.add_run_config_entry("gpu_graph_id", str(graph_id))
    if backend.stream_ordered:
        options.add_run_config_entry("disable_synchronize_execution_providers", "1")
    return static.add_pass(count, binding, backend._rows.ids, options, graph_id)


def run_static(backend: OrtBackend, tokens: np.ndarray, t0: float) -> None:
    """Static binding: every input at a fixed address and shape per width; on the stream-ordered CUDA path no
    host synchronisation; with CUDA graphs the width's graph id (and the eager fallback on failure)."""
    timer, arrays, static = backend.timer, backend._arrays, backend.static_binding
    assert static is not None
    count = len(tokens)
    past = backend.kv.length
    total = past + count
    backend._alloc_rows(count)
    backend._rows.hidden_span = (0, 0)  # overwritten by this run
    step = static_pass(backend, static, count)
    static.stage(tokens, backend._rows.ids, past, total)
    if timer is not None:
        t1 = time.perf_counter()
        timer.add("host", t1 - t0)
    if not backend.stream_ordered:
        arrays.sync()
        if timer is not None:
            t2 = time.perf_counter()
            timer.add("sync", t2 - t1)
            t1 = t2
    try:
        backend.session.run_with_iobinding(step.binding, step.run_options)
        if timer is not None:
            t2 = time.perf_counter()
            timer.add("run", t2 - t1)
        if not backend.stream_ordered:
            step.binding.synchronize_outputs()
            if timer is not None:
                timer.add("sync", time.perf_counter() - t2)
    except Exception as exc:  # noqa: BLE001 - ORT raises its own exception types
        if step.graph_id == EAGER or backend.graphs is None or not backend.graphs.enabled:
            raise BackendError(f"onnxruntime failed on {count} tokens at position {past}: {exc}") from exc
        give_up_graphs(backend, f"a run with gpu_graph_id={step.graph_id} ({count} tokens) failed: {exc}")
        run_static(backend, tokens, time.perf_counter() if timer is not None else 0.0)  # eager now
        return
    if backend.graphs is not None:
        backend.graphs.record(count)
    backend.kv.length = total
    if backend.graph.hidden_name:
        backend._rows.hidden_span = (past, count)


def give_up_graphs(backend: OrtBackend, reason: str) -> None:
    """The eager fallback: end a capture left open on the stream, reopen the session without CUDA graphs and
    rebind everything (the KV and every other buffer are kept). ``BackendError`` without ``reopen_session``."""
    book = backend.graphs
    assert book is not None
    logger.warning("OrtBackend: giving up CUDA graphs (%s); running eagerly", reason.splitlines()[0][:500])
    book.disable(reason)
    try:
        backend._arrays.end_capture()
    except Exception as exc:  # noqa: BLE001 - reported with the reason
        raise BackendError(f"CUDA graphs failed ({reason}) and the capture could not be ended: {exc}") from exc
    if backend._reopen is None:
        raise BackendError(f"CUDA graphs failed and no eager session can be opened: {reason}")
    backend.session = backend._reopen()
    backend._bind_session()
