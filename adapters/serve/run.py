"""Running the server: what it serves (``load_serving``: one batched Engine, or one Engine per worker with
``load_engines``), uvicorn in a background thread (``serve_in_thread``), and ``cmd_serve``, what ``ortspec serve``
calls.

The rule for ``--workers`` and ``--max-batch`` (``batch_slots``): by default one batched Engine with
``DEFAULT_MAX_BATCH`` slots (its slots share one session; every running request in each pass). ``--max-batch N`` sets
its slots; ``--max-batch 1``, or ``--workers N`` (N > 1) without ``--max-batch``, is the worker design: N Engines
of one sequence each, with prefix reuse and routing. Both ``--workers N`` and ``--max-batch M`` above 1 is refused
(the two designs do not combine). A folder that cannot run batched (a hybrid model, the CUDA provider, static
shapes or CUDA graphs) is served by one worker, with one log line saying why."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import attrs
import uvicorn
from fastapi import FastAPI

from ortspec.adapters.cli.engine_args import backend_config, drafter
from ortspec.adapters.engine import Engine
from ortspec.adapters.engine.options import speculative_value
from ortspec.adapters.serve.app import create_app
from ortspec.adapters.serve.settings import ServerSettings
from ortspec.backends.base import BackendError, BatchBackend
from ortspec.backends.onnx import BackendConfig, ModelFolderError
from ortspec.batch_driver import DEFAULT_PREFILL_BUDGET

log = logging.getLogger("ortspec.serve")

DEFAULT_MAX_BATCH = 16  # the batched Engine's slots when --max-batch is not given


def default_threads(workers: int) -> int:
    """Intra-op threads per worker when not given: the usable cores shared out among the workers."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // workers)


def load_engines(
    model_dir: str | os.PathLike[str],
    backend: BackendConfig | None = None,
    *,
    workers: int = 1,
    prefix_reuse: bool = True,
    drafter: str | os.PathLike[str] | bool | None = None,
) -> list[Engine]:
    """One Engine per worker on ``model_dir`` (each its own session and KV), each opened with ``backend`` (a
    ``BackendConfig``; its ``threads`` None: the usable cores shared out among the workers) and ``drafter``
    (``Engine.from_dir``'s: by default the shared-KV drafter found for the model, if any)."""
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    backend = backend if backend is not None else BackendConfig()
    if backend.threads is None:
        backend = attrs.evolve(backend, threads=default_threads(workers))
    return [Engine.from_dir(model_dir, backend, prefix_reuse=prefix_reuse, drafter=drafter) for _ in range(workers)]


def batch_slots(workers: int, max_batch: int | None) -> int | None:
    """The slots of the one batched Engine for ``--workers`` and ``--max-batch`` (None: the worker design; see the
    module docstring). ``ValueError`` for both above 1."""
    if workers > 1 and max_batch is not None and max_batch > 1:
        raise ValueError(
            f"--workers {workers} and --max-batch {max_batch} do not combine: --max-batch runs one batched engine "
            f"(its slots share one session), --workers runs {workers} engines of one sequence each; give one of them"
        )
    if workers > 1 or max_batch == 1:
        return None
    return DEFAULT_MAX_BATCH if max_batch is None else max_batch


class Serving(NamedTuple):
    """What ``create_app`` serves: ``engines``, and the batch backend of the one Engine (None: one worker each)."""

    engines: list[Engine]
    batch: BatchBackend | None


