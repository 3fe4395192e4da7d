"""A pass gate across processes, for tests of ``ortspec serve --ray``: a Ray actor (``PassGate``) the test holds and
opens, and the batch backend wrapper each replica puts around its batch backend (``GatedReplicaBackend``, through
``ReplicaSettings.wrap_batch``), whose every pass waits at the gate. Passes are counted per replica (its full
Ray Serve id). Every wait is on the gate's condition; ``GATE_S`` only bounds one that should never end."""

from __future__ import annotations

import asyncio
from collections import Counter

import ray

from tests.support.gates import GATE_S


@ray.remote(num_cpus=0)
class PassGate:
    """Open: a pass goes at once. Held: each pass waits for a permit (``allow``)."""

    def __init__(self) -> None:
        self.permits: int | None = None
        self.counts: Counter[str] = Counter()
        self.changed = asyncio.Condition()

    async def enter(self, replica: str) -> None:
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(lambda: self.permits is None or self.permits > 0), GATE_S)
            if self.permits is not None:
                self.permits -= 1
            self.counts[replica] += 1
            self.changed.notify_all()

    async def hold(self) -> dict[str, int]:
        async with self.changed:
            self.permits = 0
            return dict(self.counts)

    async def allow(self, n: int) -> None:
        async with self.changed:
            self.permits = (self.permits or 0) + n
            self.changed.notify_all()

    async def open(self) -> None:
        async with self.changed:
            self.permits = None
            self.changed.notify_all()

    async def passes(self) -> dict[str, int]:
        return dict(self.counts)


class GatedReplicaBackend:
    """A replica's batch backend whose passes wait at the named ``PassGate``."""

    def __init__(self, inner, gate: str) -> None:
        from ray import serve

        self.inner, self.gate = inner, ray.get_actor(gate)
        self.replica = serve.get_replica_context().replica_id.to_full_id_str()

    def run_pass(self, rows):
        ray.get(self.gate.enter.remote(self.replica), timeout=GATE_S)
        return self.inner.run_pass(rows)

    def __getattr__(self, name):
        return getattr(self.inner, name)
