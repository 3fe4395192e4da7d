"""CUDA graphs per pass width, opening a session that captures them, and the per-phase timing hook: the
bookkeeping behind ``OrtBackend``'s fast CUDA path, kept apart from the device so that it is tested on the CPU.

``cuda_graphs=True`` (CUDA only, off by default; implies static shapes) opens the session with
``enable_cuda_graph=1`` on the array module's own stream (:func:`open_stream_ordered`) and gives each pass width of
up to ``graph_max_tokens`` tokens (the pending token plus up to 16 draft tokens by default) its own graph id;
greedy steps are width 1. Wider passes (prefill chunks) run eagerly. ``OrtBackend.capture_graphs`` warms up and
captures every width up front. When ONNX Runtime refuses graph capture for the session, or a run with a graph id
fails, the backend logs why, reopens its session without graphs (same buffers, same stream) and carries on
eagerly. ``scripts/gpu_check.sh`` runs the CUDA tests of both paths on a GPU.

**Graphs.** ONNX Runtime's CUDA execution provider captures a CUDA graph of a whole ``run`` when the session is opened
with the provider option ``enable_cuda_graph=1`` and the run carries the run-config entry ``gpu_graph_id``: each id gets
its own graph, captured after a few ordinary runs with that id (the provider's
``min_num_runs_before_cuda_graph_capture_``, counted per id: :data:`ORT_WARMUP_RUNS`), and every later run with the id
replays it without looking at its inputs, so every bound input and output must keep its shape and address
(``OrtBackend``'s static binding guarantees it). ``gpu_graph_id=-1`` runs eagerly. :class:`GraphBook` gives each pass
width (1 to ``max_tokens`` tokens: the pending token plus K = 0..``max_tokens - 1`` draft tokens) its own id and counts
the successful runs with it; wider passes (prefill chunks) run eagerly. A failure in a run with an id turns graphs off
for good (:meth:`GraphBook.disable`; the backend then reopens its session without them).

**Timing.** :class:`PhaseTimer` adds up wall time per phase of a pass (``host``: checks, staging and binding on
the host; ``run``: the ``run_with_iobinding`` call; ``sync``: explicit waits for the device; ``readback``: copying
the picks or logits rows back, which on the stream-ordered path includes waiting for the device to finish) and per
pass width. ``OrtBackend.timer`` is None unless one is set, and then costs nothing but a None check per phase.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from ..base import BackendError
from .arrays import ArrayModule, cuda_arrays
from .session import cuda_provider_options, execution_providers, open_session

logger = logging.getLogger(__name__)

# The CUDA execution provider's ordinary runs per graph id before it captures (min_num_runs_before_cuda_graph_capture_
# in onnxruntime/core/providers/cuda/cuda_execution_provider.h: 2, or 1 in some versions); the run after them
# captures. ONNX Runtime decides; this count only tells the warm-up how many runs to make (one too many is a
# replay, harmless) and reports when a width is captured.
ORT_WARMUP_RUNS = 2
EAGER = -1  # gpu_graph_id of a run that must not be captured
PHASES = ("host", "run", "sync", "readback")


class GraphBook:
    """Which pass widths run as CUDA graphs, one ONNX Runtime graph id per width, and how far each has got.

    A width ``count`` (tokens in the pass) in ``[1, max_tokens]`` uses graph id ``count``; any other width, and
    every width once graphs are disabled, uses :data:`EAGER`. ``record(count)`` after each successful run with an
    id; a width is captured after ``warmup_runs + 1`` of them (the ordinary runs, then the capturing run)."""

    def __init__(self, max_tokens: int, warmup_runs: int = ORT_WARMUP_RUNS) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if warmup_runs < 0:
            raise ValueError(f"warmup_runs must be >= 0, got {warmup_runs}")
        self.max_tokens = int(max_tokens)
        self.warmup_runs = int(warmup_runs)
        self.enabled = True
        self.disabled_reason: str | None = None
        self.runs: dict[int, int] = {}  # successful runs with a graph id, per width

    def graph_id(self, count: int) -> int:
        """The ``gpu_graph_id`` for a pass of ``count`` tokens."""
        return int(count) if self.enabled and 1 <= count <= self.max_tokens else EAGER

    def record(self, count: int) -> None:
        """A run of ``count`` tokens with ``graph_id(count)`` succeeded."""
        if self.graph_id(count) != EAGER:
            self.runs[count] = self.runs.get(count, 0) + 1

    def captured(self, count: int) -> bool:
        """Whether the width's graph has been captured (so its next run is a replay)."""
        return self.graph_id(count) != EAGER and self.runs.get(count, 0) > self.warmup_runs

    def runs_to_capture(self, count: int) -> int:
        """How many more runs of this width until its graph is captured (0 when it is, or when it runs eagerly)."""
        if self.graph_id(count) == EAGER:
            return 0
        return max(0, self.warmup_runs + 1 - self.runs.get(count, 0))

    def disable(self, reason: str) -> None:
        """Graphs off from now on (every width eager); ``reason`` is kept for reports."""
        self.enabled = False
        self.disabled_reason = reason

    def summary(self) -> dict[str, Any]:
        """For reports: on/off, why off, the widths captured and the runs per width."""
        return {
            "enabled": self.enabled,
            "disabled_reason": self.disabled_reason,
            "max_tokens": self.max_tokens,
            "warmup_runs": self.warmup_runs,
            "captured_widths": sorted(c for c in self.runs if self.captured(c)),
            "runs": {str(c): n for c, n in sorted(self.runs.items())},
        }


