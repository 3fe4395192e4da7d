"""Running the server: the Engine it serves (``load_serving``) and uvicorn in a background thread
(``serve_in_thread``). ``ortspec serve`` (``adapters/cli/serve.py``) calls both.

One Engine serves every request: its batch backend's ``--max-batch`` slots (``DEFAULT_MAX_BATCH``, the Engine's
``DEFAULT_SLOTS``) share one session, and its one scheduler runs every request holding a slot in each pass. A
folder that cannot run batched (a hybrid model, the CUDA provider, static shapes or CUDA graphs) is served by the
same Engine one sequence at a time (``Engine.note`` says why; one log line repeats it)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator

import attrs
import uvicorn
from fastapi import FastAPI

from ortspec.adapters.engine import Engine
from ortspec.adapters.engine.engine import DEFAULT_SLOTS
from ortspec.adapters.hosts import available_cores
from ortspec.backends.onnx import BackendConfig
from ortspec.batch_driver import DEFAULT_PREFILL_BUDGET

log = logging.getLogger("ortspec.serve")

DEFAULT_MAX_BATCH = DEFAULT_SLOTS  # the Engine's slots when --max-batch is not given


def default_threads() -> int:
    """Intra-op threads when not given: every usable core (the one Engine's passes run on all of them)."""
    return len(available_cores())


def load_serving(
    model_dir: str | os.PathLike[str],
    backend: BackendConfig | None = None,
    *,
    max_batch: int | None = None,
    prefix_reuse: bool = True,
    prefill_budget: int | None = DEFAULT_PREFILL_BUDGET,
    drafter: str | os.PathLike[str] | bool | None = None,
    draft_model: str | os.PathLike[str] | None = None,
    tree_branches: int = 1,
) -> Engine:
    """The Engine ``ortspec serve`` runs (and each ``--ray`` replica): ``Engine.from_dir`` with ``max_batch`` slots
    (None: ``DEFAULT_MAX_BATCH``), opened with ``backend`` (a ``BackendConfig``; its ``threads`` None: every usable
    core), prefix reuse on unless ``prefix_reuse`` is False (a request takes the free slot holding its longest
    prefix), at most ``prefill_budget`` prompt tokens per pass (``--prefill-budget``), and ``drafter``
    (``Engine.from_dir``'s: by default the shared-KV drafter found for the model, if any) and ``draft_model``
    (``Engine.from_dir``'s: a draft model folder of the same vocabulary, or None), and ``tree_branches`` (the
    Engine's: 1, chains; more, token trees where they pay). A folder that cannot run
    batched is served one sequence at a time, logging why."""
    backend = backend if backend is not None else BackendConfig()
    if backend.threads is None:
        backend = attrs.evolve(backend, threads=default_threads())
    engine = Engine.from_dir(
        model_dir,
        backend,
        prefix_reuse=prefix_reuse,
        drafter=drafter,
        draft_model=draft_model,
        batch_slots=max_batch,
        prefill_budget=prefill_budget,
        tree_branches=tree_branches,
    )
    if engine.note is not None:
        log.warning("%s", engine.note)
    return engine


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
