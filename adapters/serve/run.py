"""Running the server: one Engine per worker (``load_engines``), uvicorn in a background thread
(``serve_in_thread``), and ``cmd_serve``, what ``ortspec serve`` calls."""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import uvicorn
from fastapi import FastAPI

from ortspec.adapters.cli.engine_args import backend_config
from ortspec.adapters.engine import Engine
from ortspec.adapters.engine.options import speculative_value
from ortspec.adapters.serve.app import create_app
from ortspec.adapters.serve.settings import ServerSettings
from ortspec.backends.onnx import BackendConfig


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
) -> list[Engine]:
    """One Engine per worker on ``model_dir`` (each its own session and KV), each opened with ``backend`` (a
    ``BackendConfig``; its ``threads`` None: the usable cores shared out among the workers)."""
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    backend = backend if backend is not None else BackendConfig()
    if backend.threads is None:
        backend = attrs.evolve(backend, threads=default_threads(workers))
    return [Engine.from_dir(model_dir, backend, prefix_reuse=prefix_reuse, drafter=False) for _ in range(workers)]


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
    """``ortspec serve``: load one Engine per worker, measure them, serve until interrupted."""
    engines = load_engines(
        model_dir,
        backend_config(args, threads=args.threads),
        workers=args.workers,
        prefix_reuse=args.prefix_reuse,
    )
    settings = ServerSettings(
        model_name=args.model_name or Path(model_dir).name,
        speculative=speculative_value(args.speculative),
        max_queue=args.max_queue,
        request_timeout_s=args.timeout,
        default_max_tokens=args.default_max_tokens,
    )
    app = create_app(engines, settings)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
