"""Request: one prompt's life in the engine, and RequestOutput: what the user gets back.

A request's tokens are `prompt_token_ids + output_token_ids`; `num_computed_tokens` counts how many
of them (plus the drafts scheduled this step) have K/V in the cache. A step's drafts are values
that travel from the speculator through the scheduler's output to verification, never stored here.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from specdec.metrics import SpecStats
from specdec.grammar import GrammarState
from specdec.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass
class SpecOptions:
    """Per-request control of speculation (the server's `speculative` field)."""
    enabled: bool = True
    method: str | None = None    # "draft_model" | "ngram" | a loaded draft's name | "auto" (the router);
                                 # None: the router if enabled, else the engine's default
    max_k: int | None = None     # caps the configured k for this request

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"speculative.enabled must be a boolean, got {self.enabled!r}")
        if self.max_k is not None and (not isinstance(self.max_k, int) or isinstance(self.max_k, bool)
                                       or self.max_k < 0):
            raise ValueError(f"speculative.max_k must be a non-negative integer, got {self.max_k!r}")


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache at first admission (-1: not yet)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    spec: SpecStats = field(default_factory=SpecStats)
    spec_method: str | None = None   # id of the proposer drafting for this request; None: plain decoding
    spec_max_k: int | None = None
    spec_domain: str | None = None   # the guess of the prompt's domain (router, controller prior)
    spec_history: list[str] = field(default_factory=list)  # proposer ids it used, in order
    background: bool = False         # low priority (shadow A/B): admitted when nothing else waits
    fork_of: str | None = None       # a queued request with the same prompt, whose prompt K/V it will share
    grammar: GrammarState | None = None  # its structured output's state (the one owner of its matcher)
    noise_key: int | None = None     # sampled and Gumbel-coupled: the key of its positional noise (sample/noise.py)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finished(self) -> bool:
        return self.status.finished


@dataclass
class RequestStats:
    prompt_tokens: int
    generated_tokens: int
    seconds: float              # submission to last token
    ttft_seconds: float         # submission to first token
    tokens_per_second: float    # generated / seconds
    decode_tokens_per_second: float  # (generated - 1) / (seconds - ttft)
    precision: str
    method: str = "none"        # "none", or the proposer kind: "draft_model", "ngram", "suffix", "hybrid", ...
    proposer: str | None = None
    proposers_used: list[str] = field(default_factory=list)  # more than one when the router switched
    domain: str | None = None   # the router's domain guess
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float | None = None   # accepted / drafted; None when nothing was drafted
    mean_accepted_length: float = 1.0      # tokens per decode-phase target forward
    per_position_acceptance: list[float] = field(default_factory=list)  # P(accept i | reached i)
    free_drafted_tokens: int = 0           # of drafted_tokens: from a lookup, not a model (the hybrid's share)
    free_accepted_tokens: int = 0
    forced_drafted_tokens: int = 0         # of drafted_tokens: forced by the request's grammar
    forced_accepted_tokens: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    structured: str | None = None          # the structured output's kind; None: unconstrained
    mask_seconds: float = 0.0              # computing the grammar's token masks (target and draft rows)
    num_masks: int = 0
    cached_prompt_tokens: int = 0          # prompt tokens the prefix cache held (not computed again)
    seed: int | None = None                # the request's seed (its own, or the one the engine drew for it)
    coupling: str | None = None            # how its sampled tokens were verified: "gumbel" | "rejection"; None: greedy
    kv_cache_dtype: str | None = None      # the target's K/V cache format ("float32", "float16", ...)

    @classmethod
    def from_request(cls, req: Request, precision: str, method: str = "none", proposer: str | None = None,
                     proposers_used: list[str] | None = None, kv_cache_dtype: str | None = None) -> "RequestStats":
        end = req.finish_time or time.perf_counter()
        first = req.first_token_time or end
        seconds = max(end - req.arrival_time, 1e-9)
        ttft = first - req.arrival_time
        n = len(req.output_token_ids)
        decode_time = seconds - ttft
        return cls(
            prompt_tokens=req.num_prompt_tokens,
            cached_prompt_tokens=max(req.num_cached_tokens, 0),
            generated_tokens=n,
            seconds=seconds,
            ttft_seconds=ttft,
            tokens_per_second=n / seconds,
            decode_tokens_per_second=(n - 1) / decode_time if n > 1 and decode_time > 0 else 0.0,
            precision=precision,
            kv_cache_dtype=kv_cache_dtype,
            method=method,
            proposer=proposer,
            proposers_used=proposers_used or ([proposer] if proposer else []),
            domain=req.spec_domain,
            seed=req.params.seed,
            coupling=None if req.params.greedy else ("gumbel" if req.noise_key is not None else "rejection"),
            drafted_tokens=req.spec.drafted_tokens,
            accepted_tokens=req.spec.accepted_tokens,
            acceptance_rate=req.spec.acceptance_rate,
            mean_accepted_length=req.spec.mean_accepted_length,
            per_position_acceptance=req.spec.per_position_acceptance,
            free_drafted_tokens=req.spec.free_drafted_tokens,
            free_accepted_tokens=req.spec.free_accepted_tokens,
            forced_drafted_tokens=req.spec.forced_drafted_tokens,
            forced_accepted_tokens=req.spec.forced_accepted_tokens,
            draft_seconds=req.spec.draft_seconds,
            verify_seconds=req.spec.verify_seconds,
            structured=req.params.structured.kind if req.params.structured is not None else None,
            mask_seconds=req.grammar.mask_seconds if req.grammar is not None else 0.0,
            num_masks=req.grammar.num_masks if req.grammar is not None else 0,
        )


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None   # "stop" | "length" | "abort" | None while running
    stats: RequestStats
    logprobs: list[dict[int, float]] | None = None
    delta_text: str = ""        # streaming: text new since the previous output
    error: str | None = None    # set when the engine ended it early: the structured-output bound it hit
