"""Speculator: the one seam between the engine and speculation.

It owns the proposers (through the DraftSet: loading, unloading, status), their controllers (k per
request and step, health checks, cost model), the router and the draft KV pools. The engine drives
it with a handful of calls, in step order:

    assign(...)       a new request's proposer and domain guess
    propose(running)  plan each decoding request's k and draft; returns a SpecStep: the drafts as a
                      DraftBatch (the scheduler keeps what fits, verification reads it) and the plans
    verified(...)     one request's verification outcome under its plan (acceptance, rollback, fallback)
    end_step(...)     the step's costs; drafts that were not scheduled are rolled back
    free / preempted  a request left (or lost its KV)
    stats()           a SpeculationStats snapshot

The scheduler gets `pools` (draft KV pools by proposer id, a dict kept up to date in place) and
`reserve` (k slots kept free for drafts) when it is built. Nothing here changes what is emitted:
rejection sampling keeps the output the target's, so every choice made here only moves speed.
"""
from __future__ import annotations

import logging
from contextlib import ExitStack
from dataclasses import dataclass, field, replace

from specdec.config import EngineConfig
from specdec.core.kv_cache_manager import KVCacheManager
from specdec.core.outputs import DraftBatch, ModelRunnerOutput, RequestDrafts, SchedulerOutput
from specdec.metrics import DraftStatus, FreeDraftStats, PoolStats, ProposerStats, SpeculationStats
from specdec.models.loader import LoadedModel
from specdec.request import Request, RequestStatus, SpecOptions
from specdec.speculation import registry
from specdec.speculation.controller import SpecController
from specdec.speculation.costs import OutputLengths
from specdec.speculation.draft_set import DraftSet
from specdec.speculation.proposers.base import DraftProposal, Drafts, Proposer
from specdec.speculation.proposers.suffix_scopes import ScopedSuffixCache
from specdec.speculation.router import DraftRouter, guess_domain

log = logging.getLogger("specdec.speculation")
_PROMPT_TAIL = 8   # prompt tokens kept before an output in the shared caches


@dataclass
class Plan:
    """One request's speculation for one step, decided by propose and read back after verification."""
    proposer_id: str
    catch_up: int             # committed tokens the proposer had not processed
    num_emitted_before: int   # the request's output length when the step began
    k: int = 0                # the controller's k (a model draft's length)
    cap: int = 0              # the most drafts it may propose this step
    own: bool = False         # its proposer sizes its own drafts: charged for what it drafted
    proposal: DraftProposal | None = None   # the proposer's drafts, as verified (after `forced`)
    forced: list[int] = field(default_factory=list)   # grammar-forced drafts ahead of the proposer's
    proposed: int = 0         # drafts the proposer returned (its state holds them; the grammar may cut some)
    remaining: int = 0        # tokens the request may still emit (max_tokens, context)


@dataclass
class SpecStep:
    """What propose decided for one step: the drafts offered (a value the scheduler trims and
    verification reads) and each request's plan, which verified and end_step read back."""
    drafts: DraftBatch
    plans: dict[str, Plan]
    explored: bool = False    # a draft forward ran on a thread count being tried


def _drafts_of(plan: Plan) -> RequestDrafts:
    """Forced drafts, then the proposer's own (with their distributions, if any)."""
    prop = plan.proposal or DraftProposal([])
    return RequestDrafts(plan.forced + prop.token_ids, len(plan.forced), prop.probs, prop.free)


