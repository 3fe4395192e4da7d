"""One batch worker: an Engine that turns a ``Task`` into its output line and metrics. Both runners use it: each
embedded worker process holds one (``local.py``), and so does each Ray Data actor (``ray.py``)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs

from ortspec.backends.onnx.config import BackendConfig

from .output import output_record
from .records import Task, error_record


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` across processes (none where ``fcntl`` is missing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@attrs.frozen
class WorkerSettings:
    """How every worker of a run opens its Engine and what it generates with: ``threads`` intra-op threads,
    ``backend`` (the rest of how the model is opened: ``BackendConfig``), and the job's ``defaults``
    (``GenerationOptions`` keywords; a record's own win). Pickled to each worker."""

    threads: int
    defaults: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)
    backend: BackendConfig = attrs.field(factory=BackendConfig)


class BatchWorker:
    """One Engine and the job's defaults: turns a task into its output record and its metrics.

    Loading warms what the first speculative generation would otherwise measure (the verify drift, and the verify
    cost curve for ``draft_width="auto"``). The cost curve is cached per machine; workers measure it one at a time
    (a file lock), so all but the first read the same curve, and every worker picks the same draft widths.
    ``load_s``: seconds the load and warm-up took."""

    def __init__(self, model_dir: str | os.PathLike[str], settings: WorkerSettings, *, name: str = "worker") -> None:
        from ortspec.adapters.engine import Engine
        from ortspec.adapters.engine.cache import cache_root

        t0 = time.perf_counter()
        self.name = name
        self.defaults = dict(settings.defaults)
        self.engine = Engine.from_dir(
            model_dir,
            attrs.evolve(settings.backend, threads=settings.threads),
            drafter=False,
        )  # prompt lookup only: batch workers open no shared-KV drafter (docs/drafter.md)
        if self.defaults.get("speculative") is not None:
            with file_lock(cache_root() / "measurements" / ".measure.lock"):
                if self.defaults.get("draft_width", "auto") == "auto":
                    self.engine.pass_costs()
                self.engine.verify_drift()
        self.load_s = time.perf_counter() - t0

    def run(self, task: Task) -> tuple[dict[str, Any], dict[str, Any]]:
        """(output record, metrics) for ``task``; every failure is an error record. The metrics (``worker``,
        ``ok``; when ok: ``tokens``, ``prompt_tokens``, ``prefill_s``, ``decode_s``, ``total_s``, ``steps``,
        ``proposed``, ``accepted``) are what ``BatchSummary.add`` counts."""
        from ortspec.driver import GenerationError

        metrics: dict[str, Any] = {"worker": self.name, "ok": False}
        options = {**self.defaults, **task.options}
        try:
            result = self.engine.generate(task.prompt, **options)
        except GenerationError as exc:
            partial = exc.partial
            record = error_record(
                task.id,
                task.line,
                str(exc),
                partial={"text": partial.text, "token_ids": list(partial.token_ids)},
            )
            return record, metrics
        except Exception as exc:  # a bad record never stops the run
            message = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
            return error_record(task.id, task.line, message), metrics
        t = result.timings
        metrics.update(
            ok=True,
            tokens=len(result.token_ids),
            prompt_tokens=result.prompt_tokens,
            prefill_s=t.prefill_s,
            decode_s=t.decode_s,
            total_s=t.total_s,
            steps=result.stats.steps,
            proposed=result.stats.proposed_tokens,
            accepted=result.stats.accepted_tokens,
        )
        return output_record(task, result), metrics
