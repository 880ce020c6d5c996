"""Measured costs of speculation: tables of forward seconds by row count (what the controller's
cost model prices steps with), one request's step costs for proposers that price their own drafts,
and how long outputs run. The decisions made from them live in policy.py."""
from __future__ import annotations

from collections import deque
from typing import Protocol

from specdec.quant.layers import ROW_ALIGN, pad_rows


class CostEstimate(Protocol):
    def estimate(self, rows: int) -> float | None:
        """Measured seconds of a target forward over `rows` rows (None: nothing measured yet)."""
        ...


def step_costs(verify: CostEstimate | None, batch: int, max_k: int, static_slope: float,
               draft_seconds: float = 0.0) -> list[float]:
    """Seconds one request's step costs with m = 0..max_k drafts: its share of a plain step plus
    the rows its drafts add to the batch's forward, plus `draft_seconds` per draft. Before anything
    is measured, in units of a plain step with `static_slope` per extra row."""
    base = verify.estimate(batch) if verify is not None else None
    if base is None:
        return [1.0 + m * (static_slope + draft_seconds) for m in range(max_k + 1)]
    out = []
    for m in range(max_k + 1):
        extra = (verify.estimate(batch + m) or base) - base if m else 0.0
        out.append(base / batch + max(extra, 0.0) + m * draft_seconds)
    return out


class CostTable:
    """Measured seconds by padded row count (the runner pads rows to a multiple of 4, so e.g. 1-4
    rows cost the same): the median of the last 5 measurements (of fewer than 3: the newest). A
    median, not a moving average: one outlier (a process's cold first forward, the thread tuner
    trying a count) moves nothing, which matters most for the plain step's cost, since it is not
    measured again while a request speculates. An unmeasured row count is interpolated between the
    nearest measurements around it (prefill chunks give the large ones, so on a CPU a 16-row
    verification is priced from what 4 and 48 rows cost, on a GPU it stays flat); outside the
    measured range it scales in proportion to the nearest measurement (below it that is optimistic
    on purpose: the controller tries the row count and learns its real cost). No row count is priced
    above a larger one's measurement: a slow outlier at a count the controller then avoids would
    otherwise stand, never measured again."""

    def __init__(self, window: int = 5, row_align: int = ROW_ALIGN) -> None:
        self.window = window
        self.row_align = row_align  # the runner's padding: row counts that cost the same share a key
        self.seconds: dict[int, float] = {}
        self._recent: dict[int, deque] = {}

    def record(self, rows: int, seconds: float) -> None:
        key = pad_rows(rows, self.row_align)
        recent = self._recent.setdefault(key, deque(maxlen=self.window))
        recent.append(seconds)
        self.seconds[key] = sorted(recent)[len(recent) // 2] if len(recent) >= 3 else seconds

    def estimate(self, rows: int) -> float | None:
        key = pad_rows(rows, self.row_align)
        seconds = self._estimate(key)
        above = [s for r, s in self.seconds.items() if r > key]
        return seconds if seconds is None or not above else min(seconds, *above)

    def _estimate(self, key: int) -> float | None:
        if key in self.seconds:
            return self.seconds[key]
        lower = max((r for r in self.seconds if r < key), default=None)
        higher = min((r for r in self.seconds if r > key), default=None)
        if lower is None and higher is None:
            return None
        if lower is None or higher is None:  # proportional to the nearest measurement
            near = higher if lower is None else lower
            return self.seconds[near] * key / near
        w = (key - lower) / (higher - lower)
        return (1 - w) * self.seconds[lower] + w * self.seconds[higher]

    def prefill(self, rows: int) -> float | None:
        """Cost of a long forward, once some forward of >= 16 rows was measured."""
        return self.estimate(rows) if any(r >= 16 for r in self.seconds) else None


class OutputLengths:
    """How long outputs of a domain run, from the requests that finished (the last `window`): a
    draft model's one-time catch-up is worth paying only over the tokens a request will still
    generate, and a request without ignore_eos usually stops long before max_tokens (a tool call
    after 30 tokens, say)."""

    def __init__(self, window: int = 32) -> None:
        self.window = window
        self._seen: dict[str | None, deque] = {}

    def record(self, domain: str | None, num_tokens: int) -> None:
        self._seen.setdefault(domain, deque(maxlen=self.window)).append(num_tokens)

    def expected_remaining(self, domain: str | None, generated: int, remaining: int) -> int:
        """Tokens a request that generated `generated` is expected to add, at most `remaining` (its
        cap): the domain's median length minus what it has, or once past that median as many again
        as it has (a long answer tends to go on); the cap while nothing is known."""
        seen = self._seen.get(domain)
        if not seen:
            return remaining
        typical = sorted(seen)[len(seen) // 2]
        return max(1, min(remaining, typical - generated if generated < typical else generated))
