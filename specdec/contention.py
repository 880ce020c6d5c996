"""How much CPU other processes took while a benchmark run was timed.

The load average counts the benchmark's own threads, so it flags every run of a busy benchmark.
Busy CPU time from /proc/stat minus this process's own CPU time (and that of helper processes the
benchmark drives, such as a peer's worker) isolates the competition; on a 2-core machine half a core
taken by someone else already distorts the timings. Used by the benchmarks and the quality tools
alike; imports nothing from specdec.
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


def _process_seconds(pid: int) -> float:
    """CPU seconds (user + system) of a live process, 0 when unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state is field 3
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


class Contention:
    """Context manager: `.cores` = average cores used by other processes during the block.
    `helper_pids`: processes working for this benchmark, counted as its own."""

    def __init__(self, helper_pids: tuple[int, ...] = ()) -> None:
        self.helper_pids = helper_pids

    def _own_seconds(self) -> float:
        return time.process_time() + sum(_process_seconds(p) for p in self.helper_pids)

    def __enter__(self) -> Contention:
        self._busy, self._own, self._wall = _busy_seconds(), self._own_seconds(), time.perf_counter()
        self.load_average = os.getloadavg()[0]
        self.cores: float | None = None
        return self

    def __exit__(self, *exc) -> None:
        busy = _busy_seconds()
        wall = time.perf_counter() - self._wall
        if busy is not None and self._busy is not None and wall > 0:
            others = (busy - self._busy) - (self._own_seconds() - self._own)
            self.cores = max(0.0, others / wall)

    @property
    def noisy(self) -> bool:
        return self.cores is not None and self.cores > NOISY_CORES


def busy_warning(timings: list[Contention]) -> str | None:
    """One warning line when other processes competed during some of the timed blocks (None when
    none did): the figures then measure the machine's load as much as the code."""
    noisy = [t.cores for t in timings if t.noisy]
    if not noisy:
        return None
    return (f"warning: other processes took up to {max(noisy):.1f} cores in {len(noisy)} of {len(timings)} "
            f"timed runs (> {NOISY_CORES} cores): the figures may be off")
