"""The seams between scheduler, runner and sampler: plain dataclasses, nothing else."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RequestDrafts:
    """One request's drafts for a step, as proposed."""
    token_ids: list[int]
    num_forced: int = 0                 # the leading ones its grammar forced (one-hot)
    # [len(token_ids) - num_forced, vocab'] the distributions the proposer's drafts came from; None: one-hot
    probs: torch.Tensor | None = None
    free: bool = False                  # from a lookup, no draft forward


@dataclass
class DraftBatch:
    """What the proposers offer this step, by request id. The scheduler keeps a prefix of each
    (what fits) and puts it into its output; verification reads the kept drafts from there."""
    by_request: dict[str, RequestDrafts] = field(default_factory=dict)

    def token_ids(self, request_id: str) -> list[int]:
        drafts = self.by_request.get(request_id)
        return drafts.token_ids if drafts is not None else []


@dataclass
class ScheduledChunk:
    """One request's share of a step: the tokens whose K/V this forward computes."""
    request_id: str
    token_ids: list[int]     # [num_scheduled] committed tokens, then the drafts to verify
    start_position: int      # num_computed_tokens before this step
    block_ids: list[int]     # the request's whole block table
    num_logits: int          # logits for the last num_logits tokens (0: a prefill chunk mid-prompt)
    draft_token_ids: list[int] = field(default_factory=list)  # the drafts scheduled for verification

    @property
    def num_drafts(self) -> int:
        return len(self.draft_token_ids)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    num_batched_tokens: int
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class ModelRunnerOutput:
    logits: torch.Tensor        # [num_logits_total, vocab_size] float32, never-sample ids at -inf
    cu_num_logits: list[int]    # [len(chunks) + 1] row offsets of each chunk's logits
    forward_seconds: float = 0.0
    exploring: bool = False     # it ran on a thread count the tuner is trying: not a typical cost
    hidden: torch.Tensor | None = None  # the logit rows' final hidden states (rows padded to the model's row_align)
    vocab_ids: torch.Tensor | None = None  # the token id of each logits column (a sub-vocabulary's); None: all


@dataclass
class DraftChain:
    """One request's drafts in one call (`ModelRunner.draft_chain`): `steps` forwards, the first feeding
    `feed` (what the draft's cache lacks) from `position` on, each later one the last pick. Greedy
    at temperature 0; else over the request's processed logits (temperature, top-k, top-p, min-p):
    Gumbel-coupled with its noise key (the pick for output position noise_at + s), or drawn from
    their softmax by `uniform`, draws from its generator."""
    feed: list[int]
    steps: int
    position: int
    slots: torch.Tensor                 # [position + len(feed) + steps - 1] int64: every position's cache slot
    own_head: object | None = None      # the output layer's rows of the request's own tokens (QuantLinear or tensor)
    own_ids: torch.Tensor | None = None  # their token ids
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    noise_key: int | None = None
    noise_at: int = 0
    uniform: torch.Tensor | None = None  # [steps] float64 in [0, 1)


@dataclass
class ChainOutput:
    """What `ModelRunner.draft_chain` returns: each chain's picks, and for a sampled one the
    distribution of each pick ([steps, vocab]); each forward's rows and seconds (None where the
    thread tuner explored another count)."""
    tokens: list[list[int]]
    probs: list[torch.Tensor | None]
    forward_costs: list[tuple[int, float | None]]