class PhaseTimer:
    """Wall seconds per phase (:data:`PHASES`) and per pass width, and the number of passes per width."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.by_width: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.passes: dict[int, int] = defaultdict(int)
        self._width = 0

    def begin(self, count: int) -> None:
        """A pass of ``count`` tokens starts (phases until the next ``begin`` are its)."""
        self._width = int(count)
        self.passes[self._width] += 1

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds
        self.by_width[self._width][phase] += seconds

    def reset(self) -> None:
        self.seconds.clear()
        self.by_width.clear()
        self.passes.clear()

    def per_pass(self, width: int | None = None) -> dict[str, float]:
        """Mean seconds per pass for each phase (and ``total``), over every pass or those of one width."""
        if width is None:
            count = sum(self.passes.values())
            totals = dict(self.seconds)
        else:
            count = self.passes.get(width, 0)
            totals = dict(self.by_width.get(width, {}))
        out = {phase: (totals.get(phase, 0.0) / count if count else 0.0) for phase in PHASES}
        out["total"] = sum(out[phase] for phase in PHASES)
        return out


@attrs.frozen
class StreamOrderedSession:
    """A CUDA session running on ``arrays``' own stream: ``reopen`` opens it again without CUDA graphs (None when
    it has none to give up), ``refused`` says why ONNX Runtime refused graph capture (None: it did not)."""

    session: Any
    arrays: ArrayModule
    reopen: Callable[[], Any] | None
    refused: str | None


def open_stream_ordered(
    model_path: Path, *, device_id: int, array_module: str, graphs: bool, session_options, model_bytes: bytes | None
) -> StreamOrderedSession:
    """Open ``model_path`` (or its rewrite ``model_bytes``) on CUDA device ``device_id`` with a new array module
    (``array_module``: ``"cupy"``, ``"torch"`` or ``"auto"``) whose own stream becomes ONNX Runtime's compute stream;
    with ``graphs``, with CUDA graph capture, falling back to a session without it (logged) when refused."""
    arrays = cuda_arrays(device_id, array_module)
    stream = arrays.own_stream()

    def open_cuda(with_graphs: bool):
        providers = execution_providers(
            "cuda", device_id, cuda_provider_options(stream=stream, cuda_graphs=with_graphs)
        )
        return open_session(model_path, providers=providers, session_options=session_options, model_bytes=model_bytes)

    if not graphs:
        return StreamOrderedSession(open_cuda(False), arrays, None, None)
    try:
        return StreamOrderedSession(open_cuda(True), arrays, lambda: open_cuda(False), None)
    except BackendError as exc:  # e.g. "cannot use the graph capture feature": nodes off the CUDA EP
        refused = str(exc)
        logger.warning("OrtBackend: CUDA graphs refused (%s); running eagerly", refused.splitlines()[0])
        return StreamOrderedSession(open_cuda(False), arrays, lambda: open_cuda(False), refused)