def load_serving(
    model_dir: str | os.PathLike[str],
    backend: BackendConfig | None = None,
    *,
    workers: int = 1,
    max_batch: int | None = None,
    prefix_reuse: bool = True,
    prefill_budget: int | None = DEFAULT_PREFILL_BUDGET,
    drafter: str | os.PathLike[str] | bool | None = None,
) -> Serving:
    """The engines ``ortspec serve`` runs for ``--workers`` and ``--max-batch`` (``batch_slots``): one batched
    Engine (``threads`` None: all usable cores; one session, the weights once: ``Engine.from_dir(batch_slots=)``,
    the drafter's session shared by its slots; at most ``prefill_budget`` prompt tokens per pass,
    ``--prefill-budget``) or ``load_engines``. ``drafter``: ``Engine.from_dir``'s (by default the shared-KV drafter
    found for the model, if any). A folder that cannot run batched is served by one worker Engine (prefix reuse as
    ``prefix_reuse`` says), logging why."""
    slots = batch_slots(workers, max_batch)
    if slots is not None:
        return load_batched(
            model_dir, backend, slots, prefix_reuse=prefix_reuse, prefill_budget=prefill_budget, drafter=drafter
        )
    engines = load_engines(model_dir, backend, workers=workers, prefix_reuse=prefix_reuse, drafter=drafter)
    return Serving(engines, None)


def load_batched(
    model_dir: str | os.PathLike[str],
    backend: BackendConfig | None,
    slots: int,
    *,
    prefix_reuse: bool = True,
    prefill_budget: int | None = DEFAULT_PREFILL_BUDGET,
    drafter: str | os.PathLike[str] | bool | None = None,
) -> Serving:
    """One batched Engine of ``slots`` slots (``load_serving``'s batched design; ``ortspec serve --ray``'s replicas,
    whatever their slots), or one worker Engine for a folder that cannot run batched, logging why."""
    backend = backend if backend is not None else BackendConfig()
    if backend.threads is None:
        backend = attrs.evolve(backend, threads=default_threads(1))
    try:  # one session: the Engine's own backend is the batch backend's lone slot
        engine = Engine.from_dir(model_dir, backend, drafter=drafter, batch_slots=slots, prefill_budget=prefill_budget)
        return Serving([engine], engine.batch_backend())
    except (BackendError, ValueError) as exc:  # the worker design: here, one worker (batch_slots)
        if isinstance(exc, ModelFolderError):
            raise
        log.warning("this folder cannot run batched (%s); serving with one worker (one sequence per pass)", exc)
        one = Engine.from_dir(model_dir, backend, drafter=drafter, prefix_reuse=prefix_reuse)
        return Serving([one], None)


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", log_level: str = "warning") -> Iterator[str]:
    """Run ``app`` on uvicorn in a background thread, on a free port of ``host``; yield its base URL
    (``http://host:port``) once it serves (after the startup measurements), and stop it on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the server did not start (see the log above)")
            time.sleep(0.02)
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def cmd_serve(args: argparse.Namespace, model_dir: Path) -> int:
    """``ortspec serve``: load the engines (``load_serving``), measure them, serve until interrupted; with ``--ray``,
    the engines are Ray Serve replicas (``ray.run.cmd_serve_ray``) behind the same app."""
    settings = ServerSettings(
        model_name=args.model_name or Path(model_dir).name,
        speculative=speculative_value(args.speculative),
        max_queue=args.max_queue,
        request_timeout_s=args.timeout,
        default_max_tokens=args.default_max_tokens,
    )
    backend = backend_config(args, threads=args.threads)
    if args.ray is not None:
        from ortspec.adapters.serve.ray.replica import ReplicaSettings  # needs the 'ray' extra
        from ortspec.adapters.serve.ray.run import cmd_serve_ray

        if args.workers > 1:
            raise ValueError("--ray runs batched engines (their slots: --max-batch); --workers does not combine")
        replica = ReplicaSettings(
            backend=backend,
            server=settings,
            max_batch=args.max_batch,
            prefill_budget=args.prefill_budget,
            prefix_reuse=args.prefix_reuse,
            drafter=drafter(args),
        )
        return cmd_serve_ray(args, model_dir, replica)
    serving = load_serving(
        model_dir,
        backend,
        workers=args.workers,
        max_batch=args.max_batch,
        prefix_reuse=args.prefix_reuse,
        prefill_budget=args.prefill_budget,
        drafter=drafter(args),
    )
    app = create_app(serving.engines, settings, batch=serving.batch)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
