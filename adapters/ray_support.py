"""What ``ortspec batch --ray`` and ``ortspec serve --ray`` share about Ray: starting or joining it
(``ray_session``), sizing actors to its nodes (``plan_actors``), and the model folder on every node (``model_source``
on the driver, ``materialize`` in each actor). A room of its own below ``adapters/batch`` and ``adapters/serve``
(both import it; it imports neither). Ray itself (the ``ray`` extra: ``pip install 'ortspec[ray]'``) is imported
only when a function here needs it. Errors that stop a command before anything runs are ``RayError``. Only the
Ray pieces live here: the process's CPUs and the lock across processes, which code that never starts Ray uses too,
are ``adapters/hosts.py``'s.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import socket
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ortspec.adapters.hosts import available_cores, file_lock

RAY_EXTRA_MESSAGE = "--ray needs Ray, which is not installed: pip install 'ortspec[ray]' (ray[data,serve]==2.60.0)"
# Files are shipped in pieces of at most this many bytes (bounds the driver's memory while it puts them).
SHIP_CHUNK = 256 << 20


class RayError(Exception):
    """Ray cannot be imported, started or joined, or has no room for the actors asked for."""


def import_ray() -> Any:
    """``ray``, or ``RayError`` saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise RayError(f"{RAY_EXTRA_MESSAGE} ({exc})") from None
    return ray


@contextlib.contextmanager
def ray_session(address: str) -> Iterator[Any]:
    """Ray, initialised for a command: ``"local"`` starts a local instance with this process's cores (and shuts it
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
            raise RayError(f"cannot start or join Ray ({address}): {type(exc).__name__}: {exc}") from None
        started = True
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    try:
        yield ray
    finally:
        if started:
            ray.shutdown()


def plan_actors(
    ray: Any,
    address: str,
    actors: int,
    threads: int | None,
    say: Callable[[str], object],
    *,
    noun: str = "worker",
) -> tuple[int, int]:
    """(actors, threads per actor) for this cluster: ``threads`` defaults to its CPUs shared out (at most one
    node's). ``RayError`` when no node has ``threads`` CPUs, or when a local instance has fewer CPUs than
    actors x threads; on a cluster that is short of CPUs now, a note to ``say`` (an autoscaler may add nodes).
    ``noun``: what the messages call an actor (``"worker"`` for ``ortspec batch``, ``"replica"`` for
    ``ortspec serve``)."""
    if isinstance(actors, bool) or not isinstance(actors, int) or actors < 1:
        raise RayError(f"{noun}s must be an int >= 1, got {actors!r}")
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    per_node = [int(n.get("Resources", {}).get("CPU", 0)) for n in nodes]
    total, biggest = sum(per_node), max(per_node, default=0)
    if threads is None:
        threads = max(1, min(biggest, total // actors))
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise RayError(f"threads must be an int >= 1, got {threads!r}")
    if threads > biggest:
        raise RayError(f"each {noun} asks for {threads} CPUs (threads) but the largest Ray node has {biggest}")
    if actors * threads > total:
        message = (
            f"{actors} {noun}s x {threads} threads = {actors * threads} CPUs, more than the {total} the Ray cluster has"
        )
        if address == "local":
            raise RayError(message + f": choose {noun}s x threads <= {total}")
        say(message + " now: actors wait until nodes join")
    return actors, threads


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
