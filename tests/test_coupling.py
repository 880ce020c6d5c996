"""Gumbel coupling (sample/noise.py): positional noise, and coupled speculation checked statistically.

The simulation is test_rejection_sampler.py's toy Markov target p(.|prev) and draft q(.|prev) over 10
tokens: each row has its own key; the draft proposes argmax(log q + G_t) with the noise of output
position t, the target's rows get log p + G_t and are verified as greedy rows by the real
`rejection_sample`, and rows run on until they hold two output tokens. The joint of (y1, y2) must be
p(y1|c) p(y2|y1) by the same chi-square test, and the deliberately broken couplings must fail it.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_rejection_sampler import CONTEXT, V, draft_table, exact_joint, goodness_of_fit, matches, target_table

from specdec.sample import noise
from specdec.sample.rejection_sampler import rejection_sample

N = 200_000
K = 2


def _splitmix(x: int) -> int:
    """SplitMix64's output function on Python ints: the reference the tensor code must match."""
    m = (1 << 64) - 1
    z = x & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def test_noise_matches_the_counter_based_reference():
    key = noise.noise_key(42, 1)
    g = noise.gumbel(key, 7, 151_936)
    base = _splitmix(key ^ _splitmix(7))
    for i in (0, 1, 999, 151_935):
        bits = _splitmix(base + (i + 1) * 0x9E3779B97F4A7C15)
        v = ((bits >> 11) + 0.5) * 2.0 ** -53
        assert float(g[i]) == pytest.approx(-math.log(-math.log1p(-v)), abs=1e-6)


def test_noise_is_a_pure_function_of_key_and_position():
    key = noise.noise_key(3)
    first = noise.gumbel(key, 5, 1000).clone()
    noise.gumbel(key, 6, 1000)  # other draws in between change nothing
    assert torch.equal(noise.gumbel(key, 5, 1000), first)
    assert torch.equal(noise.gumbel(key, 5, 50), first[:50])  # a narrower vocabulary is a prefix
    assert torch.equal(noise.gumbel_at(key, 5, torch.tensor([3, 999, 17])), first[[3, 999, 17]])  # any ids
    assert not torch.equal(noise.gumbel(key, 6, 1000), first)
    assert not torch.equal(noise.gumbel(noise.noise_key(3, 1), 5, 1000), first)   # another choice
    assert not torch.equal(noise.gumbel(noise.noise_key(4), 5, 1000), first)      # another seed
    table = noise.gumbel_table(torch.tensor([key, key]), torch.tensor([5, 6]), 1000)
    assert torch.equal(table[0], first) and torch.equal(table[1], noise.gumbel(key, 6, 1000))


def test_the_gumbel_max_form_picks_what_the_whole_noise_row_picks():
    """add_gumbel_ gives only the values that can win their noise: the same first argmax as the row plus
    its whole noise vector, over peaked and flat rows, filtered ones, ties, and NaN or infinite logits."""
    from specdec.sample.sampler import first_argmax
    g = torch.Generator().manual_seed(0)
    vocab = 5000
    for trial in range(400):
        scale = [0.5, 3.0, 10.0, 40.0][trial % 4]
        row = torch.randn(vocab, generator=g) * scale
        if trial % 5 == 1:   # top-p / top-k: a few values left
            row[torch.randperm(vocab, generator=g)[: vocab - 7]] = float("-inf")
        if trial % 7 == 2:   # ties
            row = row.round()
        if trial == 3:
            row[11] = float("nan")
        if trial == 4:
            row[17] = float("inf")
        key, position = noise.noise_key(trial), trial % 13
        want = int(first_argmax(row + noise.gumbel(key, position, vocab)))
        formed = noise.add_gumbel_(row.clone(), key, position)
        assert int(first_argmax(formed)) == want, trial
        if (trial % 5 == 1 or scale == 40.0) and trial not in (3, 4):   # only a few values got noise
            assert int(torch.isfinite(formed).sum()) < vocab // 2


def test_the_native_coupled_pick_is_the_torch_processing_and_pick():
    """kernel.coupled_picks (the verifier's coupled rows on a CPU) picks what process_logits followed by
    coupled_argmax picks: temperature, top-k, top-p whose nucleus lies within the first span and past it
    (flat rows), min-p and their mixes, over the real vocabulary's width."""
    from specdec.quant import kernel
    from specdec.sample.logits_processors import process_logits
    from specdec.sampling_params import SamplingParams
    if not kernel.available():
        pytest.skip(f"kernel unavailable: {kernel.unavailable_reason()}")
    g = torch.Generator().manual_seed(1)
    vocab = 151936
    settings = [(0.7, 0.95, 0, 0.0), (1.0, 1.0, 0, 0.0), (0.8, 0.9, 40, 0.0), (1.2, 1.0, 0, 0.05),
                (0.5, 0.5, 5, 0.1), (1.0, 0.99, 0, 0.0)]
    rows, params, want = [], [], []
    for trial in range(24):
        row = torch.randn(vocab, generator=g) * [0.5, 2.0, 5.0, 10.0][trial % 4]
        row[torch.randint(0, vocab, (5,), generator=g)] += [0.0, 12.0, 18.0][trial % 3]
        t, p, k, m = settings[trial % len(settings)]
        key, position = noise.noise_key(trial), 3 * trial
        sp = SamplingParams(temperature=t, top_p=p, top_k=k, min_p=m)
        want.append(noise.coupled_argmax(process_logits(row, sp, [], []), key, position))
        rows.append(row)
        params.append((t, p, m, k, key, position))
    assert kernel.coupled_picks(torch.stack(rows), params) == want
    assert [kernel.coupled_picks(r[None].contiguous(), [q])[0] for r, q in zip(rows[:4], params)] == want[:4]


