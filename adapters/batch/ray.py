"""``ortspec batch --ray``: the batch job on Ray Data (needs the ``ray`` extra: ``pip install 'ortspec[ray]'``).

The driver reads and checks INPUT and OUTPUT exactly as the embedded runner does (ids, bad records, resumption,
longest prompt first), then hands Ray Data the pending records, one per block:

    ray.data.from_items(records) -> map_batches(RayEngine, batch_size=1, ActorPoolStrategy(size=workers),
                                                num_cpus=threads) -> iter_rows() on the driver -> OUTPUT

Each actor is one ``BatchWorker`` (one Engine, ``threads`` intra-op threads, ``threads`` Ray CPUs), so Ray places
the actors on nodes with room for them. Each actor is one batched Engine: Ray keeps ``max_batch`` + 1 records in
flight on it (concurrent calls, each waiting on the actor's one worker thread), so its batch driver decodes
``max_batch`` records together and the next joins as soon as a slot frees. A record that kills its actor costs
the records in flight beside it a retry (Ray retries each once). The driver writes each line as it arrives
(completion order), with the same writer, format and resumption as the embedded runner. The model folder must be
at the same path on every node, unless ``ship_model``: the driver puts its files into the object store and each
node writes them once into its ortspec cache (``shipped/<name>-<digest>``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import shutil
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from .job import BatchError, BatchJob
from .local import available_cores
from .output import BatchOutput
from .records import Task, error_record, task_from_message, task_message
from .worker import BatchWorker, WorkerSettings, file_lock, take_waiting

RAY_EXTRA_MESSAGE = "--ray needs Ray Data, which is not installed: pip install 'ortspec[ray]' (ray[data]==2.60.0)"
# Files are shipped in pieces of at most this many bytes (bounds the driver's memory while it puts them).
SHIP_CHUNK = 256 << 20


def import_ray() -> Any:
    """``ray`` with Ray Data, or ``BatchError`` saying how to install them."""
    try:
        import ray
        import ray.data  # noqa: F401  (needs pyarrow and pandas too)
    except ImportError as exc:
        raise BatchError(f"{RAY_EXTRA_MESSAGE} ({exc})") from None
    return ray


@contextlib.contextmanager
def ray_session(address: str) -> Iterator[Any]:
    """Ray, initialised for the job: ``"local"`` starts a local instance with this process's cores (and shuts it
    down afterwards), anything else is ``ray.init(address=...)``. An already initialised Ray is used as it is."""
    ray = import_ray()
    started = False
    if not ray.is_initialized():
        kwargs: dict[str, Any] = dict(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True)
        if address == "local":
            kwargs["num_cpus"] = len(available_cores())
        else:
            kwargs["address"] = address
        try:
            ray.init(**kwargs)
        except Exception as exc:
            raise BatchError(f"cannot start or join Ray ({address}): {type(exc).__name__}: {exc}") from None
        started = True
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    try:
        yield ray
    finally:
        if started:
            ray.shutdown()


def plan_actors(
    ray: Any, address: str, workers: int, threads: int | None, say: Callable[[str], object]
) -> tuple[int, int]:
    """(workers, threads per worker) for this cluster: ``threads`` defaults to its CPUs shared out (at most one
    node's). ``BatchError`` when no node has ``threads`` CPUs, or when a local instance has fewer CPUs than
    workers x threads; on a cluster that is short of CPUs now, a note (an autoscaler may add nodes)."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise BatchError(f"workers must be an int >= 1, got {workers!r}")
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    per_node = [int(n.get("Resources", {}).get("CPU", 0)) for n in nodes]
    total, biggest = sum(per_node), max(per_node, default=0)
    if threads is None:
        threads = max(1, min(biggest, total // workers))
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise BatchError(f"threads must be an int >= 1, got {threads!r}")
    if threads > biggest:
        raise BatchError(f"each worker asks for {threads} CPUs (threads) but the largest Ray node has {biggest}")
    if workers * threads > total:
        message = (
            f"{workers} workers x {threads} threads = {workers * threads} CPUs, more than the {total} the Ray "
            f"cluster has"
        )
        if address == "local":
            raise BatchError(message + f": choose workers x threads <= {total}")
        say(message + " now: actors wait until nodes join")
    return workers, threads


@contextlib.contextmanager
def model_source(ray: Any, model_dir: Path, ship: bool) -> Iterator[Any]:
    """What actors (the batch job's, or ``ortspec serve --ray``'s replicas) get to find the model: its path, or
    (``ship``) the folder's files in the object store (``materialize`` makes either a folder on the actor's node)."""
    if not ship:
        yield str(model_dir.resolve())
        return
    digest = hashlib.sha256()
    files: list[tuple[str, list[Any]]] = []
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(model_dir).as_posix()
        digest.update(rel.encode() + b"\0")
        refs = []
        with open(path, "rb") as f:
            while chunk := f.read(SHIP_CHUNK):
                digest.update(chunk)
                refs.append(ray.put(chunk))
        files.append((rel, refs))
    yield {"name": model_dir.name, "digest": digest.hexdigest(), "files": files}
    del files


def materialize(source: str | Mapping[str, Any]) -> Path:
    """The model folder on this node: the path (which must exist here), or the shipped files written once per
    node into the ortspec cache (other actors on the node wait for the first, then reuse its copy)."""
    if isinstance(source, str):
        path = Path(source)
        if not path.is_dir():
            raise FileNotFoundError(
                f"model folder {path} is not on node {socket.gethostname()}: put it at the same path on every node, "
                "or use --ship-model (ship_model=True)"
            )
        return path
    import ray

    from ortspec.adapters.engine.cache import cache_root

    target = cache_root() / "shipped" / f"{source['name']}-{source['digest'][:16]}"
    with file_lock(target.with_name(target.name + ".lock")):
        if (target / ".complete").is_file():
            return target
        tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        for rel, refs in source["files"]:
            dest = tmp / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            with open(dest, "wb") as f:
                for ref in refs:
                    f.write(ray.get(ref))
        (tmp / ".complete").write_text(source["digest"])
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    return target


class RayEngine:
    """A Ray Data actor: one ``BatchWorker`` on a thread of its own. Ray calls it from up to ``slots`` + 1 threads
    at once (``_dataset``), each call one batch of task messages; each call hands its tasks to the worker's thread,
    which keeps every submitted record on the worker's batch driver, and returns their output lines and metrics
    (both JSON strings) once they finish. The first answer carries the model load time and the worker's slots
    (and its note, if it does not batch)."""

    def __init__(self, source: str | Mapping[str, Any], settings: WorkerSettings) -> None:
        model_dir = materialize(source)
        self.worker = BatchWorker(model_dir, settings, name=f"{socket.gethostname()}:{os.getpid()}")
        self._report_load = True
        self._lock = threading.Lock()
        self._inbox: queue.Queue[tuple[Task, Future[tuple[dict[str, Any], dict[str, Any]]]]] = queue.Queue()
        threading.Thread(target=self._drive, name="ortspec-batch-worker", daemon=True).start()

    def __call__(self, batch: Mapping[str, Sequence[Any]]) -> dict[str, Any]:
        import numpy as np

        calls = []
        for text in batch["task"]:
            task = task_from_message(str(text))
            future: Future[tuple[dict[str, Any], dict[str, Any]]] = Future()
            self._inbox.put((task, future))
            calls.append((task, future))
        keys, lines, metrics = [], [], []
        for task, future in calls:
            record, m = future.result()
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

    def _drive(self) -> None:
        """The worker's thread: take the calls' tasks (waiting only while it holds none), advance them, answer
        each call's future as its record finishes. An unexpected failure fails every call waiting then (a bad
        record is not one: it is an error line), and the thread goes on."""
        futures: dict[str, Future[tuple[dict[str, Any], dict[str, Any]]]] = {}
        while True:
            new = take_waiting(self._inbox, wait=not self.worker.held)
            try:
                for task, future in new:
                    futures[task.key] = future
                    self.worker.submit(task)
                for task, record, metrics in self.worker.advance():
                    futures.pop(task.key).set_result((record, metrics))
            except Exception as exc:  # noqa: BLE001 - handed to the waiting calls (Ray gives up on their records)
                for future in futures.values():
                    future.set_exception(exc)
                futures.clear()


def _root_cause(exc: BaseException) -> str:
    """The innermost cause of a Ray error, in one line (Ray wraps the actor's exception in several layers)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"


def _dataset(ray: Any, tasks: Sequence[Task], source: Any, settings: WorkerSettings, workers: int) -> Any:
    """The pending tasks as a Ray Data dataset, one record per block (so lines come back per record), mapped by
    a pool of at most ``workers`` ``RayEngine`` actors of ``settings.threads`` CPUs each, each given up to
    ``max_batch`` + 1 records at once (its slots, and the next record ready for the first slot that frees; 1 on the
    one-at-a-time path)."""
    calls = settings.max_batch + 1 if settings.max_batch > 1 else 1
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
    (``backend``); ``defaults``: the job's generation keywords, as the Engine takes them."""
    address = job.ray
    assert address is not None, "run_ray runs a job with a Ray address"
    t0 = time.perf_counter()
    with ray_session(address) as ray:
        output.summary.ray_init_s = time.perf_counter() - t0
        workers, threads = plan_actors(ray, address, job.workers, job.threads, say)
        output.summary.workers, output.summary.threads = workers, threads
        settings = WorkerSettings.of(job, threads, defaults)
        with model_source(ray, model_dir, job.ship_model) as source:
            ds = _dataset(ray, tasks, source, settings, workers)
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
        for task in tasks:  # Ray gave up on these (the actor died on each try): like a dead embedded worker
            if task.key not in written:
                message = "no result came back from Ray: its actor died while generating this record, twice"
                output.write(error_record(task.id, task.line, message))