class Speculator:
    def __init__(self, config: EngineConfig, target: LoadedModel, max_model_len: int,
                 draft_loaded: LoadedModel | None = None, progress: bool = True) -> None:
        assert config.speculative is not None
        self.max_model_len = max_model_len
        self.drafts = DraftSet(config, target, max_model_len, draft_loaded, progress)
        spec = config.speculative
        # KV slots the scheduler keeps per request for drafts: the model's k, or a lookup's longer drafts
        self.reserve = max(spec.num_speculative_tokens, spec.suffix.max_tokens)
        self.max_free = spec.suffix.max_tokens
        self.num_proposer_errors = 0
        self.free_drafts: dict[str, FreeDraftStats] = {}
        self.lengths = OutputLengths()   # finished outputs' lengths by domain: what `remaining` expects

    # ---- what the scheduler and the engine read -------------------------------------------------
    @property
    def pools(self) -> dict[str, KVCacheManager]:
        return self.drafts.pools

    @property
    def default_id(self) -> str:
        return self.drafts.default_id

    @property
    def proposers(self) -> dict[str, Proposer]:
        return self.drafts.proposers

    @property
    def controllers(self) -> dict[str, SpecController]:
        return self.drafts.controllers

    @property
    def router(self) -> DraftRouter | None:
        return self.drafts.router

    def kind_of(self, proposer_id: str | None) -> str:
        return "none" if proposer_id is None else self.drafts.kind_of(proposer_id)

    def name_of(self, proposer_id: str) -> str:
        p = self.drafts.proposers.get(proposer_id)
        return p.name if p is not None else proposer_id

    # ---- requests ---------------------------------------------------------------------------
    def assign(self, opts: SpecOptions | None, prompt_ids: list[int], prompt: str | None
               ) -> tuple[str | None, str | None]:
        """(proposer id, domain guess) for a new request: what it asked for, else the router's
        choice, else the configured proposer. Raises ValueError for an unknown method."""
        if opts is not None and not opts.enabled:
            return None, None
        method = opts.method if opts is not None else None
        if method not in (None, "auto"):
            proposer_id = self.drafts.resolve(method)
            # a draft that failed to load is skipped (reported by draft_status), never an error
            return (None if proposer_id in self.drafts.errors else proposer_id), None
        # the domain guess also keys the controller's acceptance prior, so it is made with one draft too
        domain = guess_domain(prompt if prompt is not None else self.drafts.target.tokenizer.decode(prompt_ids))
        if self.drafts.router is None:
            return self.default_id, domain
        return self.drafts.router.choose(domain, self.drafts.candidates()), domain

    def admitted(self, proposer_id: str) -> None:
        """A request was queued for this proposer: keep it loaded (or start loading it)."""
        self.drafts.touch(proposer_id)
        if proposer_id not in self.drafts.proposers:
            self.drafts.load(proposer_id)  # first use: loads in the background, drafts once ready

    # ---- the step -----------------------------------------------------------------------------
    def propose(self, running: list[Request]) -> SpecStep:
        """Plan each decoding request's k and draft: the step's drafts as a value."""
        plans = self._plan(running)
        explored = False
        by_proposer: dict[str, list[Request]] = {}
        with ExitStack() as scopes:   # grammar lookaheads over forced drafts, rolled back on exit
            self._force(running, plans, scopes)
            for req in running:
                plan = plans.get(req.request_id)
                if plan is not None and plan.cap:
                    by_proposer.setdefault(req.spec_method, []).append(req)
            for proposer_id, reqs in by_proposer.items():
                explored |= self._propose_with(proposer_id, reqs, plans)
        for req in running:   # the router's cost of a request: what was actually drafted
            plan = plans.get(req.request_id)
            if plan is not None and plan.own:
                prop = plan.proposal
                drafted = len(prop.token_ids) if prop is not None else 0
                catch_up = plan.catch_up if prop is not None and not prop.free else 0
                self.drafts.controllers[plan.proposer_id].charge(req.request_id, drafted, len(running), catch_up)
        drafts = {rid: _drafts_of(plan) for rid, plan in plans.items()}
        return SpecStep(DraftBatch({rid: d for rid, d in drafts.items() if d.token_ids}), plans, explored)

    def _plan(self, running: list[Request]) -> dict[str, Plan]:
        plans: dict[str, Plan] = {}
        batch = len(running)
        for req in running:
            pid = req.spec_method
            if pid not in self.drafts.proposers or req.num_computed_tokens != req.num_tokens - 1:
                continue  # plain decoding, its draft still loading, or still prefilling
            controller = self.drafts.controllers[pid]
            remaining = min(req.params.max_tokens - len(req.output_token_ids), self.max_model_len - req.num_tokens)
            own = registry.get(self.drafts.kinds[pid]).sizes_own_drafts
            k = catch_up = cap = 0
            if remaining > 1:
                catch_up = self.drafts.proposers[pid].catch_up_tokens(req)
                expected = remaining if req.params.ignore_eos else self.lengths.expected_remaining(
                    req.spec_domain, len(req.output_token_ids), remaining)
                k = controller.next_k(req.request_id, len(req.output_token_ids), batch, expected, catch_up,
                                      req.spec_domain)
                if req.spec_max_k is not None:
                    k = min(k, req.spec_max_k)
                k = min(k, remaining - 1)
                cap = k
                if own and not controller.is_disabled(req.request_id):
                    limit = req.spec_max_k if req.spec_max_k is not None else self.max_free
                    cap = max(k, min(self.max_free, limit, remaining - 1))
            if not own:
                controller.charge(req.request_id, k, batch, catch_up)
            plans[req.request_id] = Plan(pid, catch_up, len(req.output_token_ids), k, cap, own,
                                         remaining=remaining)
        return plans

    def _force(self, running: list[Request], plans: dict[str, Plan], scopes: ExitStack) -> None:
        """Grammar-forced drafts (jump-forward, verified like any draft): where a request's grammar
        allows one continuation, those tokens lead its drafts and the proposer drafts after them,
        inside a lookahead over them that `scopes` closes."""
        for req in running:
            plan = plans.get(req.request_id)
            if plan is None or req.grammar is None:
                continue
            room = min(self.reserve, plan.remaining - 1)
            plan.forced = req.grammar.forced(room)
            if plan.forced:
                scopes.enter_context(req.grammar.lookahead()).advance(plan.forced)
                plan.cap = min(plan.cap, room - len(plan.forced))
                plan.k = min(plan.k, plan.cap)

    def _propose_with(self, proposer_id: str, reqs: list[Request], plans: dict[str, Plan]) -> bool:
        """Ask one proposer for its requests' drafts; True when a draft forward ran on a thread count
        being tried (the step's time is then no measure of its usual cost)."""
        proposer, controller = self.drafts.proposers[proposer_id], self.drafts.controllers[proposer_id]
        asked = [plans[r.request_id].cap for r in reqs]
        # a request with forced drafts is seen as if they were already its output: drafts continue after them
        views = [replace(r, output_token_ids=r.output_token_ids + plans[r.request_id].forced)
                 if plans[r.request_id].forced else r for r in reqs]
        try:
            drafts = proposer.propose(views, asked, [plans[r.request_id].k for r in reqs])
        except Exception:  # a proposer failure costs speed, never a request
            log.exception("proposer %s failed; speculation disabled for %d request(s)", proposer.name, len(reqs))
            self.num_proposer_errors += 1
            for r in reqs:
                controller.disable(r.request_id)
                proposer.free(r.request_id)
            drafts = Drafts([DraftProposal([]) for _ in reqs])
        model_free = not registry.get(self.drafts.kinds[proposer_id]).needs_model
        explored = self._record_draft_costs(controller, drafts, len(reqs), max(asked), model_free)
        for req, k, prop in zip(reqs, asked, drafts.proposals):
            plan = plans[req.request_id]
            tokens = prop.token_ids[:k]
            plan.proposed = len(tokens)
            if req.grammar is not None:  # drafts the grammar forbids would be rejected: not verified at all
                tokens = tokens[: req.grammar.valid_prefix(tokens)]
            probs = None if prop.probs is None else prop.probs[: len(tokens)]
            plan.proposal = DraftProposal(tokens, probs, prop.free)
            req.spec.draft_seconds += drafts.seconds
        return explored

    def _record_draft_costs(self, controller: SpecController, drafts: Drafts, num_requests: int, max_k: int,
                            model_free: bool) -> bool:
        for rows, seconds in drafts.forward_costs:
            if seconds is not None:
                controller.record_draft(rows, seconds)
        if model_free and max_k:  # a model-free proposer: its wall time per draft step
            controller.record_draft(num_requests, drafts.seconds / max_k)
        return any(s is None for _, s in drafts.forward_costs)

    def verified(self, req: Request, planned: Plan | None, num_drafted: int, num_accepted: int, num_emitted: int,
                 decoding: bool, finished: bool) -> None:
        """The target verified `num_drafted` scheduled drafts of `req` (planned this step as `planned`),
        kept `num_accepted` and emitted `num_emitted` tokens (the target's K/V of rejected drafts is
        already rolled back)."""
        pid = req.spec_method
        if pid is None or pid not in self.drafts.controllers:
            return
        controller, fell_back = self.drafts.controllers[pid], False
        free = planned is not None and planned.proposal is not None and planned.proposal.free
        proposed = planned.proposed if planned is not None else num_drafted
        if num_drafted:
            req.spec.record(num_drafted, num_accepted)   # every draft, forced ones included
        in_step = True   # the proposer's state still follows the output
        if planned is not None and planned.forced:
            num_drafted, num_accepted, in_step = self._forced_verified(req, planned, num_drafted, num_accepted)
        if num_drafted and free:  # a lookup's drafts: not the draft model's acceptance
            st = self.free_drafts.setdefault(pid, FreeDraftStats())
            st.drafted_tokens, st.accepted_tokens, st.rounds = (st.drafted_tokens + num_drafted,
                                                                st.accepted_tokens + num_accepted, st.rounds + 1)
            req.spec.free_drafted_tokens += num_drafted
            req.spec.free_accepted_tokens += num_accepted
        elif num_drafted:
            fell_back = controller.observe(req.request_id, num_drafted, num_accepted)
        if decoding:
            controller.credit(req.request_id, num_emitted)
        if finished:
            return
        if in_step or not proposed:
            self.drafts.proposers[pid].on_verified(req, proposed, num_accepted)
        else:  # a forced draft was rejected after the proposer had drafted past it: it starts over
            self.drafts.proposers[pid].free(req.request_id)
        if fell_back and self.drafts.router is not None:
            self.drafts.move(req, "acceptance collapsed")

    def _forced_verified(self, req: Request, planned: Plan, num_drafted: int, num_accepted: int
                         ) -> tuple[int, int, bool]:
        """Count the forced drafts apart; returns the proposer's own drafts (drafted, accepted) and
        whether every forced draft was kept (a rejected one, rare, leaves the proposer's drafts
        unverified: (0, 0, False))."""
        num_forced = min(len(planned.forced), num_drafted)
        kept = min(num_accepted, num_forced)
        req.spec.forced_drafted_tokens += num_forced
        req.spec.forced_accepted_tokens += kept
        st = self.free_drafts.setdefault("grammar", FreeDraftStats())
        st.drafted_tokens, st.accepted_tokens, st.rounds = (st.drafted_tokens + num_forced,
                                                            st.accepted_tokens + kept, st.rounds + 1)
        if kept < num_forced:
            return 0, 0, False
        return num_drafted - num_forced, num_accepted - num_forced, True

    def end_step(self, step: SpecStep, sched: SchedulerOutput, requests: dict[str, Request],
                 out: ModelRunnerOutput | None, seconds: float) -> None:
        """Record the step's costs, and roll back drafts the scheduler left out of the step (`out`:
        None when nothing was scheduled)."""
        if out is not None and not out.exploring:  # one table, shared by every controller
            self.drafts.verify_costs.record(sched.num_batched_tokens, out.forward_seconds)
        if out is not None:
            self._record_step(step.plans, sched, requests, seconds, out.exploring or step.explored)
        scheduled = {c.request_id for c in sched.chunks}
        for rid, planned in step.plans.items():
            req = requests.get(rid)
            if rid not in scheduled and req is not None and planned.proposed:
                proposer = self.drafts.proposers.get(planned.proposer_id)
                if proposer is not None and planned.forced:  # it drafted past forced tokens never verified
                    proposer.free(rid)
                elif proposer is not None:
                    proposer.on_verified(req, planned.proposed, 0)

    def _record_step(self, planned: dict[str, Plan], sched: SchedulerOutput, requests: dict[str, Request],
                     seconds: float, explored: bool) -> None:
        """A pure decode step whose requests share one proposer and one k, none of them catching up on
        more than a step's tokens (the last draft and the bonus token of a fully accepted step), no
        forward on a thread count being tried: its wall time calibrates that controller's predicted
        step cost."""
        shape = {(planned[c.request_id].proposer_id if c.request_id in planned else "", c.num_drafts)
                 for c in sched.chunks}
        caught_up = all(c.num_drafts == 0 or planned[c.request_id].catch_up <= 2 for c in sched.chunks
                        if c.request_id in planned)
        # a lookup's drafts cost no draft forward: such steps say nothing of the model's step costs
        free = any(p.proposal is not None and p.proposal.free and p.proposal.token_ids for p in planned.values())
        if len(shape) != 1 or not caught_up or explored or free:
            return
        (pid, k), = shape
        if pid not in self.drafts.controllers:
            return
        controller, batch = self.drafts.controllers[pid], len(sched.chunks)
        controller.record_step(k, batch, seconds)
        for c in sched.chunks:
            req = requests.get(c.request_id)
            if req is not None and c.request_id in planned:
                tokens = len(req.output_token_ids) - planned[c.request_id].num_emitted_before
                controller.record_request_step(c.request_id, k, batch, seconds, tokens)

    def preempted(self, request_id: str) -> None:
        """The request lost its KV (it will be recomputed): proposers drop their state for it."""
        for proposer in self.drafts.proposers.values():
            proposer.free(request_id)

    def free(self, req: Request) -> None:
        """The request finished or was aborted: its output joins its scope's shared caches (after the
        prompt's last few tokens, the chat template's turn header among them: what the next
        request's output will follow)."""
        start = max(0, req.num_prompt_tokens - _PROMPT_TAIL)
        for cache in self.drafts.shared.values():
            cache.add(req.request_id, req.all_token_ids[start:], req.params.cache_scope)
        if not req.params.ignore_eos and req.output_token_ids and req.status != RequestStatus.FINISHED_ABORTED:
            self.lengths.record(req.spec_domain, len(req.output_token_ids))
        if req.spec_method is not None:
            self.drafts.observe_gain(req)
            self.drafts.touch(req.spec_method)
        for proposer in self.drafts.proposers.values():
            proposer.free(req.request_id)
        for controller in self.drafts.controllers.values():
            controller.free(req.request_id)

    # ---- drafts' lifecycle --------------------------------------------------------------------
    def poll(self, requests: list[Request]) -> None:
        """Install drafts that finished loading, move requests off drafts that failed to, unload idle
        ones."""
        self.drafts.update(requests)

    def load(self, model: str) -> str:
        return self.drafts.add(model)

    def unload(self, model: str, requests: list[Request]) -> str:
        return self.drafts.unload(model, requests)

    def suffix_cache(self) -> ScopedSuffixCache:
        """The engine's suffix cache (every speculating engine has one: suffix lookup is model-free)."""
        cache = self.drafts.shared.get(ScopedSuffixCache.name)
        assert isinstance(cache, ScopedSuffixCache), "the suffix proposer builds it"
        return cache

    def clear_caches(self) -> None:
        """Forget every finished request's output (a benchmark's next session starts cold)."""
        for cache in self.drafts.shared.values():
            cache.clear()

    def wait_loaded(self, timeout: float | None = None) -> None:
        self.drafts.wait_loaded(timeout)

    def status(self) -> list[DraftStatus]:
        return self.drafts.status()

    def _proposer_stats(self, proposer_id: str) -> ProposerStats:
        c = self.drafts.controllers[proposer_id]
        verify = [c.verify_costs.estimate(rows) for rows in range(1, self.reserve + 2)]
        return ProposerStats(proposer_id, self.name_of(proposer_id), self.drafts.kinds[proposer_id], c.num_fallbacks,
                             c.num_reprobes, c.num_resumes, c.draft_costs.estimate(1), verify)

    def stats(self) -> SpeculationStats:
        d = self.drafts
        proposers = [self._proposer_stats(i) for i in d.proposers]
        pools = {i: PoolStats(kv.num_blocks, kv.num_free_blocks()) for i, kv in d.pools.items()}
        router = d.router.snapshot() if d.router is not None else None
        return SpeculationStats(d.default_id, proposers, d.status(), pools, router,
                                d.router.num_switches if d.router is not None else 0,
                                d.num_loads, d.num_unloads, d.num_load_failures, self.num_proposer_errors,
                                [c.stats() for c in d.shared.values()],
                                {(self.name_of(i) if i != "grammar" else i): FreeDraftStats(**vars(s))
                                 for i, s in self.free_drafts.items()})
