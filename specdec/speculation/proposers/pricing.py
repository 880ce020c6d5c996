"""Pricing a draft before it is verified: how many of a lookup's tokens are worth a verification.

Proposers that size their own drafts (registry `sizes_own_drafts`) know each draft token's
probability before the target sees it, so they keep the prefix that maximizes expected tokens per
second (Leviathan et al. 2023, section 3.4), with the target's measured verification costs.
"""
from __future__ import annotations

from typing import Protocol


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


def expected_tokens(acceptance: list[float]) -> float:
    """Tokens a step emits with these drafts: 1 + sum over j of P(first j drafts accepted), with
    `acceptance[j]` the probability of draft j given the ones before it were accepted."""
    total, reach = 1.0, 1.0
    for a in acceptance:
        reach *= a
        total += reach
    return total


def best_prefix(acceptance: list[float], costs: list[float], min_gain: float) -> tuple[int, float]:
    """(m, seconds per token): the number of drafts to keep, 0 unless some m saves at least
    `min_gain` of a plain step's seconds per token. costs[m] prices a step with m drafts."""
    best_m, best = 0, costs[0]
    for m in range(1, min(len(acceptance), len(costs) - 1) + 1):
        per_token = costs[m] / expected_tokens(acceptance[:m])
        if per_token < min(best, costs[0] * (1 - min_gain)) * (1 - 1e-9):
            best_m, best = m, per_token
    return best_m, best
