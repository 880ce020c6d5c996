"""rejection_sample: exact speculative sampling, checked statistically against the exact target
distribution, plus exact greedy cases, one-hot (n-gram) drafts and masked vocabularies.

The statistical tests simulate whole generations with a toy Markov target p(.|prev) and a different
Markov draft q(.|prev) over a 10-token vocabulary: a million rows draft k tokens from q, get them
verified by `rejection_sample`, and keep going until each row has two output tokens. The empirical
joint of the first two tokens (y1, y2) must match p(y1|c) p(y2|y1) by a chi-square goodness-of-fit
test (cells with expected count < 5 pooled, alpha = 1e-4) and total variation < 0.01. The two
deliberately broken samplers (defined here, wrapping the real one) must fail the same check, which
shows it has power. The cases are written as padded [rows, k] tensors; `rejection_sample` below
flattens them into the sampler's rows.
"""
from __future__ import annotations

import contextlib
import functools

import numpy as np
import pytest
import torch

from broken_samplers import always_accept, resample_from_p
from specdec.sample import rejection_sampler

V = 10               # toy vocabulary
CONTEXT = 3          # the fixed context token c
N_SAMPLES = 1_000_000
CHUNK = 250_000      # rows per vectorized chunk (N_SAMPLES in total)
ALPHA = 1e-4
TV_MAX = 0.01
MODES = (None, "always_accept", "resample_from_p")
BROKEN_K = 1         # the broken samplers are run on the k = 1 simulations (runtime budget)


# ---------------------------------------------------------------------------------------------
# padded cases -> the sampler's flat rows, and the deliberately broken samplers

SAMPLERS = {None: rejection_sampler.rejection_sample, "always_accept": always_accept,
            "resample_from_p": resample_from_p}


def rejection_sample(draft_ids, num_draft, draft_probs, target_logits, is_greedy, uniforms, noise, _test_mode=None):
    """The padded form of a case ([r, max_k] drafts, [r, max_k + 1, vocab] logits; `noise`: Exp(1)
    draws of any shape [r, ...], the first of each row turned into the row's final uniform
    1 - exp(-E)) -> (out [r, max_k + 1] padded with -1, num_accepted)."""
    r, max_k = draft_ids.shape
    valid = torch.arange(max_k) < num_draft[:, None]
    rows = torch.arange(max_k + 1) <= num_draft[:, None]
    flat_probs = None if draft_probs is None else draft_probs[valid]
    final_u = -torch.expm1(-noise.reshape(r, -1)[:, 0].double()).float().clamp(max=1 - 2 ** -24)
    tokens, num_accepted = SAMPLERS[_test_mode](draft_ids[valid], num_draft, flat_probs, target_logits[rows],
                                                is_greedy, uniforms[valid], final_u)
    out = torch.full((r, max_k + 1), -1, dtype=torch.long)
    for i, t in enumerate(tokens):
        out[i, : len(t)] = torch.tensor(t)
    return out, num_accepted


# ---------------------------------------------------------------------------------------------
# the distribution check (one helper, asserted both ways)

def goodness_of_fit(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """(chi-square p-value, total-variation distance) of observed `counts` against exact `probs`.
    Cells whose expected count is below 5 are pooled into one cell; df = cells - 1."""
    counts = counts.double().flatten()
    probs = probs.double().flatten()
    n = counts.sum()
    tv = 0.5 * (counts / n - probs).abs().sum().item()
    expected = probs * n
    small = expected < 5
    obs, exp = counts[~small], expected[~small]
    if small.any():
        pooled_obs, pooled_exp = counts[small].sum(), expected[small].sum()
        if pooled_exp > 0:
            obs, exp = torch.cat([obs, pooled_obs[None]]), torch.cat([exp, pooled_exp[None]])
        elif pooled_obs > 0:  # tokens of probability zero were emitted
            return 0.0, tv
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    p_value = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2).item()
    return p_value, tv


def matches(p_value: float, tv: float) -> bool:
    return p_value > ALPHA and tv < TV_MAX


