"""Statistics: per request (reported in every output's stats), engine-wide counters, and the engine
stats snapshot that the server and the metrics read (plain dataclasses; Prometheus export lives at
the HTTP edge)."""
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
    free_drafted_tokens: int = 0  # drafts from a lookup, not a model forward (a hybrid's free share)
    free_accepted_tokens: int = 0
    forced_drafted_tokens: int = 0  # drafts a grammar allowed as the only continuation (structured outputs)
    forced_accepted_tokens: int = 0

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
    cached_prompt_tokens: int = 0   # of prompt_tokens: found in the prefix cache
    generated_tokens: int = 0
    target_forwards: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    by_proposer: dict[str, SpecStats] = field(default_factory=dict)

    def record_spec(self, proposer: str, num_drafted: int, num_accepted: int) -> None:
        self.drafted_tokens += num_drafted
        self.accepted_tokens += num_accepted
        self.by_proposer.setdefault(proposer, SpecStats()).record(num_drafted, num_accepted)


@dataclass
class PoolStats:
    num_blocks: int
    num_free: int          # cached prefix blocks count as free

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free


@dataclass
class DraftStatus:
    id: str
    model: str | None        # the reference it loads from (None for a model-free proposer)
    state: str               # "loaded" | "loading" | "unloaded" | "failed"
    pinned: bool             # loaded with the engine, never unloaded for idleness
    error: str | None = None
    idle_seconds: float | None = None


@dataclass
class ProposerStats:
    """A loaded proposer and its controller's health-check counts."""
    id: str
    name: str
    kind: str
    num_fallbacks: int = 0
    num_reprobes: int = 0
    num_resumes: int = 0
    draft_step_seconds: float | None = None   # measured: one draft step at batch 1 (None: not yet)
    # measured: a target forward verifying i + 1 rows, i = 0..k (None where nothing is measured yet)
    verify_seconds: list[float | None] = field(default_factory=list)


@dataclass
class CacheStats:
    """A draft cache shared by an engine's requests (the suffix cache of finished outputs)."""
    name: str
    num_sequences: int
    num_tokens: int
    max_tokens: int          # the budget (per scope); the oldest sequences are evicted beyond it
    num_index_entries: int
    approx_bytes: int        # rough host memory of the tokens and their index
    num_evicted: int = 0
    num_scopes: int = 1      # caches kept apart by cache scope (cache_salt / API key), each with the budget


@dataclass
class FreeDraftStats:
    """Drafts a proposer took from a lookup rather than a model forward (the hybrid's free share)."""
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    rounds: int = 0          # verifications of such drafts


@dataclass
class SpeculationStats:
    default: str | None                       # the configured proposer's id
    proposers: list[ProposerStats]
    drafts: list[DraftStatus]
    pools: dict[str, PoolStats]               # draft KV pools by proposer id
    router: dict[str, dict[str, dict[str, float]]] | None   # domain -> proposer -> arm; None: no router
    num_router_switches: int = 0
    num_loads: int = 0
    num_unloads: int = 0
    num_load_failures: int = 0
    num_proposer_errors: int = 0
    caches: list[CacheStats] = field(default_factory=list)
    free_drafts: dict[str, FreeDraftStats] = field(default_factory=dict)   # by proposer id


@dataclass
class EngineStats:
    """A consistent snapshot of an engine between two steps."""
    model: str
    precision: str
    max_model_len: int
    counters: EngineCounters
    num_waiting: int          # foreground requests waiting to be scheduled
    num_background: int       # background (shadow A/B) requests waiting
    num_running: int
    num_preemptions: int
    target_pool: PoolStats
    speculation: SpeculationStats | None
