"""``RayPool``: the ingress side of ``ortspec serve --ray``: the app's pool (``jobs.ServePool``) whose requests go
to the engine replicas through a Ray Serve deployment handle.

The ingress makes a request ready (token ids from its own ``PromptReader``, options, fields) exactly as
``ortspec serve`` does, then ``submit`` starts a job whose events come from the replica's ``generate`` stream
(``replica.EngineReplica``): the router (``router.PrefixAffinityRouter``) picks the replica. The job is the same
``RequestGeneration`` the other pools hand the app, so the routes, streaming, errors and the ``ortspec`` extension
field are theirs; ``ortspec.worker`` is the replica's rank.

Bounds: ``parallel`` = replicas x slots run at once; ``max_queue`` more may wait (in the replicas' driver queues
or Ray Serve's); one more is refused here with ``QueueFull`` (429, ``Retry-After``). A client that goes away cancels
its job: the relay task is cancelled, which cancels the handle's stream, which cancels the replica's job. A replica
that dies mid-request fails its requests with a 500 (``replica_failed``; a stream's error event); the others go
on, and Ray Serve starts a replacement.

Threads: everything runs on the app's event loop except ``measure`` and ``close``, as for the other pools.
``metrics`` are the ingress's: requests, outcomes, tokens, time to first token (the per-pass batch histograms are
each replica's own).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ortspec.adapters.engine.tokenizer import PromptReader
from ortspec.adapters.serve.errors import APIError, QueueFull
from ortspec.adapters.serve.jobs import Clock, Failed, Finished, RequestGeneration, Started, SubmittedJobs
from ortspec.adapters.serve.metrics import Metrics
from ortspec.adapters.serve.models import Prepared
from ortspec.adapters.serve.ray.replica import ReplicaFailed, ReplicaInfo, ReplicaRequest, ReplicaStarted
from ortspec.core.state import Commit


class RayPool(SubmittedJobs):
    """The engine replicas behind ``handle`` (a ``DeploymentHandle`` of ``EngineReplica``), ``replicas`` of them (at
    most, with autoscaling) of ``info.slots`` each; ``texts`` makes prompts ready. ``max_queue``, ``timeout_s``,
    ``metrics``, ``clock`` as for the other pools."""

    def __init__(
        self,
        handle: Any,
        texts: PromptReader,
        info: ReplicaInfo,
        replicas: int,
        *,
        max_queue: int,
        timeout_s: float,
        metrics: Metrics,
        clock: Clock = time.monotonic,
    ) -> None:
        super().__init__(
            parallel=replicas * info.slots, max_queue=max_queue, timeout_s=timeout_s, metrics=metrics, clock=clock
        )
        self.handle, self.info, self.replicas = handle, info, replicas
        self._texts = texts
        metrics.workers.set(replicas)
        metrics.batch_slots.set(info.slots)

    @property
    def texts(self) -> PromptReader:
        return self._texts

    @property
    def context_length(self) -> int:
        return self.info.context_length

    def replica_of(self, job: RequestGeneration) -> str | None:
        """The full id of the replica actor serving ``job`` (None until it started, or once it ended)."""
        return self._jobs.get(job)

    def health(self) -> dict[str, int]:
        return {"replicas": self.replicas, "max_batch": self.info.slots}

    def measure(self) -> None:
        """Nothing: each replica measures its Engine as it starts."""

    def close(self) -> None:
        for job in self.jobs:
            job.cancel()

    async def submit(self, prepared: Prepared, *, stream: bool, deadline: float) -> RequestGeneration:
        """Start the request's job on a replica (``QueueFull`` when ``max_queue`` requests already wait beyond the
        replicas' slots). The caller reads the job's events and cancels the job when it stops reading."""
        if self.full:
            self.metrics.rejected.inc()
            raise QueueFull(self.retry_after())
        loop = asyncio.get_running_loop()
        job = RequestGeneration(loop, self.texts, 0, prepared, stream=stream, deadline=deadline)
        self._jobs[job] = None
        self._publish()
        relay = loop.create_task(self._relay(job))
        job.on_cancel = lambda: loop.call_soon_threadsafe(relay.cancel)
        return job

    async def _relay(self, job: RequestGeneration) -> None:
        """The replica's messages as the job's events; the job's end, counted here."""
        request = ReplicaRequest(job.prepared, job.stream, time.time() + (job.deadline - self.clock()))
        response = self.handle.options(stream=True).generate.remote(request)
        started = self.clock()
        try:
            async for message in response:
                if any([self._delivered(job, item) for item in message]):
                    break  # the job ended
        except asyncio.CancelledError:
            response.cancel()
            job.end_cancelled(self.metrics)
        except Exception as exc:  # noqa: BLE001 - the replica died or Ray failed: this request's 500
            self.metrics.generations.labels("error").inc()
            message = f"the replica serving this request failed: {type(exc).__name__}: {_first_line(exc)}"
            job.emit(Failed(APIError(500, message, type="server_error", code="replica_failed")))
        finally:
            self._jobs.pop(job, None)
            self._served(self.clock() - started)
            self._publish()

    def _delivered(self, job: RequestGeneration, item: object) -> bool:
        """Hand ``item`` to the job; True when it ended the job."""
        if isinstance(item, ReplicaStarted):
            job.worker, self._jobs[job] = item.rank, item.replica
            job.emit(Started())
        elif isinstance(item, Commit):
            job.deliver(item)
        elif isinstance(item, Finished):
            job.finish(item.result, self.metrics)
            return True
        elif isinstance(item, ReplicaFailed):
            if item.outcome is not None:
                self.metrics.generations.labels(item.outcome).inc()
            if isinstance(item.error, APIError) and item.error.status == 429:
                self.metrics.rejected.inc()
            job.emit(Failed(item.error))
            return True
        return False


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else ""
