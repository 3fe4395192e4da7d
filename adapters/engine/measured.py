"""The Engine's measurements of its model on this machine: the verify drift, the verify cost curve, the batch
backend's decode costs, a drafter's cost and a draft model's cost, each measured once per model file, provider,
thread count and onnxruntime version and kept in the user cache (``measurements.cached_measurement``), and the
warning when speculative output may differ from plain output. ``Measurements`` is one part of an ``Engine``
(``engine.measurements``): it reads what the Engine loaded, and measures with the backend's slots held for it
(``exclusive``: the Engine's scheduler pauses), one measurement at a time."""

from __future__ import annotations

import contextlib
import hashlib
import threading
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TypeVar

from ortspec.adapters.engine.cache import cache_root
from ortspec.adapters.engine.options import DRIFT_WARNING_THRESHOLD
from ortspec.backends.base import Backend, BatchBackend
from ortspec.backends.onnx import ModelFolder
from ortspec.core import MAX_DRAFT, Proposer
from ortspec.core.speculative import Prices

R = TypeVar("R")


class Measurements:
    """What an Engine measures (the module docstring): on ``backend``, the one-sequence view of the model
    (``OrtBatchBackend.lone()``, or the backend behind ``OneSlot``), with ``drafter``, a proposer (or None) and the
    slot at which it reads ``backend`` (``Engine.lone_slot``), and ``draft_model``, a separate draft model (or None)
    asked at that slot too; the decode costs on ``batch``. ``exclusive()`` holds the backend's slots while a
    measurement runs (``BatchScheduler.exclusive``, or nothing before the scheduler starts). Thread-safe."""

    def __init__(
        self,
        backend: Backend,
        batch: BatchBackend,
        folder: ModelFolder | None,
        drafter: tuple[Proposer | None, int],
        exclusive: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
        *,
        draft_model: Proposer | None = None,
    ) -> None:
        self.backend, self.batch, self.folder = backend, batch, folder
        self.drafter, self._drafter_slot = drafter
        self.draft_model = draft_model
        self.exclusive = exclusive
        self._lock = threading.RLock()
        self._drift: float | None = None
        self._drift_warned = False
        self._pass_costs: tuple[float, ...] | None = None
        self._batch_decode_costs: tuple[float, ...] | None = None
        self._draft_cost: float | None = None
        self._draft_model_cost: float | None = None
        self._draft_model_read_cost: float | None = None

    def prices(self) -> Prices:
        """The prices a cost-aware width policy reads (``core.speculative.Prices``): ``pass_costs``, ``draft_cost``,
        ``draft_model_cost`` and ``draft_model_read_cost``."""
        return Prices(self.pass_costs(), self.draft_cost(), self.draft_model_cost(), self.draft_model_read_cost())

    def verify_drift(self) -> float:
        """Largest logit difference between this backend's verify passes and one-token decodes (3 windows of up to
        9 tokens; see ``measurements.measure_verify_drift``), in logits: 0 or float32 rounding on exact kernels,
        more on kernels with batch-dependent activation quantization (int8 ``MatMulNBits``; measured values:
        docs/bench/quantization-settings.md). Measured once per model file, provider, thread count and
        onnxruntime version and kept in the user cache (``measurement_file``), with a probe that fits any
        ``max_length``. Above ``DRIFT_WARNING_THRESHOLD`` the first speculative generation warns that its output can
        differ from plain output. ``BackendError`` if the measurement fails."""
        if self._drift is None:
            from ortspec.adapters.engine.measurements import cached_verify_drift

            self._drift = self._measured(
                "verify drift", lambda before: cached_verify_drift(self.backend, self.measurement_file(), before=before)
            )
        return self._drift

    def pass_costs(self, kmax: int = MAX_DRAFT) -> tuple[float, ...]:
        """This backend's verify cost curve (pass over 1 + K tokens ÷ a decode step, K = 0..kmax), measured once
        and kept like ``verify_drift``. ``BackendError`` if the measurement fails."""
        if self._pass_costs is None or len(self._pass_costs) != kmax + 1:
            from ortspec.adapters.engine.measurements import cached_pass_costs

            self._pass_costs = self._measured(
                "verify cost curve",
                lambda before: cached_pass_costs(self.backend, self.measurement_file(), kmax, before=before),
            )
        return self._pass_costs

    def batch_decode_costs(self) -> tuple[float, ...]:
        """The batch backend's ``decode_costs`` (a pass of ``n`` one-token rows ÷ one alone, ``n = 0 .. slots``;
        ``measurements.measure_batch_decode_costs``): how the batch driver prices a plain step so that speculation
        fades as the batch fills. Measured once and kept like ``verify_drift`` (it empties the slots, which it
        holds meanwhile). ``BackendError`` if it fails."""
        if self._batch_decode_costs is None:
            from ortspec.adapters.engine.measurements import cached_batch_decode_costs

            backend = self.batch
            self._batch_decode_costs = self._measured(
                "batch decode costs",
                lambda before: cached_batch_decode_costs(backend, self.measurement_file(), before=before),
            )
        return self._batch_decode_costs

    def draft_cost(self) -> float:
        """The drafter's time per draft token ÷ a decode step (``measurements.measure_draft_cost``), measured once
        per model, drafter, provider and thread count and kept like ``verify_drift``; 0.0 without a drafter.
        ``BackendError`` if the measurement fails."""
        if self.drafter is None:
            return 0.0
        if self._draft_cost is None:
            from ortspec.adapters.engine.measurements import cached_draft_cost

            drafter = self.drafter
            key = _folder_key(drafter, getattr(getattr(drafter, "folder", None), "path", None))
            self._draft_cost = self._measured(
                "drafter's cost",
                lambda before: cached_draft_cost(
                    self.backend, drafter, self.measurement_file(), key, slot=self._drafter_slot, before=before
                ),
            )
        return self._draft_cost

    def draft_model_cost(self) -> float:
        """The draft model's time per draft token ÷ a decode step of the target (``measurements.measure_draft_cost``
        at the lone slot, recorded as ``"draft model cost"``), measured once per model, draft model, provider and
        thread count and kept like ``verify_drift``; 0.0 without a draft model. ``BackendError`` if the measurement
        fails."""
        if self.draft_model is None:
            return 0.0
        if self._draft_model_cost is None:
            from ortspec.adapters.engine.measurements import cached_draft_cost

            draft, key, slot, name = self.draft_model, self._draft_model_key(), self._drafter_slot, "draft model cost"
            self._draft_model_cost = self._measured(
                "draft model's cost",
                lambda before: cached_draft_cost(
                    self.backend, draft, self.measurement_file(), key, slot=slot, before=before, name=name
                ),
            )
        return self._draft_model_cost

    def draft_model_read_cost(self) -> float:
        """The draft model's time per context token it reads before drafting ÷ a decode step of the target
        (``measurements.measure_read_cost`` at the lone slot), measured and kept like ``draft_model_cost``; 0.0
        without a draft model. ``BackendError`` if the measurement fails."""
        if self.draft_model is None:
            return 0.0
        if self._draft_model_read_cost is None:
            from ortspec.adapters.engine.measurements import cached_read_cost

            draft, key, slot = self.draft_model, self._draft_model_key(), self._drafter_slot
            self._draft_model_read_cost = self._measured(
                "draft model's read cost",
                lambda before: cached_read_cost(
                    self.backend, draft, self.measurement_file(), key, slot=slot, before=before
                ),
            )
        return self._draft_model_read_cost

    def _draft_model_key(self) -> str:
        """Which draft model a measurement of it is for: its folder and the version of its files, and how its
        session runs."""
        backend = getattr(self.draft_model, "backend", None)
        folder = getattr(backend, "folder", None)
        return _folder_key(self.draft_model, getattr(folder, "path", None)) + _session_key(backend)

    def measurement_file(self) -> Path | None:
        """Where this engine's measurements are kept (``measurements.cached_measurement``): one file per model
        file (its path, and the size and modification time of it and of its external data), provider, thread
        count, onnxruntime version and load-time rewrites (``OrtBackend.variant``), under the user cache. None
        without a model folder: nothing to key it on, so the measurements are made once per Engine."""
        if self.folder is None:
            return None
        import onnxruntime

        model = self.folder.model_path.resolve()
        files = sorted(p for p in model.parent.iterdir() if p.name.startswith(model.name))
        key = "|".join(
            [str(model)]
            + [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files]
            + [str(getattr(self.backend, "provider", "?")), str(getattr(self.backend, "threads", "?"))]
            + [onnxruntime.__version__]
            # a load-time rewrite or session setting makes another model: its own measurements
            + ([variant] if (variant := str(getattr(self.backend, "variant", ""))) else [])
        )
        return cache_root() / "measurements" / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")

    def _measured(self, what: str, measure: Callable[[Callable[[], None]], R]) -> R:
        """Run ``measure(before)`` under the lock; ``before()``, called just before the backend is used (a cache hit
        never calls it), holds the slots until the measurement ends (``exclusive``). A failure becomes a
        ``BackendError`` saying what was measured."""
        from ortspec.backends.base import BackendError

        with self._lock, contextlib.ExitStack() as held:
            try:

                def hold() -> None:
                    held.enter_context(self.exclusive())

                return measure(hold)
            except Exception as exc:
                raise BackendError(
                    f"measuring this model's {what} failed (a speculative generation measures it once, then reads it "
                    f"from the cache): {type(exc).__name__}: {exc}"
                ) from exc

    def warn_if_inexact(self) -> None:
        """Warn once when speculative output may differ from plain output here: the measured verify drift
        exceeds ``DRIFT_WARNING_THRESHOLD``, or (CPU) the graph has ``MatMulNBits`` nodes at accuracy level 4,
        whose int8-activation kernels give results that depend on how many tokens a pass holds (a one-off
        measurement can miss that on some contexts; see docs/bench/quantization-settings.md)."""
        if self._drift_warned:
            return
        drift = self.verify_drift()
        levels = dict(getattr(getattr(self.backend, "graph_facts", None), "matmul_nbits", {}) or {})
        level4 = sum(count for (_bits, level), count in levels.items() if level == 4)
        batch_dependent = bool(level4) and getattr(self.backend, "provider", "cpu") == "cpu"
        if drift <= DRIFT_WARNING_THRESHOLD and not batch_dependent:
            return
        self._drift_warned = True
        why = f"a verify pass differed from one-token decodes by up to {drift:.3g} logits"
        if batch_dependent:
            why += (
                f", and its {level4} MatMulNBits nodes run at accuracy level 4 (int8 activations), whose results "
                "depend on how many tokens a pass holds"
            )
        remedy = (
            "load it with matmul_accuracy_level=1 (float32 compute; see docs/bench/quantization-settings.md) or use "
            "a float32 model"
            if any(level != 1 for (_bits, level) in levels)
            else "use a float32 model where exactness matters"
        )
        warnings.warn(
            f"on this model {why}: speculative output can differ from plain output here; {remedy}",
            RuntimeWarning,
            stacklevel=4,
        )


def _session_key(backend: object) -> str:
    """How a draft model's session was opened, as far as it changes its step's time beside the target's (threads
    and spinning: ``BackendConfig``); empty for a backend without a config."""
    config = getattr(backend, "config", None)
    if config is None:
        return ""
    return f"|threads={config.threads}|allow_spinning={config.allow_spinning}"


def _folder_key(proposer: object, path: object) -> str:
    """What keys a proposer's measured cost: its folder ``path`` and the size and modification time of every file in
    it, or, without a folder, the object itself (measured once per Engine)."""
    if path is None:
        return f"{type(proposer).__name__}@{id(proposer)}"
    folder = Path(str(path))
    files = sorted(p for p in folder.iterdir() if p.is_file())
    return "|".join([str(folder.resolve())] + [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files])