def test_goodness_of_fit_helper():
    """The hand-rolled p-value: known chi-square quantiles, and pooling of rare cells."""
    # chi2(df=1) survival at 3.841459 is 0.05; chi2(df=9) at 21.665994 is 0.01
    for df, x, sf in [(1, 3.841459, 0.05), (9, 21.665994, 0.01)]:
        got = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                      torch.tensor(x / 2, dtype=torch.float64)).item()
        assert abs(got - sf) < 1e-6
    probs = torch.tensor([0.5, 0.5 - 2e-6, 1e-6, 1e-6], dtype=torch.float64)
    assert goodness_of_fit(torch.tensor([500_000, 499_998, 1, 1]), probs) == pytest.approx((1.0, 0.0), abs=1e-12)
    p_value, tv = goodness_of_fit(torch.tensor([510_000, 490_000, 0, 0]), probs)
    assert p_value < 1e-12 and abs(tv - 0.01) < 1e-5
    assert goodness_of_fit(torch.tensor([5, 4, 1]), torch.tensor([0.5, 0.5, 0.0]))[0] == 0.0


# ---------------------------------------------------------------------------------------------
# toy Markov target / draft tables (float64, rows = previous token)

def _dirichlet(seed: int, alpha: float = 0.5) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).dirichlet([alpha] * V, size=V))


def target_table() -> torch.Tensor:
    return _dirichlet(1234)


def draft_table(case: str) -> torch.Tensor:
    p = target_table()
    if case == "random":
        return _dirichlet(5678)
    if case == "q_eq_p":
        # exactly the sampler's own softmax(log p) in float32, so q == p bit for bit
        return torch.softmax(p.log().float(), dim=-1).double()
    if case == "q_zero":
        # q(x) = 0 where p(x) > 0: drop each row's most likely target token and two random others
        q = _dirichlet(5678).clone()
        rng = np.random.default_rng(91011)
        for prev in range(V):
            others = [t for t in range(V) if t != int(p[prev].argmax())]
            zero = [int(p[prev].argmax())] + list(rng.choice(others, size=2, replace=False))
            q[prev, zero] = 0.0
        assert ((q == 0) & (p > 0)).sum() == 3 * V
        return q / q.sum(-1, keepdim=True)
    if case == "subvocab":
        # a sub-vocabulary draft (speculation/proposers/subvocab.py): one fixed set of tokens for every context, zero
        # elsewhere, holding the target's top token in some contexts and not in others
        q = _dirichlet(5678).clone()
        outside = torch.arange(V) % 3 == 1
        q[:, outside] = 0.0
        assert (p[:, outside].sum(-1) > 0.02).all()  # real target mass the draft never proposes
        return q / q.sum(-1, keepdim=True)
    raise ValueError(case)


def ngram_map(kind: str) -> torch.Tensor:
    """A deterministic draft (one-hot q): the next token proposed after each previous token."""
    p = target_table()
    if kind == "likely":
        return p.argmax(-1)
    return (torch.arange(V) * 7 + 2) % V  # an arbitrary map that ignores p


def exact_joint() -> torch.Tensor:
    p = target_table()
    return p[CONTEXT][:, None] * p  # [y1, y2]


# ---------------------------------------------------------------------------------------------
# vectorized simulation of generation

def _exp_noise(shape, g: torch.Generator) -> torch.Tensor:
    return torch.empty(shape).exponential_(generator=g)


def _fast_exp_noise(shape, rng: np.random.Generator) -> torch.Tensor:
    """Exp(1) draws for the million-row simulations: numpy's float32 ziggurat is about four times
    faster than torch's exponential_ on CPU. It returns an exact 0 about once in 4e6 draws (a
    measure-zero event of Exp(1)), which the sampler must tolerate (see the masked-token tests);
    its effect on the distribution is far below what a million samples can resolve."""
    return torch.from_numpy(rng.standard_exponential(shape, dtype=np.float32))


