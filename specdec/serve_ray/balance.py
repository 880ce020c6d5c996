"""The router's own view of the load, and its choice of replica (no Ray here: unit-tested alone).

The load is the count of requests this router sent to each replica and that have not finished. It is
exact where Ray's queue-length cache is not: that cache drops an entry 10 s after its last update,
and an idle replica's entry is updated only when something is sent there, so a replica that
restarted during a burst of one hot prompt looked "unknown", was left out of the comparison, and
never got that prompt. A replica this router has nothing on has 0 here, which is the truth."""
from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable

# a choice whose request was never sent (cancelled while routing) stops counting after this
UNSENT_SECONDS = 10.0


class InFlight:
    """Requests in flight per replica, keyed by Ray's internal request id. A request counts from the
    moment it is chosen (a burst is routed faster than replicas confirm) until it finishes."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.requests: dict[str, tuple[str, float | None]] = {}   # request id -> (replica, chosen at; None once sent)

    def chosen(self, request_id: str, replica: str) -> None:
        self.requests[request_id] = (replica, self.clock())

    def sent(self, request_id: str, replica: str) -> None:
        self.requests[request_id] = (replica, None)

    def finished(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def keep_only(self, live: set[str]) -> None:
        self.requests = {q: v for q, v in self.requests.items() if v[0] in live}

    def counts(self) -> Counter[str]:
        now = self.clock()
        self.requests = {q: (r, at) for q, (r, at) in self.requests.items() if at is None or now - at < UNSENT_SECONDS}
        return Counter(r for r, _ in self.requests.values())


def pick_replica(holders: list[str], live: list[str], load: Counter[str], imbalance: int,
                 rng: random.Random | None = None) -> str:
    """The replica for a request whose prefix `holders` were sent (first holder first).

    The least-loaded holder, while it has at most `imbalance` more requests in flight than the least
    loaded live replica; otherwise that least-loaded replica (which then becomes a holder too, so a
    hot prefix spreads). With no holder: the less loaded of two random live replicas."""
    rng = rng or random
    if not holders:
        pair = rng.sample(live, min(2, len(live)))
        return min(pair, key=lambda r: load[r])
    holder = min(holders, key=lambda r: load[r])
    least = min(load[r] for r in live)
    if load[holder] - least <= imbalance:
        return holder
    return rng.choice([r for r in live if load[r] == least])
