"""HybridProposer: per request and per step, a free suffix draft or the draft model's, whichever
the cost model prices higher, or none.

The suffix lookup runs first (it costs microseconds). Its draft is priced with its calibrated
probabilities and the target's measured verification costs; the draft model's k (the controller's
choice, in `request.num_spec_tokens`: its measured acceptance and cost, its catch-up after steps it
sat out) with its own measured acceptance per position and draft cost. The higher expected tokens
per second wins; a suffix draft is kept only where it beats plain decoding by `min_gain`. So a
long match (a file being rewritten, a JSON shape seen before) drafts for free, and elsewhere the
model drafts as it would alone. The suffix part shares the engine's cache with the `suffix` kind.
"""
from __future__ import annotations

import time

from specdec.request import Request
from specdec.speculation.proposers import draft_model
from specdec.speculation.proposers.base import BuildContext, DraftProposal, Drafts
from specdec.speculation.costs import step_costs
from specdec.speculation.policy import ENGINE_ACCEPTANCE, PositionAcceptance, expected_tokens
from specdec.speculation.proposers.suffix import SuffixProposer, shared_cache


def build(ctx: BuildContext) -> HybridProposer:
    spec = ctx.config.speculative
    assert spec is not None
    model = draft_model.build(ctx)
    return HybridProposer(SuffixProposer(shared_cache(ctx), spec, ctx.verify_costs), model,
                          spec.controller.draft_cost_ratio)


class HybridProposer:
    kind = "hybrid"

    def __init__(self, suffix: SuffixProposer, model: draft_model.DraftModelProposer,
                 draft_cost_ratio: float) -> None:
        """`draft_cost_ratio`: a model draft's cost in target steps until one is measured (the
        controller's static ratio)."""
        self.suffix, self.model = suffix, model
        self.name = f"hybrid:{model.name}"
        self.kv = model.kv
        # the model's acceptance per position over all requests, as the controller's domain priors
        self.acceptance = PositionAcceptance(32, ENGINE_ACCEPTANCE)
        self.draft_cost_ratio = draft_cost_ratio
        self.draft_seconds: float | None = None   # one draft-model step at small batch, measured
        self._source: dict[str, str] = {}          # request id -> "suffix" | "model" for the last step

    @property
    def row_align(self) -> int:
        return self.model.row_align

    def propose(self, requests: list[Request], num_tokens: list[int], model_k: list[int]) -> Drafts:
        t0 = time.perf_counter()
        batch = len(requests)
        costs = step_costs(self.suffix.verify, batch, max(num_tokens, default=0), self.suffix.static_slope)
        proposals = [DraftProposal([]) for _ in requests]
        to_model: list[int] = []
        for i, (req, cap, model) in enumerate(zip(requests, num_tokens, model_k)):
            lookup = self.suffix.lookup(req, cap)
            m, suffix_cost = self.suffix.worth(lookup, costs)
            k = min(model, cap)
            if m and (k == 0 or suffix_cost <= self._model_cost(k, costs)):
                self.suffix.offer(req, lookup, m)
                proposals[i] = DraftProposal(lookup.token_ids[:m], free=True)
                self._source[req.request_id] = "suffix"
            elif k:
                to_model.append(i)
                self._source[req.request_id] = "model"
            else:
                self._source.pop(req.request_id, None)
        forward_costs: list[tuple[int, float | None]] = []
        if to_model:
            ks = [min(model_k[i], num_tokens[i]) for i in to_model]
            drafted = self.model.propose([requests[i] for i in to_model], ks, ks)
            forward_costs = drafted.forward_costs
            for i, proposal in zip(to_model, drafted.proposals):
                proposals[i] = proposal
            self._record_draft(forward_costs, len(to_model))
        return Drafts(proposals, time.perf_counter() - t0, forward_costs)

    def _model_cost(self, k: int, costs: list[float]) -> float:
        """Predicted seconds per token of k model drafts."""
        unit = costs[0]
        per_draft = self.draft_seconds if self.draft_seconds is not None else self.draft_cost_ratio * unit
        return (costs[min(k, len(costs) - 1)] + k * per_draft) / expected_tokens(self.acceptance.estimates(k))

    def _record_draft(self, forward_costs: list[tuple[int, float | None]], batch: int) -> None:
        """Keep the cost of the draft's decode steps (not its catch-up forwards), per request."""
        for rows, seconds in forward_costs:
            if seconds is not None and rows <= 2 * batch:
                share = seconds / batch
                self.draft_seconds = share if self.draft_seconds is None else 0.7 * self.draft_seconds + 0.3 * share

    def catch_up_tokens(self, request: Request) -> int:
        return self.model.catch_up_tokens(request)

    def on_verified(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        source = self._source.pop(request.request_id, None)
        if source == "suffix":
            self.suffix.on_verified(request, num_drafted, num_accepted)
            self.model.on_verified(request, 0, 0)
            return
        if source == "model" and num_drafted:
            self.acceptance.observe(num_drafted, num_accepted)
        self.model.on_verified(request, num_drafted, num_accepted)

    def free(self, request_id: str) -> None:
        self._source.pop(request_id, None)
        self.suffix.free(request_id)
        self.model.free(request_id)