@contextlib.contextmanager
def _one_thread():
    """The simulations run on a shared, busy machine: one intra-op thread is faster there."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _draft_and_verify(prev, k, logp32, q32, q_cdf, det, g, rng, mode, randomness=None):
    """One speculative round for rows whose last token is `prev`: k drafts proposed from q
    autoregressively, verified against p. Returns (out_ids, num_accepted)."""
    m = prev.shape[0]
    if randomness is None:
        draft_u = torch.rand(m, k, dtype=torch.float64, generator=g)
        uniforms = torch.rand(m, k, generator=g)
        noise = _fast_exp_noise((m, k + 1, V), rng)
    else:
        draft_u, uniforms, noise = randomness
    prevs = [prev]
    for j in range(k):
        cur = prevs[-1]
        if det is not None:
            prevs.append(det[cur])
        else:  # inverse CDF; cdf rows end in exactly 1.0, so q(x) = 0 tokens are never drawn
            prevs.append((q_cdf[cur] <= draft_u[:, j, None]).sum(-1))
    prevs = torch.stack(prevs, dim=1)                              # [m, k + 1]: prev_0 .. prev_k
    draft_ids = prevs[:, 1:].contiguous()
    draft_probs = None if det is not None else q32[prevs[:, :k]]  # [m, k, V]: q(.|prev_j)
    target_logits = logp32[prevs]                                  # [m, k + 1, V]: log p(.|prev_j)
    num_draft = torch.full((m,), k, dtype=torch.long)
    is_greedy = torch.zeros(m, dtype=torch.bool)
    out, num_accepted = rejection_sample(draft_ids, num_draft, draft_probs, target_logits, is_greedy,
                                         uniforms, noise, _test_mode=mode)
    # structural invariants of every round: accepted drafts, then one token, then padding
    assert ((num_accepted >= 0) & (num_accepted <= k)).all()
    pos = torch.arange(k + 1)
    assert ((out >= 0) == (pos <= num_accepted[:, None])).all()
    kept = pos[:k] < num_accepted[:, None]
    assert torch.equal(out[:, :k][kept], draft_ids[kept])
    return out, num_accepted


@functools.cache
def simulate(draft: str, k: int, modes: tuple = (None,), n: int = N_SAMPLES, seed: int = 0
             ) -> dict:
    """Generate the first two output tokens after the context for n rows. `draft` is a q-table
    case or 'ngram-<kind>' (one-hot drafts, draft_probs=None). A round emits num_accepted + 1 >= 1
    tokens, so rows whose first round emitted one token (a rejection at the first draft) need
    exactly one more round, from their new last token. Every mode sees the same first-round
    randomness (common random numbers); second rounds draw fresh randomness for the rows that need
    one. Returns {mode: (counts [V, V] of (y1, y2), every draft accepted in every round)}."""
    p = target_table()
    logp32 = p.log().float()
    det = q32 = q_cdf = None
    if draft.startswith("ngram-"):
        det = ngram_map(draft.removeprefix("ngram-"))
    else:
        q = draft_table(draft)
        q32 = q.float()
        q_cdf = q.cumsum(-1)
        q_cdf = q_cdf / q_cdf[:, -1:]
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    results = {mode: [torch.zeros(V * V, dtype=torch.long), True] for mode in modes}
    with _one_thread():
        for start in range(0, n, CHUNK):
            m = min(CHUNK, n - start)
            first = (torch.rand(m, k, dtype=torch.float64, generator=g), torch.rand(m, k, generator=g),
                     _fast_exp_noise((m, k + 1, V), rng))
            context = torch.full((m,), CONTEXT, dtype=torch.long)
            for mode in modes:
                out, num_accepted = _draft_and_verify(context, k, logp32, q32, q_cdf, det, g, rng, mode, first)
                all_accepted = bool((num_accepted == k).all())
                y1 = out[:, 0]
                y2 = out[:, 1].clone()                 # valid where num_accepted >= 1
                again = (num_accepted == 0).nonzero()[:, 0]
                if again.numel():
                    out2, num_accepted2 = _draft_and_verify(y1[again], k, logp32, q32, q_cdf, det, g, rng, mode)
                    y2[again] = out2[:, 0]
                    all_accepted &= bool((num_accepted2 == k).all())
                assert (y2 >= 0).all()
                results[mode][0] += torch.bincount(y1 * V + y2, minlength=V * V)
                results[mode][1] &= all_accepted
    return {mode: (c.view(V, V), full) for mode, (c, full) in results.items()}


# ---------------------------------------------------------------------------------------------
# 1. the sampler reproduces the target exactly

def _modes(case: str, k: int) -> tuple:
    """Samplers run on a simulation's shared randomness (one cached simulation per case and k)."""
    return MODES if case != "q_eq_p" and k == BROKEN_K else (None,)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("case", ["random", "q_eq_p", "q_zero", "subvocab"])
