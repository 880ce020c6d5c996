"""The shared policy arithmetic (speculation/policy.py) and the decisions built on it, on designed
inputs whose expected values are worked out by hand: the controller's k, the router's choice, and
the configured draft cost the hybrid prices model drafts with before measuring one."""
from __future__ import annotations

import math

import pytest

from specdec.config import ControllerConfig, SpeculativeConfig
from specdec.speculation.controller import SpecController
from specdec.speculation.costs import CostTable
from specdec.speculation.policy import (PRIOR_ACCEPTANCE, DiscountedRate, PositionAcceptance, Tuning, best_k,
                                        expected_tokens, predicted_speedup)
from specdec.speculation.proposers.hybrid import HybridProposer
from specdec.speculation.router import DraftRouter

# ---- the arithmetic --------------------------------------------------------------------------


def test_expected_tokens_per_step():
    assert expected_tokens([]) == 1.0                          # plain decoding: one token
    assert expected_tokens([1.0, 1.0, 1.0]) == 4.0             # every draft accepted, plus the bonus token
    assert expected_tokens([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens([0.8, 0.5, 0.0]) == pytest.approx(1 + 0.8 + 0.4)
    # 1.75 tokens for 2 drafts at 0.1 of a step each plus one verification
    assert predicted_speedup([0.5, 0.5, 0.9], 2, 0.1, 1.0) == pytest.approx(1.75 / 1.2)


def test_best_k_takes_the_cheapest_tokens():
    # acceptance high, each draft adds a tenth of a step: per token 1, 1.1/1.9, 1.2/2.71, 1.3/3.439, 1.4/4.0951
    k, per_token = best_k([0.9] * 4, [1.0, 1.1, 1.2, 1.3, 1.4], 0.03)
    assert k == 4
    assert per_token == pytest.approx([1.0, 1.1 / 1.9, 1.2 / 2.71, 1.3 / 3.439, 1.4 / 4.0951])
    # acceptance low: one draft gives 1.1 tokens for 1.5 steps
    assert best_k([0.1] * 4, [1.0, 1.5, 2.0, 2.5, 3.0], 0.03)[0] == 0
    # a third draft's rows cost more than it returns: k = 2 (0.7 / 1.96 = 0.357) beats k = 1 (0.6 / 1.6 =
    # 0.375) and k = 3 (1.2 / 2.176 = 0.551)
    assert best_k([0.6] * 3, [0.5, 0.6, 0.7, 1.2], 0.0) == (2, pytest.approx([0.5, 0.6 / 1.6, 0.7 / 1.96, 1.2 / 2.176]))
    # k never exceeds the acceptance known nor the costs given
    assert best_k([1.0] * 2, [1.0, 1.0, 1.0, 1.0], 0.0)[0] == 2
    assert best_k([1.0] * 8, [1.0, 1.0], 0.0)[0] == 1


def test_best_k_min_gain_boundary_and_ties():
    # one sure draft for 1.94 steps: 0.97 a token, exactly a 3% saving
    assert best_k([1.0], [1.0, 1.94], 0.03)[0] == 0            # a saving of exactly min_gain is not enough
    assert best_k([1.0], [1.0, 1.94], 0.029)[0] == 1
    assert best_k([1.0], [1.0, 1.94], 0.0)[0] == 1
    assert best_k([1.0], [1.0, 2.0], 0.0)[0] == 0              # no saving at all: plain
    # k = 1 and k = 2 both cost 0.5 a token: the smaller k
    assert best_k([1.0, 1.0], [1.0, 1.0, 1.5], 0.0)[0] == 1


def test_discounted_rate():
    rate = DiscountedRate(Tuning(decay=0.5, prior_strength=2.0))
    assert rate.estimate(0.6) == 0.6                           # nothing seen: the prior
    rate.observe(1.0)                                          # hits 1, trials 1
    assert rate.estimate(0.6) == pytest.approx((1 + 2 * 0.6) / (1 + 2))
    rate.observe(0.0)                                          # hits 0.5, trials 1.5
    assert (rate.hits, rate.trials) == (0.5, 1.5)
    assert rate.estimate(0.6) == pytest.approx((0.5 + 1.2) / (1.5 + 2))
    rate.age()                                                 # a sibling's observation: both halve
    assert (rate.hits, rate.trials) == (0.25, 0.75)
    rate.observe(3.0, trials=2.0)                              # fractional evidence: a ratio, a mean gain
    assert (rate.hits, rate.trials) == (3.125, 2.375)
    mean = DiscountedRate(Tuning(decay=0.95, prior_strength=0.0))
    assert mean.estimate(0.0) == 0.0                           # no prior strength and no trials: the prior
    mean.observe(4.0)
    mean.observe(1.0)
    assert mean.estimate(0.0) == pytest.approx((4 * 0.95 + 1) / (0.95 + 1))
    pooled = DiscountedRate.pooled([rate, mean], Tuning(0.99, 1.0))
    assert (pooled.hits, pooled.trials) == pytest.approx((3.125 + 4.8, 2.375 + 1.95))


def test_position_acceptance_counts_the_positions_reached():
    acc = PositionAcceptance(4, Tuning(decay=1.0, prior_strength=1.0))
    acc.observe(4, 2)     # drafts 0 and 1 accepted, 2 rejected, 3 never reached
    assert [p.hits for p in acc.positions] == [1.0, 1.0, 0.0, 0.0]
    assert [p.trials for p in acc.positions] == [1.0, 1.0, 1.0, 0.0]
    assert acc.estimates(4) == pytest.approx([(1 + 0.6) / 2, (1 + 0.6) / 2, 0.6 / 2, 0.6])
    acc.observe(9, 9)     # more drafts than positions: the positions kept
    assert [p.trials for p in acc.positions] == [2.0, 2.0, 2.0, 1.0]


# ---- the controller ----------------------------------------------------------------------------


def _controller(k: int = 2, **knobs) -> SpecController:
    """A cost-model controller; the health check off and probes far apart unless `knobs` say otherwise."""
    knobs = {"acceptance_threshold": 0.0, "reprobe_interval": 1000, **knobs}
    return SpecController(SpeculativeConfig(num_speculative_tokens=k, controller=ControllerConfig(**knobs)))


# three verifications on one domain at the engine-wide decay of 0.99
_DOMAIN_TRIALS = 1 + 0.99 + 0.99 ** 2


def _prose_and_code(c: SpecController, k: int) -> None:
    """Request "h" (prose) verifies k of k drafts three times, request "r" (code) 0 of k."""
    c.next_k("h", 0, 1, domain="prose")
    c.next_k("r", 0, 1, domain="code_gen")
    for _ in range(3):
        c.observe("h", k, k)
        c.observe("r", k, 0)


def test_controller_acceptance_and_its_priors():
    c = _controller(k=2, acceptance_decay=1.0, prior_strength=2.0)
    assert c.acceptance("fresh") == [PRIOR_ACCEPTANCE] * 2     # nothing verified anywhere yet
    _prose_and_code(c, 2)
    prose = (_DOMAIN_TRIALS + 0.6) / (_DOMAIN_TRIALS + 1)      # the domain's estimate: each position always hit
    high = (3 + 2 * prose) / (3 + 2)                           # three hits of three, pulled toward it
    assert c.acceptance("h") == pytest.approx([high, high])
    code = 0.6 / (_DOMAIN_TRIALS + 1)                          # position 0 always missed ...
    low = (0 + 2 * code) / (3 + 2)
    # ... position 1 never reached on code: its prior is every domain's estimate there (prose's)
    assert c.acceptance("r") == pytest.approx([low, prose])
    c.next_k("new", 0, 1, domain="prose")                     # a new request starts from its domain's
    assert c.acceptance("new") == pytest.approx([prose, prose])
    c.next_k("chat", 0, 1, domain="chat")                     # ... or, on an unseen one, from all domains'
    assert c.acceptance("chat") == pytest.approx([(_DOMAIN_TRIALS + 0.6) / (2 * _DOMAIN_TRIALS + 1), prose])


def test_controller_k_follows_acceptance_under_static_costs():
    """deterministic: a step with k drafts costs 1 + (0.1 + 0.05) k plain steps."""
    c = _controller(k=2, acceptance_decay=1.0, prior_strength=2.0, deterministic=True, draft_cost_ratio=0.1)
    assert c.next_k("fresh", 0, 1, domain="chat") == 2         # 0.6 each: 1.3 / 1.96 = 0.66 a token
    _prose_and_code(c, 2)
    a = (3 + 2 * (_DOMAIN_TRIALS + 0.6) / (_DOMAIN_TRIALS + 1)) / 5
    k, per_token = c._best_k("h", 1)
    assert per_token == pytest.approx([1.0, 1.15 / (1 + a), 1.3 / (1 + a + a * a)])
    assert k == 2 and c.next_k("h", 10, 1) == 2
    low = 2 * 0.6 / (_DOMAIN_TRIALS + 1) / 5                   # 1.15 / (1 + 0.06) > 1: plain is cheaper
    prose = (_DOMAIN_TRIALS + 0.6) / (_DOMAIN_TRIALS + 1)
    assert c._best_k("r", 1) == (0, pytest.approx([1.0, 1.15 / (1 + low), 1.3 / (1 + low + low * prose)]))
    assert [c.next_k("r", 10 + i, 1) for i in range(5)] == [0] * 5


@pytest.mark.parametrize("explore", [True, False])
def test_a_position_verified_once_badly_is_drafted_again(monkeypatch, explore):
    """One rejection of the second draft at a request's first step must not hold k at 1 for good (its
    drafts would stop before that position, which would never be verified again): k is chosen on the
    upper bound of a position its domain verified fewer than EXPLORE_TRIALS times."""
    from specdec.speculation import controller
    if not explore:  # without it: stuck at one draft a step, every one of them accepted
        monkeypatch.setattr(controller, "EXPLORE_TRIALS", 0.0)
    c = _controller(k=4, deterministic=True, draft_cost_ratio=0.1)
    c.next_k("r", 0, 1, domain="code_gen")
    c.observe("r", 4, 1)   # the first draft kept, the second rejected
    ks = []
    for i in range(12):
        ks.append(c.next_k("r", 10 + i, 1))
        c.observe("r", ks[-1], ks[-1])   # every draft kept from now on
    assert ks == ([4] * 12 if explore else [1] * 12)


def test_controller_min_gain_boundary():
    """One draft whose cost makes it save 5% a token: speculate under min_gain 0.04, not under 0.06."""
    a = (3 + 2 * (_DOMAIN_TRIALS + 0.6) / (_DOMAIN_TRIALS + 1)) / 5
    ratio = 0.95 * (1 + a) - 1                                  # (1 + ratio) / (1 + a) = 0.95
    for min_gain, k in ((0.04, 1), (0.06, 0)):
        c = _controller(k=1, acceptance_decay=1.0, deterministic=True, draft_cost_ratio=ratio,
                        verify_cost_slope=0.0, min_gain=min_gain)
        _prose_and_code(c, 1)
        assert c._best_k("h", 1)[1] == pytest.approx([1.0, 0.95])
        assert c.next_k("h", 10, 1) == k


def test_controller_k_follows_measured_costs():
    """Costs measured into the shared verify table (as the speculator records every step) and the
    draft's own: a cheap draft drafts all 4, a dearer one fewer, one as dear as the target none."""
    a = (3 + 2 * (_DOMAIN_TRIALS + 0.6) / (_DOMAIN_TRIALS + 1)) / 5
    expected = [expected_tokens([a] * k) for k in range(5)]
    for draft_seconds, k in ((0.01, 4), (0.05, 3), (0.1, 0)):
        table = CostTable(row_align=1)
        c = SpecController(SpeculativeConfig(num_speculative_tokens=4, controller=ControllerConfig(
            acceptance_threshold=0.0, acceptance_decay=1.0, reprobe_interval=1000)), row_align=1, verify_costs=table)
        for rows in range(1, 6):
            table.record(rows, 0.1 + 0.02 * (rows - 1))          # each scored row adds a fifth of a step
        c.record_draft(1, draft_seconds)
        _prose_and_code(c, 4)
        per_token = [(0.1 + (0.02 + draft_seconds) * j) / expected[j] for j in range(5)]
        assert c._best_k("h", 1)[1] == pytest.approx(per_token)
        # 0.01 s: 0.0477 s a token at k = 4; 0.05 s: 0.08235 at k = 3, 0.08238 at 4, 0.0833 at 2;
        # 0.1 s: 0.112 at k = 1, more than plain's 0.1
        assert per_token.index(min(per_token)) == k
        assert c.next_k("h", 10, 1) == k


def test_controller_falls_back_when_acceptance_collapses():
    c = SpecController(SpeculativeConfig(num_speculative_tokens=3, policy="fixed", controller=ControllerConfig(
        acceptance_threshold=0.5, health_window=2, reprobe_interval=3, reprobe_k=1)))
    assert c.next_k("r", 0, 1) == 3
    assert c.observe("r", 3, 1) is False                        # 1 of 3: one step is not a window yet
    assert c.observe("r", 3, 1) is True and c.num_fallbacks == 1    # 2 of 6 < 0.5
    assert [c.next_k("r", 5 + i, 1) for i in range(3)] == [0, 0, 1]  # plain, then a probe of reprobe_k
    c.observe("r", 1, 1)
    assert c.next_k("r", 9, 1) == 3 and c.num_resumes == 1


# ---- the router --------------------------------------------------------------------------------


def test_router_tries_the_domains_prior_order_then_the_higher_gain():
    r = DraftRouter(exploration=0.0)
    cands = ["draft-a", "ngram"]
    assert r.choose("code_edit", cands) == "ngram"              # prompt lookup first where output copies input
    assert r.choose("prose", cands) == "draft-a"                # elsewhere draft models first
    r.observe("code_edit", "ngram", 30, 10.0)                   # 3 tokens per unit of cost
    assert r.choose("code_edit", cands) == "draft-a"            # the untried one next
    r.observe("code_edit", "draft-a", 20, 10.0)                 # 2
    r.observe("prose", "draft-a", 40, 10.0)                     # 4
    r.observe("prose", "ngram", 10, 10.0)                       # 1
    assert [r.choose("code_edit", cands) for _ in range(3)] == ["ngram"] * 3
    assert [r.choose("prose", cands) for _ in range(3)] == ["draft-a"] * 3
    gains = r.snapshot()["code_edit"]
    # ngram's observation aged by draft-a's (0.95), its mean unchanged
    assert (gains["ngram"]["gain"], gains["ngram"]["weight"]) == (pytest.approx(3.0), pytest.approx(0.95))
    assert (gains["draft-a"]["gain"], gains["draft-a"]["weight"]) == (pytest.approx(2.0), pytest.approx(1.0))


def test_router_means_are_discounted():
    r = DraftRouter(exploration=0.0)
    r.observe("prose", "draft-a", 40, 10.0)
    r.observe("prose", "draft-a", 10, 10.0)
    assert r.arms["prose", "draft-a"].mean == pytest.approx((4 * 0.95 + 1) / (0.95 + 1))
    for _ in range(30):                                          # traffic drifts: the draft now gains 1
        r.observe("prose", "draft-a", 10, 10.0)
    recent = sum(0.95 ** i for i in range(31))                   # the 31 gains of 1, discounted
    assert r.arms["prose", "draft-a"].mean == pytest.approx((4 * 0.95 ** 31 + recent) / (0.95 ** 31 + recent))
    r.observe("prose", "ngram", 15, 10.0)                       # 1.5 beats the draft's 1.04 now
    assert r.choose("prose", ["draft-a", "ngram"]) == "ngram"


def test_router_exploration_bonus():
    """b (gain 0.9) observed once, then a (gain 1.0) nine times: b's weight is 0.95^9, a's the sum of
    0.95^0..8. UCB: mean / best + exploration * sqrt(ln(total weight) / weight)."""
    w_b, w_a = 0.95 ** 9, sum(0.95 ** i for i in range(9))
    bonus_a, bonus_b = (math.sqrt(math.log(w_a + w_b) / w) for w in (w_a, w_b))
    for exploration, choice in ((0.0, "a"), (0.05, "a"), (0.2, "b")):
        r = DraftRouter(exploration=exploration)
        r.observe("chat", "b", 9, 10.0)
        for _ in range(9):
            r.observe("chat", "a", 10, 10.0)
        assert r._score("chat", "a", ["a", "b"]) == pytest.approx(1.0 + exploration * bonus_a)
        assert r._score("chat", "b", ["a", "b"]) == pytest.approx(0.9 + exploration * bonus_b)
        assert r.choose("chat", ["a", "b"]) == choice
    # where the request has tried one, a switch goes to an untried candidate, else the best mean
    assert r.switch("chat", "a", {"a"}, ["a", "b", "c"]) == "c"
    assert r.switch("chat", "c", {"c"}, ["a", "b", "c"]) == "a"
    assert r.switch("chat", "a", {"a", "b", "c"}, ["a", "b", "c"]) is None


# ---- configured values -------------------------------------------------------------------------


class _Model:
    name, kv, row_align = "m", None, 1


def test_hybrid_prices_an_unmeasured_model_draft_at_the_configured_ratio():
    """Before a model draft is measured it costs controller.draft_cost_ratio of a plain step (at the
    prior acceptance 0.6); once verified, acceptance learns with the engine-wide estimator."""
    costs = [1.0, 1.1]
    for ratio in (0.25, 0.4):
        hybrid = HybridProposer(object(), _Model(), draft_cost_ratio=ratio)
        assert hybrid._model_cost(1, costs) == pytest.approx((1.1 + ratio) / (1 + 0.6))
    hybrid.draft_seconds = 0.05                                  # measured: the measurement
    assert hybrid._model_cost(1, costs) == pytest.approx((1.1 + 0.05) / 1.6)
    hybrid.acceptance.observe(1, 1)
    assert hybrid._model_cost(1, costs) == pytest.approx(1.15 / (1 + (1 + 0.6) / (1 + 1)))
