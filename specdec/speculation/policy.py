"""Policy arithmetic shared by every speculation decision: expected tokens per step, the best k (or
draft prefix) under step costs, and the one discounted estimator that every learned rate uses.

The controller (k per request), the self-pricing proposers (suffix, hybrid), the suffix lookup's
calibration and the router (gain per proposer) all price and learn with these, so they cannot drift
apart. Nothing here knows where costs come from or what a request is: callers pass numbers in.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

PRIOR_ACCEPTANCE = 0.6   # a draft position's acceptance before anything was verified


def expected_tokens(acceptance: list[float]) -> float:
    """Tokens one step emits with len(acceptance) drafts (Leviathan et al. 2023, section 3.4):
    1 + sum over i of prod_{j <= i} acceptance[j], with acceptance[j] the probability that draft j
    is accepted given the ones before it were (the 1 is the recovered or bonus token)."""
    total, reach = 1.0, 1.0
    for a in acceptance:
        reach *= a
        total += reach
    return total


def best_k(acceptance: list[float], step_costs: list[float], min_gain: float) -> tuple[int, list[float]]:
    """The number of drafts with the fewest seconds per token, 0 unless some k saves at least
    `min_gain` of plain decoding's seconds per token (a prediction inside the noise of measured
    costs is not worth a draft's switching costs).

    Args:
        acceptance: per draft position, as in `expected_tokens`; k never exceeds its length.
        step_costs: step_costs[k] = predicted seconds (or any unit) of a step with k drafts.
        min_gain: the fraction of a plain token's cost a k > 0 must save.
    Returns:
        (k, seconds per token for each k = 0 .. min(len(acceptance), len(step_costs) - 1)).
    """
    max_k = min(len(acceptance), len(step_costs) - 1)
    per_token = [step_costs[k] / expected_tokens(acceptance[:k]) for k in range(max_k + 1)]
    k_best = 0
    for k in range(1, max_k + 1):  # the 1e-9 keeps a tie (equal costs) on the smaller k
        if per_token[k] < min(per_token[k_best], per_token[0] * (1 - min_gain)) * (1 - 1e-9):
            k_best = k
    return k_best, per_token


def predicted_speedup(acceptance: list[float], k: int, draft_cost: float, verify_cost: float) -> float:
    """Tokens per unit of time relative to plain decoding: E[tokens | k] / (k c + t_verify(k + 1)),
    with costs in units of a plain target step (Leviathan et al. 2023, section 3.4)."""
    return expected_tokens(acceptance[:k]) / (k * draft_cost + verify_cost)


@dataclass(frozen=True)
class Tuning:
    """How a DiscountedRate learns: the weight an observation keeps per newer one, and how many
    pseudo-observations the prior counts as."""
    decay: float
    prior_strength: float


# The estimators that are not configured, tuned by what one observation is. Engine-wide acceptance
# (a draft's, over all requests of a domain) is the prior of each new request: it forgets slowly.
ENGINE_ACCEPTANCE = Tuning(decay=0.99, prior_strength=1.0)
# the suffix lookup's calibration (accepted drafts over their estimated probabilities), shared by
# all requests and observed once per verification: it forgets more slowly still
SUFFIX_CALIBRATION = Tuning(decay=0.995, prior_strength=2.0)
# the router's gain per proposer and domain, observed once per finished request: traffic drifts
ROUTER_GAIN = Tuning(decay=0.95, prior_strength=0.0)


@dataclass
class DiscountedRate:
    """A rate learned from discounted counts: (hits + m * prior) / (trials + m), with m the prior
    strength (a Beta posterior mean over counts that forget with `decay` per observation). A hit
    may be fractional and a trial may weigh other than one (a calibration ratio, a mean gain)."""
    tuning: Tuning
    hits: float = 0.0
    trials: float = 0.0

    def age(self) -> None:
        """One newer observation happened (here or in a sibling estimate that ages with this one)."""
        self.hits *= self.tuning.decay
        self.trials *= self.tuning.decay

    def add(self, hits: float, trials: float = 1.0) -> None:
        self.hits += hits
        self.trials += trials

    def observe(self, hits: float, trials: float = 1.0) -> None:
        self.age()
        self.add(hits, trials)

    def estimate(self, prior: float) -> float:
        """The rate, pulled toward `prior`; the prior itself while nothing weighs."""
        m = self.tuning.prior_strength
        return (self.hits + m * prior) / (self.trials + m) if self.trials + m > 0 else prior

    def upper_bound(self, prior: float, sigmas: float = 2.0) -> float:
        """The estimate plus `sigmas` standard deviations of its Beta posterior, at most 1: what the rate
        could still be after few trials (far above the estimate), or after many (close to it)."""
        n = self.trials + self.tuning.prior_strength
        mean = self.estimate(prior)
        return min(1.0, mean + sigmas * math.sqrt(mean * (1.0 - mean) / (n + 1.0)))

    @classmethod
    def pooled(cls, rates: list[DiscountedRate], tuning: Tuning) -> DiscountedRate:
        """The counts of several estimates summed (e.g. one draft position over every domain)."""
        return cls(tuning, sum(r.hits for r in rates), sum(r.trials for r in rates))


class PositionAcceptance:
    """A draft's acceptance at each position given the position was reached: one DiscountedRate per
    position, updated for the positions a verification reached."""

    def __init__(self, num_positions: int, tuning: Tuning) -> None:
        self.tuning = tuning
        self.positions = [DiscountedRate(tuning) for _ in range(num_positions)]

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """A verification of num_drafted drafts kept the first num_accepted: positions up to the
        first rejection were reached, and all but that one accepted."""
        for j in range(min(num_drafted, num_accepted + 1, len(self.positions))):
            self.positions[j].observe(1.0 if j < num_accepted else 0.0)

    def estimates(self, k: int, prior: float = PRIOR_ACCEPTANCE) -> list[float]:
        """Acceptance at the first k positions, each pulled toward the same prior."""
        return [rate.estimate(prior) for rate in self.positions[:k]]