def test_distribution_matches_target(case, k):
    counts, all_accepted = simulate(case, k, _modes(case, k))[None]
    assert counts.sum() == N_SAMPLES
    p_value, tv = goodness_of_fit(counts, exact_joint())
    print(f"{case} k={k}: p-value={p_value:.4g} tv={tv:.4g}")
    assert matches(p_value, tv), (p_value, tv)
    if case == "q_eq_p":
        assert all_accepted  # q == p: every draft of every row is accepted


# ---------------------------------------------------------------------------------------------
# 2. the deliberately broken samplers are caught by the same check

@pytest.mark.parametrize("case", ["random", "q_zero"])
@pytest.mark.parametrize("mode", ["always_accept", "resample_from_p"])
def test_broken_samplers_fail(mode, case, k=BROKEN_K):
    counts, _ = simulate(case, k, _modes(case, k))[mode]
    assert counts.sum() == N_SAMPLES
    p_value, tv = goodness_of_fit(counts, exact_joint())
    print(f"{mode} {case} k={k}: p-value={p_value:.4g} tv={tv:.4g}")
    assert not matches(p_value, tv), (p_value, tv)


# ---------------------------------------------------------------------------------------------
# 4. one-hot drafts (draft_probs=None, n-gram style)

@pytest.mark.parametrize("kind,k", [("likely", 2), ("arbitrary", 3)])
def test_one_hot_drafts_match_target(kind, k):
    res = simulate(f"ngram-{kind}", k, MODES, n=200_000, seed=1)
    counts, _ = res[None]
    p_value, tv = goodness_of_fit(counts, exact_joint())
    print(f"ngram-{kind} k={k}: p-value={p_value:.4g} tv={tv:.4g}")
    assert matches(p_value, tv), (p_value, tv)
    for mode in MODES[1:]:  # and the check has power here too
        p_bad, tv_bad = goodness_of_fit(res[mode][0], exact_joint())
        print(f"  {mode}: p-value={p_bad:.4g} tv={tv_bad:.4g}")
        assert not matches(p_bad, tv_bad), (mode, p_bad, tv_bad)


def test_one_hot_none_equals_explicit_one_hot_probs():
    """draft_probs=None behaves exactly like passing one-hot draft probabilities."""
    g = torch.Generator().manual_seed(7)
    r, k, v = 4000, 3, 16
    drafts = torch.randint(0, v, (r, k), generator=g)
    num_draft = torch.randint(0, k + 1, (r,), generator=g)
    drafts = torch.where(torch.arange(k) < num_draft[:, None], drafts, -1)
    logits = torch.randn(r, k + 1, v, generator=g) * 2
    one_hot = torch.zeros(r, k, v).scatter_(-1, drafts.clamp(min=0)[..., None], 1.0)
    greedy = torch.rand(r, generator=g) < 0.3
    uniforms, noise = torch.rand(r, k, generator=g), _exp_noise((r, k + 1, v), g)
    a = rejection_sample(drafts, num_draft, None, logits, greedy, uniforms, noise)
    b = rejection_sample(drafts, num_draft, one_hot, logits, greedy, uniforms, noise)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ---------------------------------------------------------------------------------------------
# 3. exact greedy cases