def test_noise_is_standard_gumbel():
    g = noise.gumbel(noise.noise_key(0), 0, 1_000_000).double()
    assert abs(g.mean().item() - 0.5772157) < 0.005
    assert abs(g.var().item() - math.pi ** 2 / 6) < 0.01
    u = torch.exp(-torch.exp(-g))   # back to uniforms: flat over ten bins
    counts = torch.histc(u, bins=10, min=0, max=1)
    assert (counts / 1e5 - 1).abs().max() < 0.01


# ---------------------------------------------------------------------------------------------
# the toy simulation

def _noise_at(keys: torch.Tensor, position: int, broken: str | None) -> torch.Tensor:
    """[rows, V] log-space noise of output position `position`."""
    at = torch.full_like(keys, 0 if broken == "same_noise_every_position" else position)
    return noise.gumbel_table(keys, at, V)


def _round(prev: torch.Tensor, start: int, keys: torch.Tensor, logp: torch.Tensor, logq: torch.Tensor,
           broken: str | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One coupled round from output position `start`: K drafts, verified. (out [m, K + 1] padded
    with -1, num_accepted, drafts [m, K])."""
    m = prev.shape[0]
    prevs, drafts = [prev], []
    for j in range(K):
        drafts.append((logq[prevs[-1]] + _noise_at(keys, start + j, broken)).argmax(-1))
        prevs.append(drafts[-1])
    drafts_t = torch.stack(drafts, 1)
    rows = torch.stack([logp[p] + _noise_at(keys, start + j, broken) for j, p in enumerate(prevs)], 1)
    if broken == "accept_every_draft":  # the target's token never compared: the draft's samples come out
        rows = torch.nn.functional.one_hot(torch.cat([drafts_t, rows[:, -1:].argmax(-1)], 1), V).float()
    tokens, num_accepted = rejection_sample(drafts_t.flatten(), torch.full((m,), K), None,
                                            rows.flatten(0, 1).float(), torch.ones(m, dtype=torch.bool),
                                            torch.zeros(m * K), torch.zeros(m))
    out = torch.full((m, K + 1), -1, dtype=torch.long)
    for i, t in enumerate(tokens):
        out[i, :len(t)] = torch.tensor(t)
    return out, num_accepted, drafts_t


def simulate(case: str, broken: str | None = None, n: int = N) -> tuple[torch.Tensor, float]:
    """(counts [V, V] of (y1, y2), acceptance of the first draft)."""
    logp, logq = target_table().log().float(), draft_table(case).log().float()
    keys = torch.from_numpy(np.random.default_rng(7).integers(-2 ** 63, 2 ** 63 - 1, n, dtype=np.int64))
    out, num_accepted, _ = _round(torch.full((n,), CONTEXT), 0, keys, logp, logq, broken)
    y1, y2 = out[:, 0], out[:, 1].clone()
    again = (num_accepted == 0).nonzero()[:, 0]
    if again.numel():
        y2[again] = _round(y1[again], 1, keys[again], logp, logq, broken)[0][:, 0]
    return torch.bincount(y1 * V + y2, minlength=V * V).view(V, V), float((num_accepted > 0).double().mean())


@pytest.mark.parametrize("case", ["random", "q_zero", "subvocab"])
def test_coupled_speculation_matches_target(case):
    counts, accepted = simulate(case)
    p_value, tv = goodness_of_fit(counts, exact_joint())
    print(f"{case}: p-value={p_value:.4g} tv={tv:.4g} first-draft acceptance={accepted:.3f}")
    assert matches(p_value, tv), (p_value, tv)
    # the coupling's guarantee: P(accept) >= (1 - TV(p, q)) / (1 + TV(p, q)) at the first position
    p, q = target_table()[CONTEXT], draft_table(case)[CONTEXT]
    d = 0.5 * float((p - q).abs().sum())
    assert accepted >= (1 - d) / (1 + d) - 0.005


def test_q_equal_p_accepts_every_draft():
    counts, accepted = simulate("q_eq_p", n=20_000)
    assert accepted == 1.0


@pytest.mark.parametrize("broken", ["same_noise_every_position", "accept_every_draft"])
def test_broken_couplings_fail(broken):
    counts, _ = simulate("random", broken)
    p_value, tv = goodness_of_fit(counts, exact_joint())
    print(f"{broken}: p-value={p_value:.4g} tv={tv:.4g}")
    assert not matches(p_value, tv), (p_value, tv)


def test_the_output_does_not_depend_on_the_draft():
    """Drafter invariance: the same keys give the same (y1, y2) whichever draft proposed."""
    runs = [simulate(case, n=50_000)[0] for case in ("random", "q_zero", "q_eq_p")]
    assert all(torch.equal(runs[0], r) for r in runs[1:])
