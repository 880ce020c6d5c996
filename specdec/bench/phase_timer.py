"""Self time of named calls: each wrapped call's time less the wrapped calls made inside it.

Wrapping a bound method on an instance (the engine's step, its scheduler's schedule, a runner's
model forward, ...) splits a step's wall time into parts that add up to it exactly, with no
sampling profiler's overhead or attribution guesswork.
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Any


class PhaseTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._inner: list[float] = []   # per open call: time spent in wrapped calls inside it

    def wrap(self, obj: Any, attr: str, name: str) -> None:
        """Time `obj.attr` as `name` from now on (an instance attribute shadows the method)."""
        fn = getattr(obj, attr)

        def timed(*args, **kwargs):
            self._inner.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                total = time.perf_counter() - t0
                inner = self._inner.pop()
                self.seconds[name] += total - inner
                self.calls[name] += 1
                if self._inner:
                    self._inner[-1] += total
        setattr(obj, attr, timed)

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)

    def since(self, before: dict[str, float]) -> dict[str, float]:
        """Seconds per name accumulated since `before` (a snapshot)."""
        return {k: v - before.get(k, 0.0) for k, v in self.seconds.items()}
