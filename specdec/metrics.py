"""Speculation statistics: per request (reported in every output's stats) and engine-wide counters
(exported by the server). Plain counters here; Prometheus export lives at the HTTP edge."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """One request's speculation record."""
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    reached: list[int] = field(default_factory=list)        # [position] drafting rounds that reached it
    accepted_at: list[int] = field(default_factory=list)    # [position] ... and accepted it
    decode_forwards: int = 0      # target forwards after the first token
    decode_tokens: int = 0        # tokens those forwards produced
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.drafted_tokens += num_drafted
        self.accepted_tokens += num_accepted
        while len(self.reached) < num_drafted:
            self.reached.append(0)
            self.accepted_at.append(0)
        for j in range(min(num_drafted, num_accepted + 1)):
            self.reached[j] += 1
            self.accepted_at[j] += int(j < num_accepted)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    @property
    def mean_accepted_length(self) -> float:
        return self.decode_tokens / self.decode_forwards if self.decode_forwards else 1.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.accepted_at, self.reached)]


@dataclass
class EngineCounters:
    """Engine-wide totals since start."""
    requests_finished: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    target_forwards: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    proposer_errors: int = 0
    by_proposer: dict[str, SpecStats] = field(default_factory=dict)

    def record_spec(self, proposer: str, num_drafted: int, num_accepted: int) -> None:
        self.drafted_tokens += num_drafted
        self.accepted_tokens += num_accepted
        self.by_proposer.setdefault(proposer, SpecStats()).record(num_drafted, num_accepted)
