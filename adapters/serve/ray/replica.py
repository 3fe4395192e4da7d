"""``EngineReplica``: one replica of ``ortspec serve --ray``'s Ray Serve deployment: the Engine ``ortspec serve``
opens (``run.load_serving``) behind the same pool (``app.make_pool``: a ``BatchPool`` on the Engine's one
scheduler), fed by the ingress through a deployment handle.

A request arrives as a ``ReplicaRequest`` (the ingress made it ready: token ids, options, fields) and
``generate`` streams its job's events back in messages (lists: the events ready at once), in order: a
``ReplicaStarted`` naming the replica, then the job's ``Commit``s (when streaming) and its ``Finished``, or a
``Failed`` whose error is an ``APIError`` (the response the app gives: a 400 naming the field, a 429 with
``Retry-After``, a 504, a 500) with the outcome the ingress counts. When the caller cancels the stream (its client
went away), Ray Serve cancels ``generate``, which cancels the job: it is in no pass after the current one.

The model folder is found as the batch job's actors find it (``ray_support.materialize``): at its path on the
replica's node, or shipped through the object store and written once per node into the ortspec cache; a node
without it fails the replica with an error naming the folder and the node.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import attrs

from ortspec.adapters.engine import Engine
from ortspec.adapters.ray_support import materialize
from ortspec.adapters.serve.app import make_pool
from ortspec.adapters.serve.errors import Cancelled, QueueFull, RequestTimeout, job_error, queue_full_error
from ortspec.adapters.serve.jobs import Failed, Finished, Started
from ortspec.adapters.serve.metrics import Metrics
from ortspec.adapters.serve.models import Prepared
from ortspec.adapters.serve.run import DEFAULT_MAX_BATCH, load_serving
from ortspec.adapters.serve.settings import ServerSettings
from ortspec.backends.base import BatchBackend
from ortspec.backends.onnx import BackendConfig
from ortspec.batch_driver import DEFAULT_PREFILL_BUDGET
from ortspec.core.state import Commit


@attrs.frozen(kw_only=True)
class ReplicaSettings:
    """``ortspec serve``'s options, as every replica opens its Engine and serves with them (one value, pickled to
    each replica). ``backend``, ``prefill_budget``, ``prefix_reuse``, ``drafter``, ``draft_model`` (a folder on
    every node), ``tree_branches``: as for ``run.load_serving``;
    ``max_batch``: the slots (None: ``ortspec serve``'s default). ``server``: the ``ServerSettings``
    (``max_queue`` is each replica's queue beyond its slots; the ingress bounds the whole). ``source``: the model
    folder's path on every node, or its shipped files (``ray_support.model_source``; ``run.ray_app`` fills it in).
    ``wrap_batch``: what the Engine's batch backend is wrapped in before serving (tests: a gate; None: nothing); the
    wrapper must pass everything but the passes through, ``lone()`` included (``wrapped``)."""

    backend: BackendConfig
    server: ServerSettings
    source: str | Mapping[str, Any] = ""
    max_batch: int | None = None
    prefill_budget: int | None = DEFAULT_PREFILL_BUDGET
    prefix_reuse: bool = True
    drafter: str | bool | None = None
    draft_model: str | None = None
    tree_branches: int = 1
    wrap_batch: Callable[[BatchBackend], BatchBackend] | None = None

    @property
    def slots(self) -> int:
        """A replica's batch slots: ``max_batch``, or ``ortspec serve``'s default."""
        return self.max_batch if self.max_batch is not None else DEFAULT_MAX_BATCH


class ReplicaInfo(NamedTuple):
    """What the ingress needs of the model a replica serves: ``slots`` (requests it runs at once),
    ``context_length`` (tokens), ``vocab_size``."""

    slots: int
    context_length: int
    vocab_size: int


class ReplicaRequest(NamedTuple):
    """A request for a replica: made ready by the ingress; ``deadline``: its deadline in Unix time (seconds: the
    nodes' clocks agree on it, where their monotonic clocks do not), so time spent waiting for a replica counts."""

    prepared: Prepared
    stream: bool
    deadline: float


class ReplicaStarted(NamedTuple):
    """The first message of a request: which replica took it (``rank``: its index in the deployment, reported as
    ``ortspec.worker``; ``replica``: Ray Serve's full id of its actor, ``SERVE_REPLICA::app#deployment#id``)."""

    rank: int
    replica: str


class ReplicaFailed(NamedTuple):
    """A request's end in failure: ``error``, the response; ``outcome``, what the ingress counts it as (``error``,
    ``timeout``, ``cancelled``; None: the request's own mistake, not counted)."""

    error: Exception
    outcome: str | None


def failure(error: BaseException, fields: Mapping[str, str]) -> ReplicaFailed:
    """A job's failure as the ingress gets it (the response ``job_error`` gives, and its outcome)."""
    if isinstance(error, QueueFull):
        return ReplicaFailed(queue_full_error(error), None)
    outcome = {Cancelled: "cancelled", RequestTimeout: "timeout"}.get(type(error), "error")
    return ReplicaFailed(job_error(error, fields), None if isinstance(error, ValueError) else outcome)


Message = list[ReplicaStarted | Commit | Finished | ReplicaFailed]


class EngineReplica:
    """A Ray Serve deployment class: one batched Engine on ``settings`` (see the module docstring). Measures the
    Engine before serving (``settings.server.measure_at_startup``)."""

    def __init__(self, settings: ReplicaSettings) -> None:
        from ray import serve

        model_dir = materialize(settings.source)
        engine = load_serving(
            Path(model_dir),
            settings.backend,
            max_batch=settings.slots,
            prefix_reuse=settings.prefix_reuse,
            prefill_budget=settings.prefill_budget,
            drafter=settings.drafter,
            draft_model=settings.draft_model,
            tree_branches=settings.tree_branches,
        )
        if settings.wrap_batch is not None:
            engine = wrapped(engine, settings.wrap_batch)
        self.engine = engine
        self.pool = make_pool(engine, settings.server, Metrics())
        if settings.server.measure_at_startup:
            self.pool.measure()
        context = serve.get_replica_context()
        rank = getattr(context.rank, "rank", context.rank)
        self.started = ReplicaStarted(int(rank) if isinstance(rank, int) else 0, context.replica_id.to_full_id_str())

    async def describe(self) -> ReplicaInfo:
        engine = self.pool.texts
        return ReplicaInfo(self.pool.parallel, self.pool.context_length, engine.backend.vocab_size)

    async def generate(self, request: ReplicaRequest) -> AsyncIterator[Message]:
        """The request's messages (see the module docstring); cancelling this generator cancels the job."""
        prepared = request.prepared
        deadline = self.pool.clock() + (request.deadline - time.time())
        try:
            job = await self.pool.submit(prepared, stream=request.stream, deadline=deadline)
        except QueueFull as exc:
            yield [failure(exc, prepared.fields)]
            return
        try:
            yield [self.started]
            while True:
                message: Message = []
                for event in await job.next_ready():
                    if isinstance(event, Failed):
                        message.append(failure(event.error, prepared.fields))
                    elif not isinstance(event, Started):
                        message.append(event)
                if message:
                    yield message
                    if isinstance(message[-1], (Finished, ReplicaFailed)):
                        return
        finally:
            job.cancel()  # no-op once it ended; otherwise the scheduler drops it after the current pass

    def __del__(self) -> None:
        pool, engine = getattr(self, "pool", None), getattr(self, "engine", None)
        if pool is not None:
            pool.close()
        if engine is not None:
            engine.close()


def wrapped(engine: Engine, wrap: Callable[[BatchBackend], BatchBackend]) -> Engine:
    """``engine`` with its batch backend wrapped in ``wrap`` (before its scheduler starts, so the scheduler drives
    ``wrap(engine.batch)``; the measurements keep the unwrapped backend)."""
    engine.batch = wrap(engine.batch)  # its scheduler starts on first use: it drives the wrapped backend
    return engine
