"""How much CPU other processes took while a benchmark run was timed.

The load average counts the benchmark's own threads, so it flags every run of a busy benchmark.
Busy CPU time from /proc/stat minus this process's own CPU time isolates the competition; on a
2-core machine half a core taken by someone else already distorts the timings.
"""
from __future__ import annotations

import os
import time

NOISY_CORES = 0.5  # competing cores above which a run is flagged


def _busy_seconds() -> float | None:
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None  # not Linux: no measurement
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class Contention:
    """Context manager: `.cores` = average cores used by other processes during the block."""

    def __enter__(self) -> Contention:
        self._busy, self._own, self._wall = _busy_seconds(), time.process_time(), time.perf_counter()
        self.load_average = os.getloadavg()[0]
        self.cores: float | None = None
        return self

    def __exit__(self, *exc) -> None:
        busy = _busy_seconds()
        wall = time.perf_counter() - self._wall
        if busy is not None and self._busy is not None and wall > 0:
            others = (busy - self._busy) - (time.process_time() - self._own)
            self.cores = max(0.0, others / wall)

    @property
    def noisy(self) -> bool:
        return self.cores is not None and self.cores > NOISY_CORES