def _logits_with_argmax(argmaxes: torch.Tensor, v: int, seed: int) -> torch.Tensor:
    """Random logits [R, P, v] whose argmax at [r, j] is argmaxes[r, j] (by a clear margin)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*argmaxes.shape, v, generator=g)
    logits.scatter_(-1, argmaxes[..., None], logits.max(-1, keepdim=True).values + 1.0)
    assert torch.equal(logits.argmax(-1), argmaxes)
    return logits


def _greedy(drafts, num_draft, logits, draft_probs=None, uniforms=None, noise=None):
    r, max_k = drafts.shape
    v = logits.shape[-1]
    uniforms = torch.full((r, max_k), 0.999) if uniforms is None else uniforms
    noise = torch.full((r, max_k + 1, v), 1e-3) if noise is None else noise
    return rejection_sample(drafts, num_draft, draft_probs, logits, torch.ones(r, dtype=torch.bool),
                            uniforms, noise)


@pytest.mark.parametrize("with_probs", [False, True])
def test_greedy_all_drafts_match(with_probs):
    k, v = 4, 12
    argmax = torch.tensor([[5, 0, 11, 5, 7]])
    logits = _logits_with_argmax(argmax, v, seed=0)
    drafts = argmax[:, :k].clone()
    # draft probabilities and uniforms play no part in greedy rows
    probs = torch.full((1, k, v), 1.0 / v) if with_probs else None
    out, n = _greedy(drafts, torch.tensor([k]), logits, probs, uniforms=torch.full((1, k), 0.999))
    assert out.tolist() == [[5, 0, 11, 5, 7]] and n.tolist() == [k]


def test_greedy_mismatch_at_position_one():
    v = 12
    argmax = torch.tensor([[3, 8, 1, 2]])
    logits = _logits_with_argmax(argmax, v, seed=1)
    drafts = torch.tensor([[3, 9, 1]])  # the later draft matches but comes after a rejection
    out, n = _greedy(drafts, torch.tensor([3]), logits, torch.rand(1, 3, v))
    assert out.tolist() == [[3, 8, -1, -1]] and n.tolist() == [1]


@pytest.mark.parametrize("max_k", [0, 3])
def test_greedy_empty_draft(max_k):
    v = 12
    argmax = torch.tensor([[6, 0, 0, 0][: max_k + 1]])
    logits = _logits_with_argmax(argmax, v, seed=2)
    drafts = torch.full((1, max_k), -1, dtype=torch.long)  # padding clamps to 0 == argmax after
    out, n = _greedy(drafts, torch.tensor([0]), logits, torch.zeros(1, max_k, v) if max_k else None)
    assert out.tolist() == [[6] + [-1] * max_k] and n.tolist() == [0]


def _reference_greedy(drafts: list[int], argmax: list[int]) -> list[int]:
    out = []
    for j, d in enumerate(drafts):
        if d != argmax[j]:
            break
        out.append(d)
    return out + [argmax[len(out)]]


def test_greedy_batch_with_different_k():
    v, max_k = 20, 5
    # (k, argmax at 0..k, drafts); padded positions get argmax 0, which clamp(-1) would match
    rows = [
        (0, [4], []),
        (1, [7, 9], [7]),                              # match + bonus
        (1, [7, 9], [2]),                              # mismatch at 0
        (3, [1, 2, 3, 4], [1, 2, 5]),                  # mismatch at 2
        (3, [1, 2, 3, 4], [1, 2, 3]),                  # all match
        (5, [10, 11, 12, 13, 14, 15], [10, 11, 12, 13, 14]),  # all match, bonus at max_k
        (5, [10, 11, 12, 13, 14, 15], [0, 11, 12, 13, 14]),   # mismatch at 0
        (5, [10, 11, 12, 13, 14, 15], [10, 11, 12, 13, 19]),  # mismatch at the last draft
    ]
    argmax = torch.zeros(len(rows), max_k + 1, dtype=torch.long)
    drafts = torch.full((len(rows), max_k), -1, dtype=torch.long)
    for r, (k, am, d) in enumerate(rows):
        argmax[r, : k + 1] = torch.tensor(am)
        drafts[r, :k] = torch.tensor(d, dtype=torch.long)
    num_draft = torch.tensor([k for k, _, _ in rows])
    logits = _logits_with_argmax(argmax, v, seed=3)
    for probs in (None, torch.softmax(torch.randn(len(rows), max_k, v), -1)):
        out, n = _greedy(drafts, num_draft, logits, probs)
        for r, (k, am, d) in enumerate(rows):
            ref = _reference_greedy(d, am)
            assert n[r].item() == len(ref) - 1, r
            assert out[r].tolist() == ref + [-1] * (max_k + 1 - len(ref)), r


def test_mixed_greedy_and_sampled_rows():
    """Greedy rows follow the argmax whatever their uniforms; sampled rows follow the acceptance
    rule u * q < p. Each row is set up so its outcome is deterministic, and differs from what the
    other rule would give. Batched results equal the rows run one by one."""
    v, max_k, ninf = 6, 2, float("-inf")
    logits = torch.full((4, max_k + 1, v), ninf)
    probs = torch.full((4, max_k, v), 0.0)
    drafts = torch.full((4, max_k), -1, dtype=torch.long)
    uniforms = torch.zeros(4, max_k)
    num_draft = torch.tensor([2, 2, 1, 1])
    is_greedy = torch.tensor([True, False, True, False])

    def dist(row, pos, pairs):
        for tok, prob in pairs:
            logits[row, pos, tok] = torch.tensor(prob).log()

    # row 0, greedy: drafts are argmaxes though u * q >= p (sampling would reject them)
    dist(0, 0, [(1, 0.6), (2, 0.4)]); dist(0, 1, [(3, 0.7), (4, 0.3)]); dist(0, 2, [(5, 0.9), (0, 0.1)])
    drafts[0] = torch.tensor([1, 3]); probs[0, 0, 1] = 1.0; probs[0, 1, 3] = 1.0
    uniforms[0] = 0.99
    # row 1, sampled: draft 2 is not the argmax but p(2) = 0.4 > q(2) = 0.2: always accepted; the
    # second draft has p = 0: always rejected, residual max(0, p - q) is all on token 4
    dist(1, 0, [(1, 0.6), (2, 0.4)]); dist(1, 1, [(3, 0.7), (4, 0.3)]); dist(1, 2, [(5, 1.0)])
    drafts[1] = torch.tensor([2, 0]); probs[1, 0, 2] = 0.2; probs[1, 0, 0] = 0.8
    probs[1, 1, 3] = 0.8; probs[1, 1, 0] = 0.2
    uniforms[1] = 0.99
    # row 2, greedy with one draft: mismatch (u = 0 would accept it when sampling)
    dist(2, 0, [(1, 0.6), (2, 0.4)]); dist(2, 1, [(0, 1.0)])
    drafts[2, 0] = 2; probs[2, 0, 2] = 1.0
    # row 3, sampled, one draft accepted with u = 0, then a bonus from a one-token distribution
    dist(3, 0, [(1, 0.6), (2, 0.4)]); dist(3, 1, [(5, 1.0)])
    drafts[3, 0] = 2; probs[3, 0, 2] = 1.0
    unused = torch.isinf(logits).all(-1)  # positions past a row's drafts: any valid distribution
    logits[unused] = 0.0
    g = torch.Generator().manual_seed(11)
    noise = _exp_noise((4, max_k + 1, v), g)

    out, n = rejection_sample(drafts, num_draft, probs, logits, is_greedy, uniforms, noise)
    assert out.tolist() == [[1, 3, 5], [2, 4, -1], [1, -1, -1], [2, 5, -1]]
    assert n.tolist() == [2, 1, 0, 1]
    for r in range(4):
        s = slice(r, r + 1)
        o, m = rejection_sample(drafts[s], num_draft[s], probs[s], logits[s], is_greedy[s], uniforms[s], noise[s])
        assert torch.equal(o[0], out[r]) and m.item() == n[r].item()


def test_mixed_batch_rows_are_independent():
    """Random mixed batches: each row's result equals that row run alone."""
    g = torch.Generator().manual_seed(12)
    r, max_k, v = 64, 4, 30
    num_draft = torch.randint(0, max_k + 1, (r,), generator=g)
    drafts = torch.randint(0, v, (r, max_k), generator=g)
    drafts = torch.where(torch.arange(max_k) < num_draft[:, None], drafts, -1)
    logits = torch.randn(r, max_k + 1, v, generator=g) * 3
    probs = torch.softmax(torch.randn(r, max_k, v, generator=g) * 3, -1)
    greedy = torch.rand(r, generator=g) < 0.5
    uniforms, noise = torch.rand(r, max_k, generator=g), _exp_noise((r, max_k + 1, v), g)
    out, n = rejection_sample(drafts, num_draft, probs, logits, greedy, uniforms, noise)
    for i in range(r):
        s = slice(i, i + 1)
        o, m = rejection_sample(drafts[s], num_draft[s], probs[s], logits[s], greedy[s], uniforms[s], noise[s])
        assert torch.equal(o[0], out[i]) and m.item() == n[i].item()
        if greedy[i]:
            am = logits[i].argmax(-1).tolist()
            ref = _reference_greedy(drafts[i, : num_draft[i]].tolist(), am)
            assert out[i, : len(ref)].tolist() == ref and n[i].item() == len(ref) - 1


