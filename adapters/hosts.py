"""What this process may use of the machine it runs on: its CPUs (``available_cores``) and a lock that processes on
it share (``file_lock``). Both serve code that never touches Ray (the local batch runner's worker processes, a batch
worker's warm-up), so they live here rather than in ``ray_support``; like it, a room below ``adapters/batch`` and
``adapters/serve`` that imports neither."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


def available_cores() -> list[int]:
    """The CPU ids this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


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
