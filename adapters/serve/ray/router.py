"""Prefix affinity across replicas: which replica a request goes to (``prefix_ranks``, the rule) and the Ray Serve
request router that applies it (``PrefixAffinityRouter``).

The rule. Each replica is known by the prompts routed to it lately (its last ``held`` prompts: what its batch
driver's slots most likely still hold as resident KV; a slot keeps its prompt's KV, and the tokens it generated,
after its request ends). A request goes to the replicas whose held prompts share the longest prefix with its prompt
when that prefix is at least ``min_share`` of the prompt (the next turn of a conversation, another question about
the same document); otherwise, and when those replicas have no room, to any replica: Ray Serve's router takes, in
each rank, the replica with the shortest queue (least loaded). Within the replica the batch driver picks the slot
(``core.prefix.reuse_score``), so the second turn prefills only its new tokens.

The router lives in the process holding the deployment's handle (``ortspec serve --ray``'s ingress); its table is
that process's, kept as requests are routed (``on_request_routed``) and replicas die (``on_replica_actor_died``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, TypeVar

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from ortspec.core.prefix import common_prefix_length

K = TypeVar("K", bound=Hashable)

MIN_SHARE = 0.5  # the share of a prompt a replica's held prefix must cover for the request to go there


def prefix_ranks(held: Mapping[K, Sequence[Sequence[int]]], ids: Sequence[int], min_share: float) -> list[list[K]]:
    """The replicas a prompt ``ids`` should go to, best first: ``[[the replicas sharing the longest prefix], [every
    replica]]`` when that prefix covers at least ``min_share`` of ``ids``, else ``[[every replica]]``. ``held``:
    each replica's recent prompts (replicas absent from it hold nothing)."""
    everyone = list(held)
    shared = {key: max((common_prefix_length(p, ids) for p in prompts), default=0) for key, prompts in held.items()}
    best = max(shared.values(), default=0)
    if not ids or best < min_share * len(ids) or best == 0:
        return [everyone]
    return [[key for key in everyone if shared[key] == best], everyone]


def prompt_of(request: PendingRequest | None) -> Sequence[int] | None:
    """The prompt ids of a pending ``EngineReplica.generate`` call (its one argument's ``prepared.ids``), or None
    for any other call."""
    if request is None or not request.args:
        return None
    prepared = getattr(request.args[0], "prepared", None)
    ids = getattr(prepared, "ids", None)
    return ids if isinstance(ids, list) else None


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Ray Serve's request router for the engine replicas: ``prefix_ranks`` over the replicas' recent prompts, then
    (Ray Serve's own step) the least loaded replica of the first rank with room. ``held``: prompts remembered per
    replica (its slots); ``min_share``: as for ``prefix_ranks``."""

    def initialize_state(self, held: int = 16, min_share: float = MIN_SHARE, **kwargs: Any) -> None:
        self._held_count, self._min_share = held, min_share
        self._held: dict[ReplicaID, deque[Sequence[int]]] = {}

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        ids = prompt_of(pending_request)
        if ids is None:
            return [candidate_replicas]
        by_id = {r.replica_id: r for r in candidate_replicas}
        held = {key: self._held.get(key, ()) for key in by_id}
        return [[by_id[key] for key in rank] for rank in prefix_ranks(held, ids, self._min_share)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        ids = prompt_of(pending_request)
        if ids is not None:
            self._held.setdefault(replica_id, deque(maxlen=self._held_count)).append(ids)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._held.pop(replica_id, None)
