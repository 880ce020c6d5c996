"""The seams between scheduler, runner and sampler: plain dataclasses, nothing else."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ScheduledChunk:
    """One request's share of a step: the tokens whose K/V this forward computes."""
    request_id: str
    token_ids: list[int]     # [num_scheduled] committed tokens, then the drafts to verify
    start_position: int      # num_computed_tokens before this step
    block_ids: list[int]     # the request's whole block table
    num_logits: int          # logits for the last num_logits tokens (0: a prefill chunk mid-prompt)

    @property
    def num_drafts(self) -> int:
        """Scheduled draft slots: every logit row but the one after the last committed token."""
        return max(self.num_logits - 1, 0)


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