# ---------------------------------------------------------------------------------------------
# 5. masked tokens (-inf logits) are never emitted

@pytest.mark.parametrize("one_hot", [False, True])
def test_masked_tokens_never_emitted(one_hot):
    g = torch.Generator().manual_seed(13 + one_hot)
    r, max_k, v = 8_000, 4, 50
    logits = torch.randn(r, max_k + 1, v, generator=g) * 2
    keep_frac = torch.rand(r, max_k + 1, 1, generator=g)        # from almost nothing to almost all
    mask = torch.rand(r, max_k + 1, v, generator=g) > keep_frac
    mask.scatter_(-1, torch.randint(0, v, (r, max_k + 1, 1), generator=g), False)  # >= 1 allowed
    logits = logits.masked_fill(mask, float("-inf"))
    # drafts from q, which puts mass on masked tokens; a quarter of the rows have q == p exactly
    q = torch.softmax(torch.randn(r, max_k, v, generator=g) * 2, -1)
    same = torch.rand(r, generator=g) < 0.25
    q = torch.where(same[:, None, None], torch.softmax(logits[:, :max_k], -1), q)
    drafts = torch.multinomial(q.view(-1, v), 1, generator=g).view(r, max_k)
    num_draft = torch.randint(0, max_k + 1, (r,), generator=g)
    drafts = torch.where(torch.arange(max_k) < num_draft[:, None], drafts, -1)
    greedy = torch.rand(r, generator=g) < 0.2
    uniforms, noise = torch.rand(r, max_k, generator=g), _exp_noise((r, max_k + 1, v), g)
    noise[torch.rand(noise.shape, generator=g) < 0.01] = 0.0  # exact zeros must not matter either
    probs = None if one_hot else q
    out, n = rejection_sample(drafts, num_draft, probs, logits, greedy, uniforms, noise)
    pos = torch.arange(max_k + 1)
    emitted = pos <= n[:, None]
    assert ((n >= 0) & (n <= num_draft)).all()
    assert (out[~emitted] == -1).all()
    assert ((out[emitted] >= 0) & (out[emitted] < v)).all()
    chosen_logit = logits.gather(-1, out.clamp(min=0)[..., None])[..., 0]
    assert torch.isfinite(chosen_logit[emitted]).all()
    assert (n[same & ~greedy] == num_draft[same & ~greedy]).all() or one_hot
    # a position with a single allowed token can only ever emit that token
    only = (~mask).sum(-1) == 1
    forced = (~mask).float().argmax(-1)
    hit = only & emitted
    assert hit.any() and (out[hit] == forced[hit]).all()


