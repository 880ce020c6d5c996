"""The Proposer protocol: anything that can guess the next k tokens of a request.

A proposer sees requests (their committed tokens and sampling params) and returns drafts with the
probabilities it drew them from (None for one-hot proposers such as n-gram lookup: rejection
sampling stays exact for any draft distribution). After verification it is told how many drafts
were accepted, so a proposer with state (a draft model's KV cache) can roll back the rest.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specdec.request import Request


@dataclass
class DraftProposal:
    token_ids: list[int]                 # [k'] with k' <= the k asked for (may be empty)
    probs: torch.Tensor | None = None    # [k', vocab] processed draft distribution; None: one-hot


class Proposer(Protocol):
    method: str   # "draft_model" | "ngram"
    name: str     # e.g. the draft model's name, or "ngram[1-4]"
    draft_seconds: float                      # wall time of the last propose()
    # (rows, seconds) of each forward in the last propose(); seconds None where the forward ran on a
    # thread count being tried (runner/threads.py), which is no measure of the draft's usual cost
    forward_costs: list[tuple[int, float | None]]

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[DraftProposal]:
        """Drafts for each request, at most num_tokens[i] for requests[i]. Must not raise for one
        request's trouble if it can leave that request without drafts instead."""
        ...

    def catch_up_tokens(self, request: Request) -> int:
        """Committed tokens it has not processed yet: its one-time cost before the next draft."""
        ...

    def on_verified(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """The target kept num_accepted of num_drafted drafts (request.output_token_ids is updated)."""
        ...

    def free(self, request_id: str) -> None:
        """The request finished, was aborted or preempted: drop any state kept for it."""
        ...
