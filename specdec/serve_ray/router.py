"""Request routers for the engine replicas (Ray Serve's request-router extension point). They run
in the caller's process (the ingress), see each request's `Forwarded.affinity` text, and return
ranked groups of replicas; Ray picks the least-loaded replica with room in the first group it can.

`PrefixAffinityRouter`: the replica that was sent the longest prefix of this text, unless it has
`imbalance` more requests queued than the least-loaded one; otherwise (and for new prefixes) the
less loaded of two random replicas. `RandomRouter`: uniform, the baseline of `bench affinity`."""
from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from specdec.serve_ray.affinity import PrefixIndex


def _text(request: PendingRequest | None) -> str:
    if request is None or not request.args:
        return ""
    return getattr(request.args[0], "affinity", "") or ""


def _two_random(replicas: list[RunningReplica]) -> list[list[RunningReplica]]:
    return [random.sample(replicas, min(2, len(replicas)))] if replicas else []


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, imbalance: int = 4, chunk_chars: int = 128, max_entries: int = 200_000) -> None:
        self.index = PrefixIndex(chunk_chars, max_entries)
        self.imbalance = imbalance

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        text = _text(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        owner, _ = self.index.match(text, set(by_id)) if text else (None, 0)
        if owner is None or not self._balanced(by_id[owner], candidate_replicas):
            return _two_random(candidate_replicas)
        rest = [r for r in candidate_replicas if r is not by_id[owner]]
        random.shuffle(rest)
        return [[by_id[owner]], rest] if rest else [[by_id[owner]]]

    def _balanced(self, owner: RunningReplica, replicas: list[RunningReplica]) -> bool:
        """The owner's queue is within `imbalance` of the shortest (unknown lengths count as balanced)."""
        cache = self._replica_queue_len_cache
        mine = cache.get(owner.replica_id)
        others = [q for r in replicas if (q := cache.get(r.replica_id)) is not None]
        return mine is None or not others or mine - min(others) <= self.imbalance

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        text = _text(pending_request)
        if text:
            self.index.insert(text, replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.forget(replica_id.unique_id)


class RandomRouter(RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        order = random.sample(candidate_replicas, len(candidate_replicas))
        return [[r] for r in order]


ROUTERS = {"affinity": PrefixAffinityRouter, "random": RandomRouter}
