"""Request routers for the engine replicas (Ray Serve's request-router extension point). They run
in the caller's process (the ingress), see each request's `Forwarded.affinity` text, and return
ranked groups of replicas; Ray takes the first replica of the first group with room.

`PrefixAffinityRouter`: a replica that was sent the longest prefix of this text, unless it has
`imbalance` more requests in flight than the least-loaded replica (then that one, which becomes a
holder of the prefix too); for new prefixes, the less loaded of two random replicas (balance.py).
The load is the router's own count of requests sent and not finished. When the replica set changes,
the prefixes and requests of replicas gone are forgotten. `RandomRouter`: uniform, the baseline of
`bench affinity`."""
from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from specdec.serve_ray.affinity import PrefixIndex
from specdec.serve_ray.balance import InFlight, pick_replica


def _text(request: PendingRequest | None) -> str:
    if request is None or not request.args:
        return ""
    return getattr(request.args[0], "affinity", "") or ""


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, imbalance: int = 4, chunk_chars: int = 128, max_entries: int = 200_000) -> None:
        self.index = PrefixIndex(chunk_chars, max_entries)
        self.imbalance = imbalance
        self.in_flight = InFlight()
        self.live: set[str] = set()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        text = _text(pending_request)
        holders, _ = self.index.match(text, set(by_id)) if text else ([], 0)
        chosen = pick_replica(holders, list(by_id), self.in_flight.counts(), self.imbalance)
        if pending_request is not None:
            self.in_flight.chosen(pending_request.metadata.internal_request_id, chosen)
        rest = [r for r in candidate_replicas if r is not by_id[chosen]]
        random.shuffle(rest)
        return [[by_id[chosen]], rest] if rest else [[by_id[chosen]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self.in_flight.sent(pending_request.metadata.internal_request_id, replica_id.unique_id)
        text = _text(pending_request)
        if text:
            self.index.insert(text, replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.in_flight.finished(internal_request_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        if live != self.live:  # a replica died, a new one is ready, or autoscaling moved
            self.index.keep_only(live)
            self.in_flight.keep_only(live)
            self.live = live

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.forget(replica_id.unique_id)
        self.in_flight.keep_only(self.live - {replica_id.unique_id})


class RandomRouter(RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        order = random.sample(candidate_replicas, len(candidate_replicas))
        return [[r] for r in order]


ROUTERS = {"affinity": PrefixAffinityRouter, "random": RandomRouter}
