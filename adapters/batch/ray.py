"""``ortspec batch --ray``: the batch job on Ray Data (needs the ``ray`` extra: ``pip install 'ortspec[ray]'``).

The driver reads and checks INPUT and OUTPUT exactly as the embedded runner does (ids, bad records, resumption,
longest prompt first), then hands Ray Data the pending records, one per block:

    ray.data.from_items(records) -> map_batches(RayEngine, batch_size=1, ActorPoolStrategy(size=workers),
                                                num_cpus=threads) -> iter_rows() on the driver -> OUTPUT

Each actor is one ``BatchWorker`` (one Engine, ``threads`` intra-op threads, ``threads`` Ray CPUs), so Ray places
the actors on nodes with room for them. Ray keeps ``max_batch`` + 1 records in flight on each actor (concurrent
calls, each submitting its record to the Engine's one scheduler and waiting for its line), so ``max_batch`` records
decode together and the next joins as soon as a slot frees. A record that kills its actor costs
the records in flight beside it a retry (Ray retries each once). The driver writes each line as it arrives
(completion order), with the same writer, format and resumption as the embedded runner. The model folder must be
at the same path on every node, unless ``ship_model``: the driver puts its files into the object store and each
node writes them once into its ortspec cache (``shipped/<name>-<digest>``). Starting Ray, sizing the actors and
finding the model on each node are ``adapters/ray_support.py``'s, shared with ``ortspec serve --ray``.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from ortspec.adapters.ray_support import RayError, materialize, model_source, plan_actors, ray_session

from .job import BatchError, BatchJob
from .local import room
from .output import BatchOutput
from .records import Task, error_record, task_from_message, task_message
from .worker import BatchWorker, Finished, WorkerSettings

RAY_DATA_MESSAGE = "--ray needs Ray Data, which is not installed: pip install 'ortspec[ray]' (ray[data]==2.60.0)"


def import_ray_data() -> Any:
    """``ray`` with Ray Data, or ``BatchError`` saying how to install them (``ray_support.import_ray`` leaves Ray
    Data out: ``ortspec serve --ray`` does without it)."""
    try:
        import ray
        import ray.data  # noqa: F401  (needs pyarrow and pandas too)
    except ImportError as exc:
        raise BatchError(f"{RAY_DATA_MESSAGE} ({exc})") from None
    return ray


class RayEngine:
    """A Ray Data actor: one ``BatchWorker``. Ray calls it from up to ``slots`` + 1 threads at once (``_dataset``),
    each call one batch of task messages; each call submits its tasks to the worker's Engine (its one scheduler
    runs them with the records of the other calls) and returns their output lines and metrics (both JSON strings)
    once they finish. The first answer carries the model load time and the worker's slots (and its note, if it
    does not batch)."""

    def __init__(self, source: str | Mapping[str, Any], settings: WorkerSettings) -> None:
        model_dir = materialize(source)
        self.worker = BatchWorker(model_dir, settings, name=f"{socket.gethostname()}:{os.getpid()}")
        self._report_load = True
        self._lock = threading.Lock()

    def __call__(self, batch: Mapping[str, Sequence[Any]]) -> dict[str, Any]:
        import numpy as np

        calls = []
        for text in batch["task"]:
            task = task_from_message(str(text))
            future: Future[Finished] = Future()
            self.worker.submit(task, on_done=future.set_result)
            calls.append((task, future))
        keys, lines, metrics = [], [], []
        for task, future in calls:
            _, record, m = future.result()
            with self._lock:
                if self._report_load:
                    m["load_s"], m["slots"], self._report_load = self.worker.load_s, self.worker.slots, False
                    if self.worker.note is not None:
                        m["note"] = self.worker.note
            keys.append(task.key)
            lines.append(json.dumps(record, ensure_ascii=False) + "\n")
            metrics.append(json.dumps(m))
        return {
            "key": np.array(keys, dtype=object),
            "line": np.array(lines, dtype=object),
            "metrics": np.array(metrics, dtype=object),
        }


def _root_cause(exc: BaseException) -> str:
    """The innermost cause of a Ray error, in one line (Ray wraps the actor's exception in several layers)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"


def _dataset(ray: Any, tasks: Sequence[Task], source: Any, settings: WorkerSettings, workers: int) -> Any:
    """The pending tasks as a Ray Data dataset, one record per block (so lines come back per record), mapped by
    a pool of at most ``workers`` ``RayEngine`` actors of ``settings.threads`` CPUs each, each given up to
    ``max_batch`` + 1 records at once (its slots, and the next record ready for the first slot that frees; one slot:
    one record, ``local.room``)."""
    calls = room(settings.max_batch)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.execution_options.preserve_order = False
    ctx.max_errored_blocks = -1
    items = [{"task": task_message(t)} for t in tasks]
    ds = ray.data.from_items(items, override_num_blocks=len(items))
    with warnings.catch_warnings():
        # Ray 2.60 has no named parameter for max_task_retries; ray_remote_args (deprecated there) sets it.
        warnings.simplefilter("ignore", DeprecationWarning)
        return ds.map_batches(
            RayEngine,
            batch_size=1,
            batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(
                size=min(workers, len(items)),
                max_tasks_in_flight_per_actor=calls,
                max_concurrent_calls_per_actor=calls,
                enable_true_multi_threading=True,  # the calls wait together on the actor's one worker thread
            ),
            num_cpus=settings.threads,
            max_task_retries=1,  # Ray Data's default retries a record that kills its actor forever
            fn_constructor_kwargs=dict(source=source, settings=settings),
        )


def _write_rows(output: BatchOutput, ds: Any, say: Callable[[str], object]) -> set[str]:
    """Write each row of ``ds`` (``_dataset``'s) to ``output`` as it arrives, the summary taking each worker's load
    time and slots and ``say`` each worker note once; the keys of the records written. ``BatchError`` when Ray Data
    stops the dataset."""
    written = set()
    notes: set[str | None] = {None}  # each worker note said once
    try:
        for row in ds.iter_rows():
            metrics = json.loads(str(row["metrics"]))
            if "load_s" in metrics:
                output.summary.load_s.append(float(metrics["load_s"]))
                output.summary.slots = max(output.summary.slots, int(metrics["slots"]))
            if metrics.get("note") not in notes:
                notes.add(metrics["note"])
                say(metrics["note"])
            output.write(str(row["line"]).encode("utf-8"), metrics)
            written.add(str(row["key"]))
    except Exception as exc:  # Ray Data stops the dataset (e.g. an actor cannot load the model)
        raise BatchError(f"the Ray job stopped: {_root_cause(exc)}") from exc
    return written


def run_ray(
    output: BatchOutput,
    tasks: Sequence[Task],
    model_dir: Path,
    job: BatchJob,
    defaults: Mapping[str, Any],
    say: Callable[[str], object],
) -> None:
    """Run ``tasks`` (in this order) on a Ray Data actor pool, writing each record to ``output`` as it completes.
    ``job`` says where (``ray``, ``ship_model``), how many (``workers`` x ``threads``) and how each Engine opens
    (``backend``); ``defaults``: the job's generation keywords, as the Engine takes them. ``BatchError`` when Ray
    cannot be started or joined, has no room for the workers (``ray_support``'s ``RayError``, its message kept), or
    stops the job."""
    address = job.ray
    assert address is not None, "run_ray runs a job with a Ray address"
    t0 = time.perf_counter()
    try:
        with ray_session(address) as ray:
            output.summary.ray_init_s = time.perf_counter() - t0
            workers, threads = plan_actors(ray, address, job.workers, job.threads, say, noun="worker")
            output.summary.workers, output.summary.threads = workers, threads
            settings = WorkerSettings.of(job, threads, defaults, tasks)
            with model_source(ray, model_dir, job.ship_model) as source:
                written = _write_rows(output, _dataset(ray, tasks, source, settings, workers), say)
            for task in tasks:  # Ray gave up on these (the actor died on each try): like a dead embedded worker
                if task.key not in written:
                    message = "no result came back from Ray: its actor died while generating this record, twice"
                    output.write(error_record(task.id, task.line, message))
    except RayError as exc:  # Ray cannot be started or joined, or has no room for the workers
        raise BatchError(str(exc)) from exc
