"""Seeded sampling under Gumbel coupling on tiny random models: speculative == plain token for token
for every proposer kind, k fixed and adaptive, alone and batched, after preemption; n choices and
engine-drawn seeds reproduce; rejection sampling stays available."""
from __future__ import annotations

import dataclasses

import pytest
from conftest import engine_config

from specdec.config import ControllerConfig, SamplingConfig, SpeculativeConfig
from specdec.llm import LLM
from specdec.sampling_params import SamplingParams

PROMPTS = ["hello there", "the cat sat on the mat and then the cat sat on the mat", "a", "in the beginning " * 6]
SAMPLED = SamplingParams(temperature=0.8, top_k=8, max_tokens=30, seed=1234, ignore_eos=True)


def llm_for(target, method=None, draft=None, k=3, policy="fixed", coupling="gumbel", **overrides):
    cfg = engine_config(str(target), **overrides)
    cfg.sampling = SamplingConfig(coupling)
    if method is not None:
        cfg.speculative = SpeculativeConfig(method=method, draft_model=str(draft) if draft else None,
                                            num_speculative_tokens=k, policy=policy,
                                            controller=ControllerConfig(acceptance_threshold=0.0))
    return LLM(config=cfg, progress=False)


@pytest.fixture(scope="module")
def plain(tiny_qwen):
    return llm_for(tiny_qwen)


def run(llm, params=SAMPLED, prompts=PROMPTS, batch=True):
    outs = llm.generate(prompts, [dataclasses.replace(params, seed=params.seed + i) for i in range(len(prompts))],
                        batch=batch)
    return [o.token_ids for o in outs], outs


@pytest.mark.parametrize("method,draft,k", [("draft_model", "tiny_qwen", 4), ("draft_model", "tiny_llama", 3),
                                            ("ngram", None, 3), ("suffix", None, 5), ("hybrid", "tiny_llama", 3)])
def test_seeded_speculative_equals_seeded_plain(plain, tiny_qwen, request, method, draft, k):
    ref, _ = run(plain)
    llm = llm_for(tiny_qwen, method, request.getfixturevalue(draft) if draft else None, k)
    for batch in (True, False):
        got, outs = run(llm, batch=batch)
        assert got == ref
    stats = [o.stats for o in outs]
    assert all(s.coupling == "gumbel" for s in stats)
    drafted, accepted = sum(s.drafted_tokens for s in stats), sum(s.accepted_tokens for s in stats)
    print(f"{method} {draft} k={k}: {accepted}/{drafted} drafts accepted")
    if draft == "tiny_qwen":   # its own distribution and the same noise: every draft is the target's token
        assert drafted > 0 and accepted == drafted
    elif method == "draft_model":  # both outcomes of verification are exercised
        assert 0 < accepted < drafted


def test_the_samples_are_samples(plain):
    """Not greedy in disguise: texts move with the seed and differ from greedy decoding."""
    greedy, _ = run(plain, dataclasses.replace(SAMPLED, temperature=0.0))
    a, _ = run(plain)
    b, _ = run(plain, dataclasses.replace(SAMPLED, seed=77))
    assert a != greedy and a != b and sum(x != y for x, y in zip(a, b)) >= 3


@pytest.mark.parametrize("policy", ["cost_model", "heuristic"])
def test_adaptive_k_keeps_the_text(plain, tiny_qwen, tiny_llama, policy):
    ref, _ = run(plain)
    for draft in (tiny_qwen, tiny_llama):
        assert run(llm_for(tiny_qwen, "draft_model", draft, 5, policy=policy))[0] == ref


def test_batched_with_greedy_and_other_sampled_requests(plain, tiny_qwen, tiny_llama):
    """A seeded request's text is its own whatever shares its steps (greedy, other seeds, other k)."""
    alone, _ = run(plain, prompts=PROMPTS[:1])
    llm = llm_for(tiny_qwen, "draft_model", tiny_llama, 4)
    others = [SamplingParams(max_tokens=25, ignore_eos=True), dataclasses.replace(SAMPLED, seed=99, top_k=0)]
    outs = llm.generate(PROMPTS[:1] + PROMPTS[1:3], [SAMPLED] + others)
    assert outs[0].token_ids == alone[0]


def test_natively_picked_rows_keep_the_text_beside_processed_ones(plain, tiny_qwen, tiny_llama):
    """Coupled rows are picked natively (temperature, filters and Gumbel-max in one kernel call) unless
    their request has a logit bias or penalties, which the torch processing takes: a request's text is
    the same with either kind beside it, and the same text as the torch path gives it alone."""
    from specdec.quant import kernel
    if not kernel.available():
        pytest.skip(f"kernel unavailable: {kernel.unavailable_reason()}")
    alone, _ = run(plain, prompts=PROMPTS[:1])
    llm = llm_for(tiny_qwen, "draft_model", tiny_llama, 4)
    assert llm.engine.verifier.picks is not None
    others = [dataclasses.replace(SAMPLED, seed=5, logit_bias={7: 2.0}),
              dataclasses.replace(SAMPLED, seed=6, repetition_penalty=1.3, top_p=0.9)]
    outs = llm.generate(PROMPTS[:3], [SAMPLED] + others)
    assert outs[0].token_ids == alone[0]
    torch_path = llm_for(tiny_qwen)
    torch_path.engine.verifier.picks = None
    assert run(torch_path, prompts=PROMPTS[:1])[0] == alone


def test_preemption_keeps_the_text(plain, tiny_qwen, tiny_llama):
    ref, _ = run(plain)
    small = llm_for(tiny_qwen, "draft_model", tiny_llama, 3, block_size=4, target_cache_blocks=30)
    assert run(small)[0] == ref
    assert small.engine.scheduler.num_preemptions > 0


def test_choices_differ_and_each_reproduces(plain):
    params = [dataclasses.replace(SAMPLED, choice=c) for c in (0, 1, 0)]
    outs = [o.token_ids for o in plain.generate([PROMPTS[1]] * 3, params)]
    assert outs[0] == outs[2] != outs[1]


def test_an_unseeded_request_records_the_seed_that_replays_it(plain, tiny_qwen, tiny_llama):
    free = plain.generate(PROMPTS[1], dataclasses.replace(SAMPLED, seed=None))[0]
    assert free.stats.seed is not None
    replay = llm_for(tiny_qwen, "draft_model", tiny_llama, 3).generate(
        PROMPTS[1], dataclasses.replace(SAMPLED, seed=free.stats.seed))[0]
    assert replay.token_ids == free.token_ids


def test_rejection_sampling_is_still_a_mode(tiny_qwen):
    llm = llm_for(tiny_qwen, "draft_model", tiny_qwen, 3, coupling="rejection")
    outs = llm.generate(PROMPTS, SAMPLED)
    assert all(o.stats.coupling == "rejection" for o in outs)
    assert [o.token_ids for o in outs] == [o.token_ids for o in llm.generate(PROMPTS, SAMPLED, batch=False)]
    with pytest.raises(ValueError, match="sampling.coupling"):
        SamplingConfig("bogus")
