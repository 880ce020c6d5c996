"""The intra-op thread count, chosen online by measurement.

`specdec bench threads` found no single best count on a 2-core CPU: with the machine to itself every
kernel is fastest on all cores, but once another process takes a core, a one-row forward (a decode
step) often runs faster on one thread, because a parallel call waits at its end for a worker the OS
has descheduled; several rows still gain from two. So each runner keeps, for one-row forwards, a
moving average of seconds for each thread count, uses the best, and now and then tries the others,
which follows a competing process as it comes and goes. The first forward on each count only warms
it up and is not measured: a process's first forwards page the weights in and start the thread
pool, and one such cold forward once made one thread look faster than two, which the moving average
then took hundreds of forwards to undo (a speculating engine, whose one-row forwards are rare,
decoded its plain steps on one thread at 1.7x the cost). Forwards of several rows (verification,
prefill) always take every core: they were faster on all cores in every measured condition, and
trying one thread on a 600-token prefill would cost seconds. Thread counts never change a result:
every kernel reduces each output on one thread (tests/test_threads.py checks logits bitwise).

Each runner owns its count: it sets torch's intra-op count around its own forward (`using_threads`)
and restores the previous one after, so a target and its draft model, each with its own tuner or a
fixed count (`ModelConfig.num_threads`, a tuner with one candidate), never leave their count to the
other or to the rest of the process.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

PROBE_EVERY = 50  # forwards of a size class between tries of another thread count
ALPHA = 0.3       # weight of the newest measurement in the moving average


def size_class(rows: int) -> int:
    """Forwards that cost alike per row: one row (decode), a few (verification), many (prefill)."""
    return 0 if rows == 1 else 1 if rows <= 16 else 2


class ThreadTuner:
    def __init__(self, max_threads: int, probe_every: int = PROBE_EVERY, alpha: float = ALPHA,
                 counts: list[int] | None = None) -> None:
        """`counts`: the candidates (default 1, 2, 4, ... and max_threads)."""
        self.counts = counts or sorted({1 << i for i in range(max(1, max_threads).bit_length())
                                        if 1 << i <= max_threads} | {max(1, max_threads)})
        self.probe_every, self.alpha = probe_every, alpha
        self.cost: dict[tuple[int, int], float] = {}  # (size class, threads) -> seconds per row (EMA)
        self.forwards: dict[int, int] = {}            # size class -> forwards so far
        self.warm: set[tuple[int, int]] = set()       # (size class, threads) that ran a forward already

    @classmethod
    def fixed(cls, num_threads: int) -> ThreadTuner:
        """Always `num_threads` (a configured count): a tuner with one candidate, never exploring."""
        return cls(num_threads, counts=[num_threads])

    def best(self, rows: int) -> int | None:
        c = size_class(rows)
        measured = [t for t in self.counts if (c, t) in self.cost]
        return min(measured, key=lambda t: self.cost[c, t]) if measured else None

    def choose(self, rows: int) -> int:
        """The thread count for a forward of `rows` rows (the runner applies it: `using_threads`)."""
        c = size_class(rows)
        n = self.forwards.get(c, 0)
        self.forwards[c] = n + 1
        unmeasured = [t for t in self.counts if (c, t) not in self.cost]
        if c > 0:
            threads = self.counts[-1]  # several rows: every core (see the module docstring)
        elif unmeasured:
            threads = unmeasured[-1]  # the most threads first: the quiet machine's best
        else:
            threads = self.best(rows)
            if n % self.probe_every == self.probe_every - 1:  # try the next count in turn
                threads = self.counts[(n // self.probe_every) % len(self.counts)]
        return threads

    def record(self, rows: int, threads: int, seconds: float) -> None:
        key = (size_class(rows), threads)
        if key not in self.warm:  # the warm-up forward (see the module docstring)
            self.warm.add(key)
            return
        per_row = seconds / rows
        old = self.cost.get(key)
        self.cost[key] = per_row if old is None else (1 - self.alpha) * old + self.alpha * per_row


@contextlib.contextmanager
def using_threads(num_threads: int | None) -> Iterator[None]:
    """Torch's intra-op thread count set to `num_threads` inside the block and restored after it
    (None: left as it is); set only where it differs, so a forward on the current count costs nothing."""
    before = torch.get_num_threads()
    if num_threads is not None and num_threads != before:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def thread_tuner(model_config) -> ThreadTuner | None:
    """The thread policy of a runner of this ModelConfig: its fixed `num_threads` where set (on any
    device, as the count of its CPU work), else on CPU a tuner over every core this process may use,
    else None (torch's count, untouched)."""
    if model_config.num_threads is not None:
        return ThreadTuner.fixed(model_config.num_threads)
    if not model_config.device.startswith("cpu"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return ThreadTuner(cores)
