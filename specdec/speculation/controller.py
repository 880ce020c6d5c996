"""SpecController: how many tokens each request drafts next, and whether it should speculate at all.

Policies (SpeculativeConfig.policy; the knobs below are SpeculativeConfig.controller's):
  * fixed:      always k = num_speculative_tokens.
  * heuristic:  over the last 10 drafting steps, acceptance > 0.8 -> k + 1, < 0.5 -> k - 1 (min 1).
  * cost_model: choose k maximizing expected tokens per second (Leviathan et al. 2023, "Fast Inference
    from Transformers via Speculative Decoding", section 3.4),
        S(k) = E[tokens | k] / (k * t_draft + t_verify(k + 1)),
        E[tokens | k] = 1 + sum_{i<=k} prod_{j<=i} alpha_j,
    with alpha_j the request's acceptance at draft position j given position j was reached,
    t_draft the measured cost of one draft step and t_verify(n) the measured cost of a target forward
    scoring n tokens per request at the current batch size. k = 0 (plain decoding) unless some k beats
    S(0) by `min_gain` (a prediction within the noise of the measured costs is not worth a draft's
    switching costs). The arithmetic is policy.py's (expected_tokens, best_k), shared with the
    proposers that price their own drafts.
    alpha_j is a Beta-style estimate over discounted counts (policy.DiscountedRate, decaying by
    `acceptance_decay`, with m = `prior_strength`): (hits_j + m * prior_j) / (trials_j + m),
    the prior being this draft's acceptance at position j on the request's domain (the router's guess
    of the prompt's kind: code acceptance says little about prose), else over all domains, else (before
    position j was ever reached) the request's own estimate at j - 1, so a new request starts from what
    this draft achieved so far and one lucky or unlucky step moves k by little.
    A draft that still has to catch up on many tokens (a draft model meeting a long prompt) first pays
    that prefill: the controller speculates only when the expected saving over the tokens the request
    may still generate exceeds that one-time cost. While plain decoding looks better it still probes
    now and then (acceptance changes with the text), but only while a probe could pay for itself: the
    best case, every draft accepted, must save more over the remaining tokens than the probe's
    catch-up prefill costs; and where the remaining tokens are known, a probe pays a catch-up of more
    than k + 1 tokens only while the draft has never been verified on the request's domain (the
    exploration a new domain needs, which comes at the request's first plain step rather than after
    an interval: the catch-up only grows while it waits; after that the one-time cost is weighed
    against the expected saving above: paid on a best-case bet it costs short requests more than it
    saves). Where even that cannot pay (a draft model nearly as slow as the target) the request stays
    plain and costs what plain decoding costs. Each probe after which the request's
    estimated acceptance is below the threshold doubles the wait before the next (up to 16 times
    `reprobe_interval`): one unlucky probe of a good draft barely moves the estimate.
    The forward costs miss what else a step costs (sampling and rejection over the vocabulary, the
    draft's extra row after an accepted step, scheduling), and that share differs between plain and
    speculative steps; so each predicted step cost is scaled by the measured ratio of whole-step wall
    time to predicted forward time for its k (`record_step`), and a k that loses in practice stops
    being chosen even where the forward costs alone say it wins. A last check needs no model at all:
    when a request's last `_REALIZED_WINDOW` speculative steps cost more wall time per emitted token
    than a plain step is predicted to cost, by more than `min_gain` (`record_request_step`), it decodes
    plainly for a probe interval, doubled each time this repeats, whatever the prediction says.
    With `deterministic=True` the costs are static (draft_cost_ratio, verify_cost_slope,
    prefill_cost_ratio), so k depends on acceptance counts alone and a seed fixes the text, not only
    its distribution.

Health check (every policy): when a request's acceptance over its last `health_window` drafting steps
(more where they hold fewer than 2 * `health_window` drafts) falls below `acceptance_threshold`, it
falls back to plain decoding, logs a warning and counts an alert; every `reprobe_interval` plain steps
(doubled after each failed probe, up to 16 times) it re-probes with `reprobe_k` drafts and resumes when
the probe's acceptance clears the threshold.
Under exact verification none of this changes the output, only the speed; the same holds for the
long-output guard (plain_interval_after / _steps).
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from specdec.config import SpeculativeConfig
from specdec.quant.layers import ROW_ALIGN
from specdec.speculation.costs import CostTable
from specdec.speculation.policy import (ENGINE_ACCEPTANCE, PRIOR_ACCEPTANCE, DiscountedRate, PositionAcceptance,
                                        Tuning, best_k)

log = logging.getLogger("specdec.speculation")
# speculative steps whose wall time per token must beat a plain step's: acceptance comes in runs (a
# comment inside code, a list in prose), so a few steps can lose by chance in a request that wins
_REALIZED_WINDOW = 12
_HEURISTIC_WINDOW = 10    # drafting steps the heuristic policy's rate is taken over
EXPLORE_TRIALS = 2.0      # a draft position's verifications in its domain before k is chosen on its estimate


@dataclass
class RequestSpecState:
    k: int
    acceptance: PositionAcceptance   # this request's own discounted counts per draft position
    window: deque = field(default_factory=deque)  # (drafted, accepted) per drafting step (_state bounds it)
    fallback: bool = False
    plain_steps: int = 0        # plain steps since the fallback / last probe
    probing: bool = False       # the health check's re-probe is out
    cost_probe: bool = False    # the cost model's probe is out
    failed_probes: int = 0      # probes in a row that failed, and wall-time losses (record_request_step)
    hold: int = 0               # plain steps left after speculation lost in practice
    # the last speculative steps: (this request's share of the wall seconds, tokens it emitted,
    # its share of a plain step's predicted seconds)
    realized: deque = field(default_factory=lambda: deque(maxlen=_REALIZED_WINDOW))
    disabled: bool = False      # the proposer failed for this request
    guard_countdown: int = 0    # long-output guard: plain steps left before the next round
    domain: str | None = None   # the guess of the prompt's domain (router.guess_domain): whose counts are its prior
    tokens: int = 0             # decode tokens produced while this proposer served the request ...
    cost: float = 0.0           # ... and their cost (this request's share of each step; see charge())


class SpecController:
    def __init__(self, config: SpeculativeConfig, draft_cost_ratio: float | None = None,
                 row_align: int = ROW_ALIGN, draft_row_align: int | None = None,
                 verify_costs: CostTable | None = None) -> None:
        """`draft_cost_ratio`: this proposer's static t_draft / t_target (n-gram lookup: ~0),
        overriding the config's, which describes a draft model. `row_align`: the target runner's row
        padding (1 where every extra row costs); `draft_row_align`: the draft's (default the same).
        `verify_costs`: the target's forward costs, a table shared with the engine's other
        controllers (default: its own)."""
        self.config = config
        cfg = config.controller
        self.draft_cost_ratio = cfg.draft_cost_ratio if draft_cost_ratio is None else draft_cost_ratio
        self.max_k = config.num_speculative_tokens
        self._request_tuning = Tuning(cfg.acceptance_decay, cfg.prior_strength)
        self.states: dict[str, RequestSpecState] = {}
        # rows in the draft forward -> seconds per step
        self.draft_costs = CostTable(row_align=row_align if draft_row_align is None else draft_row_align)
        # rows in the target forward -> seconds
        self.verify_costs = verify_costs if verify_costs is not None else CostTable(row_align=row_align)
        # k -> EMA of (whole decode step's wall seconds) / (its predicted forward seconds)
        self.step_ratio: dict[int, float] = {}
        self._last_spec_ratio: float | None = None
        # domain -> acceptance per draft position over every request of that domain: new requests' prior
        self.domain_counts: dict[str | None, PositionAcceptance] = {}
        self.num_fallbacks = 0
        self.num_reprobes = 0
        self.num_resumes = 0

    def _state(self, request_id: str, domain: str | None = None) -> RequestSpecState:
        st = self.states.get(request_id)
        if st is None:
            k = self.max_k if self.config.policy != "heuristic" else max(1, self.max_k // 2)
            # the health check may need 2 * health_window steps of one draft each
            window = deque(maxlen=max(_HEURISTIC_WINDOW, 2 * self.config.controller.health_window))
            st = self.states[request_id] = RequestSpecState(
                k, PositionAcceptance(self.max_k, self._request_tuning), window, domain=domain)
        return st

    def _counts(self, domain: str | None) -> PositionAcceptance:
        counts = self.domain_counts.get(domain)
        if counts is None:
            counts = self.domain_counts[domain] = PositionAcceptance(self.max_k, ENGINE_ACCEPTANCE)
        return counts

    def acceptance(self, request_id: str, optimistic: bool = False) -> list[float]:
        """Estimated acceptance at each draft position, given the position is reached. `optimistic`: a
        position its domain has verified fewer than EXPLORE_TRIALS times counts at its upper bound,
        at most the position before's (choosing k): drafts stop before a position whose few
        verifications went badly (one rejection at a request's first step), so it would never be
        verified again, and k would stay below it for good."""
        st = self._state(request_id)
        domain = self._counts(st.domain).positions
        out: list[float] = []
        for j, own in enumerate(st.acceptance.positions):
            everywhere = DiscountedRate.pooled([c.positions[j] for c in self.domain_counts.values()],
                                               ENGINE_ACCEPTANCE)
            if domain[j].trials >= 1.0:
                prior = domain[j].estimate(PRIOR_ACCEPTANCE)
            elif everywhere.trials >= 1.0:
                prior = everywhere.estimate(PRIOR_ACCEPTANCE)
            else:
                prior = out[-1] if out else PRIOR_ACCEPTANCE
            rate = own.estimate(prior)
            if optimistic and 1.0 <= domain[j].trials < EXPLORE_TRIALS:  # no higher than the position before
                rate = max(rate, min(domain[j].upper_bound(PRIOR_ACCEPTANCE), out[-1] if out else 1.0))
            out.append(rate)
        return out

    # ---- decisions ----------------------------------------------------------------------------
    def next_k(self, request_id: str, num_generated: int, batch_size: int, remaining: int | None = None,
               catch_up: int = 0, domain: str | None = None) -> int:
        """k for the request's next step. `remaining`: tokens it may still generate (None: unknown);
        `catch_up`: committed tokens the proposer has not processed yet (its one-time prefill);
        `domain`: the prompt's domain guess (read on the request's first call)."""
        st = self._state(request_id, domain)
        cfg, policy = self.config.controller, self.config.policy
        if st.disabled or self.max_k == 0:
            return 0
        if st.fallback:
            st.plain_steps += 1
            if st.plain_steps >= self._probe_interval(st) and (
                    policy != "cost_model" or self._probe_can_pay(batch_size, remaining, catch_up)):
                st.plain_steps, st.probing = 0, True
                self.num_reprobes += 1
                return min(cfg.reprobe_k, self.max_k)
            return 0
        if cfg.plain_interval_after is not None and num_generated >= cfg.plain_interval_after:
            if st.guard_countdown > 0:
                st.guard_countdown -= 1
                return 0
            st.guard_countdown = cfg.plain_interval_steps
        if policy != "cost_model":
            return st.k
        if st.hold > 0:  # speculation lost in practice: plain for a while, whatever the prediction
            st.hold -= 1
            return 0
        k, seconds_per_token = self._best_k(request_id, batch_size)
        if k and remaining is not None and catch_up > self.max_k + 1:
            saving = remaining * (seconds_per_token[0] - seconds_per_token[k])
            if self._catch_up_cost(catch_up, batch_size) > saving:
                k = 0  # the draft's prefill would cost more than speculation can win back
        if k == 0:  # keep learning: probe now and then, while a probe could still pay for itself
            st.plain_steps += 1
            unexplored = self._counts(st.domain).positions[0].trials < 1.0
            # on a domain never verified the first probe comes at once: a draft model's catch-up only
            # grows with each plain step, and nothing better than the prior can be learnt by waiting
            if st.plain_steps >= (1 if unexplored and not st.failed_probes else self._probe_interval(st)):
                st.plain_steps = 0
                # a large catch-up is paid only while this domain's acceptance could still make it pay
                explore = (remaining is None or catch_up <= self.max_k + 1 or unexplored
                           or self._probe_can_pay(batch_size, remaining, catch_up, self._acceptance_bounds(st)))
                if explore and self._probe_can_pay(batch_size, remaining, catch_up):
                    self.num_reprobes += 1
                    st.cost_probe = True
                    return min(cfg.reprobe_k, self.max_k)
        return k

    def _probe_interval(self, st: RequestSpecState) -> int:
        """Plain steps before the next probe: `reprobe_interval`, doubled after each probe in a row that
        failed (up to 16 times): a probe verifies k + 1 rows, which on a CPU costs nearly k + 1 steps."""
        return self.config.controller.reprobe_interval << min(st.failed_probes, 4)

    def _probe_can_pay(self, batch_size: int, remaining: int | None, catch_up: int,
                       acceptance: list[float] | None = None) -> bool:
        """Whether drafting at `acceptance` per position (None: the best case, every draft accepted from
        now on) clears `min_gain` (else the costs alone keep k at 0, whatever a probe finds) and saves
        more over the remaining tokens than the draft's catch-up prefill costs (the draft must process
        every token it skipped)."""
        costs = [self._step_cost(k, batch_size) for k in range(self.max_k + 1)]
        k, per_token = best_k(acceptance or [1.0] * self.max_k, costs, self.config.controller.min_gain)
        if k == 0:
            return False
        if remaining is None:
            return True
        plain, best = per_token[0], per_token[k]
        catch_up_cost = self._catch_up_cost(catch_up, batch_size) if catch_up > 1 else 0.0
        return (plain - best) * remaining > catch_up_cost

    def _acceptance_bounds(self, st: RequestSpecState) -> list[float]:
        """The acceptance this request's domain could still have at each position: its estimate plus two
        standard deviations (one failed probe leaves much room, twenty leave none)."""
        return [rate.upper_bound(PRIOR_ACCEPTANCE) for rate in self._counts(st.domain).positions]

    def _best_k(self, request_id: str, batch_size: int) -> tuple[int, list[float]]:
        """The k with the highest expected tokens per second, and seconds per token for every k."""
        costs = [self._step_cost(k, batch_size) for k in range(self.max_k + 1)]
        return best_k(self.acceptance(request_id, optimistic=True), costs, self.config.controller.min_gain)

    def _unit(self, batch_size: int) -> float | None:
        """Seconds of one plain target step at this batch size, once measured."""
        return None if self.config.controller.deterministic else self.verify_costs.estimate(batch_size)

    def _step_cost(self, k: int, batch_size: int) -> float:
        """Predicted seconds of a decode step with k drafts: its forwards, scaled by what whole steps
        with this k measured against that prediction (an unmeasured k: the last speculative step's
        ratio, else the plain steps')."""
        forwards = self._forward_cost(k, batch_size)
        if self._unit(batch_size) is None:
            return forwards
        ratio = self.step_ratio.get(k)
        if ratio is None:
            ratio = self._last_spec_ratio if k and self._last_spec_ratio is not None else self.step_ratio.get(0, 1.0)
        return forwards * ratio

    def _forward_cost(self, k: int, batch_size: int) -> float:
        cfg = self.config.controller
        unit = self._unit(batch_size)
        if unit is None:  # static model, in units of one target step
            return k * self.draft_cost_ratio + 1.0 + cfg.verify_cost_slope * k
        verify = self.verify_costs.estimate(batch_size * (k + 1))
        if k == 0:
            return verify
        draft = self.draft_costs.estimate(batch_size)
        return k * (draft if draft is not None else unit * self.draft_cost_ratio) + verify

    def _catch_up_cost(self, tokens: int, batch_size: int) -> float:
        cfg = self.config.controller
        unit = self._unit(batch_size)
        if unit is None:
            return tokens * cfg.prefill_cost_ratio * self.draft_cost_ratio
        draft = self.draft_costs.prefill(tokens)
        if draft is not None:
            return draft
        target = self.verify_costs.prefill(tokens)
        return (target if target is not None else tokens * cfg.prefill_cost_ratio * unit) * self.draft_cost_ratio

    # ---- the request's gain (what the router learns from) ----------------------------------------
    def charge(self, request_id: str, k: int, batch_size: int, catch_up: int = 0) -> None:
        """Account this request's share of a decode step with k drafts (plus the draft's catch-up
        prefill when it drafts): measured costs, or static ones in deterministic mode, so the
        router's tokens-per-cost is reproducible there."""
        st = self._state(request_id)
        cost = self._step_cost(k, batch_size) / batch_size
        if k and catch_up > 1:
            cost += self._catch_up_cost(catch_up, 1)
        st.cost += cost

    def credit(self, request_id: str, num_tokens: int) -> None:
        self._state(request_id).tokens += num_tokens

    def gain(self, request_id: str) -> tuple[int, float]:
        """(decode tokens, their cost) since this proposer took the request."""
        st = self.states.get(request_id)
        return (st.tokens, st.cost) if st else (0, 0.0)

    # ---- observations -------------------------------------------------------------------------
    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> bool:
        """One verification of num_drafted drafts, of which the first num_accepted were kept.
        Returns True when this observation made the health check fall back to plain decoding."""
        if num_drafted == 0:
            return False
        st = self._state(request_id)
        st.acceptance.observe(num_drafted, num_accepted)
        self._counts(st.domain).observe(num_drafted, num_accepted)
        st.window.append((num_drafted, num_accepted))
        if self.config.policy == "heuristic" and len(st.window) >= _HEURISTIC_WINDOW:
            rate = _rate(list(st.window)[-_HEURISTIC_WINDOW:])
            if rate > 0.8:
                st.k = min(st.k + 1, self.max_k)
            elif rate < 0.5:
                st.k = max(st.k - 1, 1)
        if st.cost_probe:  # judged on the request's acceptance estimate, not one probe's luck
            st.cost_probe = False
            failed = self.acceptance(request_id)[0] < self.config.controller.acceptance_threshold
            st.failed_probes = st.failed_probes + 1 if failed else 0
        was_fallback = st.fallback
        self._health(request_id, st, num_drafted, num_accepted)
        return st.fallback and not was_fallback

    def _health(self, request_id: str, st: RequestSpecState, drafted: int, accepted: int) -> None:
        cfg = self.config.controller
        if st.probing:
            st.probing = False
            st.failed_probes += 1
            if accepted / drafted >= cfg.acceptance_threshold:
                st.failed_probes = 0
                st.fallback = False
                st.window.clear()
                st.window.append((drafted, accepted))
                self.num_resumes += 1
                log.info("request %s: acceptance recovered (%d/%d), speculation resumes",
                         request_id, accepted, drafted)
            return
        recent = _health_window(st.window, cfg.health_window)
        if not st.fallback and recent and _rate(recent) < cfg.acceptance_threshold:
            st.fallback, st.plain_steps = True, 0
            self.num_fallbacks += 1
            log.warning("request %s: acceptance %.2f below %.2f over %d steps; falling back to plain decoding",
                        request_id, _rate(recent), cfg.acceptance_threshold, len(recent))

    def record_draft(self, rows: int, seconds: float) -> None:
        """One draft forward over `rows` tokens."""
        self.draft_costs.record(rows, seconds)

    def record_step(self, k: int, batch_size: int, seconds: float) -> None:
        """A whole decode step (draft, verification, sampling, bookkeeping) in which each of the
        batch's requests ran k drafts with this proposer and none paid a catch-up prefill."""
        if self._unit(batch_size) is None:
            return
        predicted = self._forward_cost(k, batch_size)
        if predicted <= 0:
            return
        ratio, old = seconds / predicted, self.step_ratio.get(k)
        alpha = self.config.controller.ema_alpha
        self.step_ratio[k] = ratio if old is None else (1 - alpha) * old + alpha * ratio
        if k:
            self._last_spec_ratio = self.step_ratio[k]

    def record_request_step(self, request_id: str, k: int, batch_size: int, seconds: float, tokens: int) -> None:
        """A whole decode step (as in `record_step`) in which this request drafted k tokens and emitted
        `tokens`. Over its last few such steps, the wall time per emitted token must beat what a
        plain step is predicted to cost, give or take `min_gain` (noise, not a loss); if not, the request
        holds plain decoding for a probe interval and the interval doubles (cost_model only;
        deterministic mode ignores wall times)."""
        if (k == 0 or self.config.policy != "cost_model" or self.config.controller.deterministic
                or self._unit(batch_size) is None):
            return
        st = self._state(request_id)
        st.realized.append((seconds / batch_size, tokens, self._step_cost(0, batch_size) / batch_size))
        if len(st.realized) < st.realized.maxlen:
            return
        spent = sum(s for s, _, _ in st.realized)
        emitted = sum(t for _, t, _ in st.realized)
        plain = sum(p for _, _, p in st.realized) / len(st.realized)
        if spent > plain * emitted * (1 + self.config.controller.min_gain):
            st.hold = self._probe_interval(st)
            st.failed_probes += 1
            st.realized.clear()
            log.info("request %s: speculation cost %.3f s a token against %.3f s plain; plain for %d steps",
                     request_id, spent / emitted, plain, st.hold)

    def disable(self, request_id: str) -> None:
        self._state(request_id).disabled = True

    def is_disabled(self, request_id: str) -> bool:
        st = self.states.get(request_id)
        return st is not None and st.disabled

    def free(self, request_id: str) -> None:
        self.states.pop(request_id, None)


def _health_window(window: deque, steps: int) -> list[tuple[int, int]]:
    """The newest drafting steps the health check judges: at least `steps` of them holding at least
    2 * `steps` drafts (at k = 1 a window of 8 drafts trips on chance: 3 of 8 at a true 0.65 happens
    one window in ten), or nothing while the history is shorter."""
    out: list[tuple[int, int]] = []
    drafted = 0
    for step in reversed(window):
        out.append(step)
        drafted += step[0]
        if len(out) >= steps and drafted >= 2 * steps:
            return out[::-1]
    return []


def _rate(window) -> float:
    drafted = sum(d for d, _ in window)
    return sum(a for _, a in window) / drafted if drafted else 1.0
