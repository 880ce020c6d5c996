"""SuffixProposer (SuffixDecoding): drafts from what followed the longest match of the request's
latest tokens, in its own prompt and output so far and in the outputs of earlier requests (the
engine's suffix cache, within the request's cache scope), whichever predicts more. No model: the
drafts cost a lookup.

How many tokens it drafts follows the evidence: the lookup stops where the continuation's estimated
probability falls below `suffix.min_prob` or past `suffix.spec_factor` times the match length; of
that, it keeps the prefix that maximizes expected tokens per second with the target's measured
verification costs (policy.best_k; static ones in the controller's deterministic mode, and the whole
lookup under the fixed policy), the estimated probabilities scaled by how often such drafts were
accepted so far after matches of about the same length (a one-token match's counts are weak
evidence; a thirty-token match's strong). Drafts are point masses, so rejection sampling keeps the
output exact.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from specdec.config import SpeculativeConfig
from specdec.request import Request
from specdec.speculation.proposers.base import BuildContext, DraftProposal, Drafts
from specdec.speculation.costs import CostEstimate, step_costs
from specdec.speculation.policy import SUFFIX_CALIBRATION, DiscountedRate, best_k
from specdec.speculation.proposers.suffix_cache import DraftLimits, SuffixDraft, SuffixIndex
from specdec.speculation.proposers.suffix_scopes import ScopedSuffixCache

# calibration by match length (1, 2-3, 4-7, 8-15, 16+ tokens): the ratio of accepted drafts to their
# estimated probabilities assumed before any is verified
_PRIOR_RATIO = (0.4, 0.6, 0.8, 0.9, 1.0)


def _bucket(match_length: int) -> int:
    return min(len(_PRIOR_RATIO) - 1, max(match_length, 1).bit_length() - 1)


def shared_cache(ctx: BuildContext) -> ScopedSuffixCache:
    """The engine's suffix cache (made on first use; the draft set keeps it)."""
    spec = ctx.config.speculative
    assert spec is not None
    cache = ctx.shared.get(ScopedSuffixCache.name)
    if not isinstance(cache, ScopedSuffixCache):
        cache = ctx.shared[ScopedSuffixCache.name] = ScopedSuffixCache(spec.suffix.cache_tokens,
                                                                        spec.suffix.max_scopes)
    return cache


def build(ctx: BuildContext) -> SuffixProposer:
    assert ctx.config.speculative is not None
    return SuffixProposer(shared_cache(ctx), ctx.config.speculative, ctx.verify_costs)


def limits_of(spec: SpeculativeConfig) -> DraftLimits:
    s = spec.suffix
    return DraftLimits(s.max_depth, s.min_prob, s.spec_factor, s.spec_offset)


@dataclass
class _Local:
    index: SuffixIndex
    offered: list[float]      # the estimated probabilities of the drafts last proposed ...
    bucket: int = 0           # ... and their match length's calibration bucket


class SuffixProposer:
    kind = "suffix"
    name = "suffix"

    def __init__(self, cache: ScopedSuffixCache, spec: SpeculativeConfig, verify: CostEstimate | None = None) -> None:
        # deterministic mode prices from static costs, as the controller does, so the drafts follow the text alone
        self.cache, self.verify = cache, None if spec.controller.deterministic else verify
        self.fixed = spec.policy == "fixed"
        self.limits = limits_of(spec)
        self.static_slope, self.min_gain = spec.controller.verify_cost_slope, spec.controller.min_gain
        self.local: dict[str, _Local] = {}
        # per match-length bucket: discounted accepted drafts over their summed estimated probabilities
        self.calibration = [DiscountedRate(SUFFIX_CALIBRATION) for _ in _PRIOR_RATIO]

    def propose(self, requests: list[Request], num_tokens: list[int], model_k: list[int]) -> Drafts:
        t0 = time.perf_counter()
        costs = step_costs(self.verify, len(requests), max(num_tokens, default=0), self.static_slope)
        out = []
        for req, k in zip(requests, num_tokens):
            draft = self.lookup(req, k)
            m = self.worth(draft, costs)[0]
            self.offer(req, draft, m)
            out.append(DraftProposal(draft.token_ids[:m], free=True))
        return Drafts(out, time.perf_counter() - t0)

    def lookup(self, req: Request, k: int) -> SuffixDraft:
        """The better of the request's own continuation and the shared cache's, at most k tokens."""
        if k <= 0:
            return SuffixDraft()
        tokens = req.all_token_ids
        local = self.local.get(req.request_id)
        if local is None:
            local = self.local[req.request_id] = _Local(SuffixIndex(), [])
        seen = len(local.index.seqs.get(0, ()))
        # only committed tokens join the index: `tokens` may end with drafts fixed earlier in the step
        local.index.extend(0, tokens[seen: req.num_computed_tokens + 1])
        own = local.index.draft(tokens, k, self.limits)
        other = self.cache.draft(tokens, k, self.limits, req.params.cache_scope)
        return own if own.score >= other.score else other

    def acceptance(self, draft: SuffixDraft) -> list[float]:
        """The draft's probabilities, scaled by how well such estimates have held so far."""
        b = _bucket(draft.match_length)
        ratio = self.calibration[b].estimate(_PRIOR_RATIO[b])
        return [min(1.0, p * ratio) for p in draft.probs]

    def offer(self, req: Request, draft: SuffixDraft, m: int) -> None:
        """The first m tokens of `draft` go to verification (their outcome updates the calibration)."""
        local = self.local[req.request_id]
        local.offered, local.bucket = draft.probs[:m], _bucket(draft.match_length)

    def worth(self, draft: SuffixDraft, costs: list[float]) -> tuple[int, float]:
        """(drafts worth verifying, predicted seconds per token) under these step costs; under the
        fixed policy every draft the lookup's own limits allow."""
        m, per_token = best_k(self.acceptance(draft), costs, self.min_gain)
        if self.fixed:
            m = len(per_token) - 1
        return m, per_token[m]

    def catch_up_tokens(self, request: Request) -> int:
        return 0

    def on_verified(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        local = self.local.get(request.request_id)
        if local is None or not local.offered or not num_drafted:
            return
        reached = local.offered[: min(num_drafted, num_accepted + 1)]
        self.calibration[local.bucket].observe(min(num_accepted, num_drafted), sum(reached))
        local.offered = []

    def free(self, request_id: str) -> None:
        self.local.pop(request_id, None)
