"""The Proposer protocol: anything that can guess the next k tokens of a request.

A proposer sees requests (their committed tokens and sampling params) and returns drafts with the
probabilities it drew them from (None for one-hot proposers such as n-gram lookup: rejection
sampling stays exact for any draft distribution), together with what the call cost. After
verification it is told how many drafts were accepted, so a proposer with state (a draft model's
KV cache) can roll back the rest.

A kind whose registry entry says `sizes_own_drafts` is offered every decoding request, with the
most drafts the engine allows (num_tokens) and the controller's k for a model draft (model_k);
it returns what it judges worth verifying (policy.best_k), maybe nothing.
Drafts marked `free` came from a lookup, not a model forward: they do not count as the draft
model's acceptance.

A request with a grammar (structured output) may come with tokens its grammar forces already
appended to `output_token_ids` (a view: `num_computed_tokens` still counts the committed ones):
the proposer drafts what follows them, masking inside a `request.grammar.lookahead()` where it
forms a distribution, and is told about its own drafts only in `on_verified`.

A kind whose registry entry says `has_kv_pool` also exposes `kv` (its KVCacheManager: the
scheduler admits a request only where both pools have room) and `row_align` (the rows its
forwards pad to, for the cost model).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from specdec.config import EngineConfig
from specdec.metrics import CacheStats
from specdec.models.loader import LoadedModel
from specdec.request import Request
from specdec.speculation.costs import CostEstimate


@dataclass
class DraftProposal:
    token_ids: list[int]                 # [k'] with k' <= the k asked for (may be empty)
    probs: torch.Tensor | None = None    # [k', vocab] processed draft distribution; None: one-hot
    free: bool = False                   # from a lookup (no model forward)


@dataclass
class Drafts:
    """What one propose() call returns: a proposal per request and what it cost."""
    proposals: list[DraftProposal]
    seconds: float = 0.0                 # wall time of the call
    # (rows, seconds) of each model forward; seconds None where the forward ran on a thread count
    # being tried (runner/threads.py), which is no measure of the draft's usual cost. Empty for a
    # model-free proposer.
    forward_costs: list[tuple[int, float | None]] = field(default_factory=list)


class SharedCache(Protocol):
    """State an engine's proposers share across requests of one cache scope (kept by the draft set,
    so it outlives any one proposer, e.g. a draft model's unload). Every finished request's output is
    offered to it with the request's scope."""
    def add(self, request_id: str, tokens: list[int], scope: str = "") -> None: ...
    def clear(self) -> None: ...
    def stats(self) -> CacheStats: ...


@dataclass
class BuildContext:
    """What a registry builder gets to make a proposer."""
    config: EngineConfig          # config.speculative names the model to load, for kinds that need one
    target: LoadedModel
    max_model_len: int
    draft_loaded: LoadedModel | None = None   # an already loaded draft model to reuse
    progress: bool = True
    verify_costs: CostEstimate | None = None  # the target's measured forward seconds by row count
    shared: dict[str, SharedCache] = field(default_factory=dict)   # the engine's shared caches, by name


class Proposer(Protocol):
    kind: str     # its registry kind, e.g. "draft_model" | "ngram"
    name: str     # e.g. the draft model's name, or "ngram[1-4]"

    def propose(self, requests: list[Request], num_tokens: list[int], model_k: list[int]) -> Drafts:
        """Drafts for each request, at most num_tokens[i] for requests[i] (model_k[i]: the controller's
        k, which a kind that sizes its own drafts weighs against its lookups). Must not raise for one
        request's trouble if it can leave that request without drafts instead."""
        ...

    def catch_up_tokens(self, request: Request) -> int:
        """Committed tokens it has not processed yet: its one-time cost before the next draft."""
        ...

    def on_verified(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """The target kept num_accepted of the num_drafted drafts this proposer made for the step
        (request.output_token_ids is updated)."""
        ...

    def free(self, request_id: str) -> None:
        """The request finished, was aborted or preempted: drop any state kept for it."""
        ...