@pytest.mark.parametrize("one_hot", [False, True])
def test_extreme_uniforms_never_emit_a_zero_probability_token(one_hot):
    """A final uniform of exactly 0, or the largest float32 below 1, must still land on a token of
    positive probability: neither a token masked by -inf (at either end of the vocabulary), nor one
    outside the residual max(0, p - q)."""
    v, ninf = 8, float("-inf")
    logits = torch.tensor([[[ninf, 1.0, ninf, 0.5, ninf, 0.0, 0.0, ninf],
                            [ninf, 1.0, ninf, 0.5, ninf, 2.0, ninf, ninf]]])
    masked = torch.isinf(logits[0])
    probs = None if one_hot else torch.full((1, 1, v), 1.0 / v)
    # draft 2 is masked: always rejected (residual); draft 1 with u = 0: accepted (bonus)
    for draft, expect_n in ((2, 0), (1, 1)):
        for u in (0.0, 1 - 2 ** -24):
            tokens, n = rejection_sampler.rejection_sample(
                torch.tensor([draft]), torch.tensor([1]), None if probs is None else probs[0], logits[0],
                torch.tensor([False]), torch.zeros(1), torch.tensor([u]))
            assert n.item() == expect_n
            assert not masked[expect_n, tokens[0][-1]], (draft, u, tokens)
    # q >= p on tokens 1 and 3 at position 0, so they are outside the residual
    q = torch.zeros(1, v)
    q[0, [1, 3]] = 0.5
    residual = (torch.softmax(logits[0, 0], -1) - q[0]).clamp(min=0)
    for u in (0.0, 1 - 2 ** -24):
        tokens, n = rejection_sampler.rejection_sample(torch.tensor([1]), torch.tensor([1]), q, logits[0],
                                                       torch.tensor([False]), torch.full((1,), 0.99),
                                                       torch.tensor([u]))   # 0.99 * 0.5 > p(1): rejected
        assert n.item() == 0 and residual[tokens[0][0]] > 0, tokens
