"""Speculative decoding on tiny random models: lossless greedy output, rollback in both caches,
stops inside accepted blocks, seeds, penalties, proposer failures, and the controller's policies."""
from __future__ import annotations

import dataclasses

import pytest
from conftest import cpu_precision, engine_config

from specdec.config import ControllerConfig, DraftConfig, SpeculativeConfig
from specdec.llm import LLM
from specdec.quant.layers import linear
from specdec.sampling_params import SamplingParams
from specdec.speculation.controller import SpecController
from specdec.speculation.proposers.ngram import ngram_lookup

PROMPTS = ["hello there", "the cat sat on the mat and then the cat sat on the mat", "a", "in the beginning " * 6]


def spec_llm(target, method="draft_model", draft=None, k=3, policy="fixed", **spec):
    cfg = engine_config(str(target))
    cfg.speculative = SpeculativeConfig(method=method, draft_model=str(draft) if draft else None,
                                        num_speculative_tokens=k, policy=policy, **spec)
    return LLM(config=cfg, progress=False)


@pytest.fixture(scope="module")
def plain(tiny_qwen):
    return LLM(config=engine_config(str(tiny_qwen)), progress=False)


def controlled(k: int, policy: str = "cost_model", **controller) -> SpeculativeConfig:
    """A config with k drafts at most and these controller knobs."""
    return SpeculativeConfig(num_speculative_tokens=k, policy=policy, controller=ControllerConfig(**controller))


def tokens(llm, params, prompts=PROMPTS, batch=True):
    return [o.token_ids for o in llm.generate(prompts, params, batch=batch)]


def assert_all_free(llm):
    eng = llm.engine
    assert eng.kv.num_free_blocks() == eng.kv.num_blocks
    draft_kv = getattr(eng.speculator.proposers[eng.speculator.default_id], "kv", None)
    if draft_kv is not None:
        assert draft_kv.num_free_blocks() == draft_kv.num_blocks
        assert all(r == 0 for r in draft_kv.pool.ref_cnt)


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method,draft", [("draft_model", "tiny_llama"), ("draft_model", "tiny_qwen"), ("ngram", None)])
def test_greedy_speculative_equals_plain(plain, tiny_qwen, request, method, draft, k):
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = tokens(plain, params)
    llm = spec_llm(tiny_qwen, method, request.getfixturevalue(draft) if draft else None, k)
    assert tokens(llm, params) == ref
    assert tokens(llm, params, batch=False) == ref
    assert_all_free(llm)


def test_self_draft_accepts_everything(tiny_qwen):
    llm = spec_llm(tiny_qwen, draft=tiny_qwen, k=4)
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=25, ignore_eos=True))[0]
    s = out.stats
    assert s.method == "draft_model" and s.drafted_tokens > 0
    assert s.acceptance_rate == 1.0 and s.mean_accepted_length > 3.0
    assert s.per_position_acceptance == [1.0] * 4


@pytest.mark.parametrize("policy", ["cost_model", "heuristic"])
def test_adaptive_policies_stay_lossless(plain, tiny_qwen, tiny_llama, policy):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for draft in (tiny_qwen, tiny_llama):
        llm = spec_llm(tiny_qwen, draft=draft, k=4, policy=policy)
        assert tokens(llm, params) == tokens(plain, params)
        assert_all_free(llm)


def test_seeded_sampling_with_fixed_policy_reproduces(tiny_qwen):
    params = SamplingParams(temperature=0.9, top_k=50, max_tokens=30, seed=11, ignore_eos=True)
    a = tokens(spec_llm(tiny_qwen, draft=tiny_qwen, k=3), params)
    b = tokens(spec_llm(tiny_qwen, draft=tiny_qwen, k=3), params, batch=False)
    assert a == b


def test_stops_inside_an_accepted_block(plain, tiny_qwen):
    free = plain.generate(PROMPTS[1], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    stop_id = free.token_ids[6]
    cut = free.token_ids[: free.token_ids.index(stop_id) + 1]
    llm = spec_llm(tiny_qwen, draft=tiny_qwen, k=5)  # self-draft: blocks of 6 tokens all accepted
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id]))[0]
    assert out.token_ids == cut and out.finish_reason == "stop"
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=9, ignore_eos=True))[0]
    assert out.token_ids == free.token_ids[:9] and out.finish_reason == "length"
    stop = free.text[8:12]
    if stop.strip():
        ref = plain.generate(PROMPTS[1], SamplingParams(max_tokens=30, ignore_eos=True, stop=[stop]))[0]
        out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=30, ignore_eos=True, stop=[stop]))[0]
        assert (out.text, out.token_ids, out.finish_reason) == (ref.text, ref.token_ids, "stop")
    assert_all_free(llm)


def test_penalties_same_with_and_without_speculation(plain, tiny_qwen, tiny_llama):
    params = SamplingParams(max_tokens=30, repetition_penalty=1.3, presence_penalty=0.5,
                            frequency_penalty=0.3, ignore_eos=True)
    ref = tokens(plain, params)
    for llm in (spec_llm(tiny_qwen, draft=tiny_qwen, k=3), spec_llm(tiny_qwen, "ngram", k=3),
                spec_llm(tiny_qwen, draft=tiny_llama, k=2)):
        assert tokens(llm, params) == ref


def test_logprobs_come_from_the_target(plain, tiny_qwen, tiny_llama):
    params = SamplingParams(max_tokens=12, logprobs=2, ignore_eos=True)
    ref = plain.generate(PROMPTS[0], params)[0]
    out = spec_llm(tiny_qwen, draft=tiny_llama, k=3).generate(PROMPTS[0], params)[0]
    assert out.token_ids == ref.token_ids
    for a, b in zip(out.logprobs, ref.logprobs):
        assert a.keys() == b.keys()
        assert all(abs(a[t] - b[t]) < 1e-6 for t in a)


class Boom:
    kind, name = "draft_model", "boom"

    def propose(self, requests, num_tokens, model_k):
        raise RuntimeError("draft exploded")

    def catch_up_tokens(self, request):
        return 0

    def on_verified(self, request, num_drafted, num_accepted):
        pass

    def free(self, request_id):
        pass


def test_proposer_failure_never_fails_a_request(plain, tiny_qwen):
    llm = spec_llm(tiny_qwen, "ngram", k=3)
    llm.engine.speculator.proposers["ngram"] = Boom()
    params = SamplingParams(max_tokens=15, ignore_eos=True)
    assert tokens(llm, params) == tokens(plain, params)
    assert llm.engine.stats().speculation.num_proposer_errors >= 1


def test_ngram_lookup():
    assert ngram_lookup([1, 2, 3, 9, 1, 2, 3], 2, 3, 1) == [9, 1]
    assert ngram_lookup([5, 1, 2, 7, 7, 1, 2], 3, 4, 1) == [7, 7, 1]  # most recent match of [1, 2]
    assert ngram_lookup([1, 2, 3], 2, 3, 2) == []
    assert ngram_lookup([4, 4], 3, 2, 1) == [4]


def test_controller_health_fallback_and_reprobe():
    c = SpecController(controlled(4, "fixed", health_window=4, reprobe_interval=3, reprobe_k=2))
    assert c.next_k("r", 0, 1) == 4
    for _ in range(4):
        c.observe("r", 4, 0)
    assert c.num_fallbacks == 1
    ks = [c.next_k("r", 10, 1) for _ in range(3)]
    assert ks == [0, 0, 2] and c.num_reprobes == 1
    c.observe("r", 2, 2)  # the probe succeeds
    assert c.next_k("r", 11, 1) == 4 and c.num_resumes == 1


def test_the_health_check_judges_at_least_two_drafts_per_step_of_its_window():
    """At k = 1 a window of health_window steps holds too few drafts to judge (3 of 8 happens by chance
    at a true acceptance of 0.65): the check waits until the window holds 2 * health_window drafts."""
    c = SpecController(controlled(1, "fixed", health_window=4, acceptance_threshold=0.5))
    for _ in range(7):
        c.observe("r", 1, 0)
        assert c.num_fallbacks == 0
    c.observe("r", 1, 0)  # 8 steps of one draft: the window is judged
    assert c.num_fallbacks == 1


def test_controller_heuristic_moves_k():
    c = SpecController(controlled(6, "heuristic", acceptance_threshold=0.0))
    k0 = c.next_k("r", 0, 1)
    for _ in range(10):
        c.observe("r", k0, k0)
    assert c.next_k("r", 0, 1) == k0 + 1
    for _ in range(10):
        c.observe("r", 4, 1)
    assert c.next_k("r", 0, 1) < k0 + 1


def test_cost_model_stops_speculating_when_it_does_not_pay():
    c = SpecController(controlled(4, acceptance_threshold=0.0, reprobe_interval=100))
    for rows in (4, 8, 12):
        c.verify_costs.record(rows, 0.1 * rows)   # verification grows with every scored row
    c.record_draft(1, 0.1)
    for _ in range(20):
        c.observe("r", 4, 0)              # and the drafts are (almost) never accepted
    assert c.next_k("r", 5, 1) == 0
    c2 = SpecController(controlled(4, acceptance_threshold=0.0))
    for rows in range(1, 9):
        c2.verify_costs.record(rows, 0.1)          # scoring up to 8 tokens costs one forward
    c2.record_draft(1, 0.01)
    for _ in range(20):
        c2.observe("r", 4, 4)
    assert c2.next_k("r", 5, 1) == 4


def test_long_output_guard_interleaves_plain_steps():
    c = SpecController(controlled(3, "fixed", plain_interval_after=10, plain_interval_steps=2))
    assert c.next_k("r", 5, 1) == 3
    assert [c.next_k("r", 20, 1) for _ in range(6)] == [3, 0, 0, 3, 0, 0]


def test_vocabulary_check():
    from specdec.speculation.proposers.draft_model import check_same_vocabulary
    target = ["a", "b", "c", "[PAD0]", "[PAD1]"]
    assert check_same_vocabulary(target, ["a", "b", "c"], "t", "d") == 3  # padded differently: fine
    with pytest.raises(ValueError, match="different vocabularies"):
        check_same_vocabulary(target, ["a", "x", "c"], "t", "d")


def test_mismatched_draft_is_refused_at_start(tiny_qwen, tmp_path, smollm_loaded):
    cfg = engine_config(str(tiny_qwen))
    cfg.speculative = SpeculativeConfig(method="draft_model", draft_model="smollm2-135m-instruct")
    with pytest.raises(ValueError, match="different vocabularies"):
        LLM(config=cfg, progress=False, draft_loaded=smollm_loaded)


def test_draft_pool_prefix_cache_skips_the_second_prefill(plain, tiny_qwen, tiny_llama):
    llm = spec_llm(tiny_qwen, draft=tiny_llama, k=3)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    prompt = PROMPTS[3] * 3  # several full blocks
    first = llm.generate(prompt, params)[0].token_ids
    proposer = llm.engine.speculator.proposers[llm.engine.speculator.default_id]
    req = llm.engine.add_request(prompt, params, request_id="again")
    assert proposer.catch_up_tokens(req) < proposer.kv.block_size  # all full blocks of the prompt are cached
    llm.engine.abort("again")
    assert llm.generate(prompt, params)[0].token_ids == first == tokens(plain, params, [prompt])[0]
    assert_all_free(llm)


def test_turning_prefix_caching_off_turns_off_the_drafts_cache_too(plain, tiny_qwen, tiny_llama):
    cfg = engine_config(str(tiny_qwen))
    cfg.cache.enable_prefix_caching = False
    cfg.speculative = SpeculativeConfig(draft_model=str(tiny_llama), num_speculative_tokens=3, policy="fixed")
    llm = LLM(config=cfg, progress=False)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    prompt = PROMPTS[3] * 3
    first = llm.generate(prompt, params)[0].token_ids
    req = llm.engine.add_request(prompt, params, request_id="again")
    assert llm.engine.speculator.proposers[llm.engine.speculator.default_id].catch_up_tokens(req) == len(req.prompt_token_ids)  # nothing was kept
    llm.engine.abort("again")
    assert llm.generate(prompt, params)[0].token_ids == first == tokens(plain, params, [prompt])[0]


def test_cost_model_prior_and_smoothing():
    c = SpecController(controlled(3, acceptance_threshold=0.0))
    for _ in range(10):
        c.observe("a", 3, 3)
    assert min(c.acceptance("b")) > 0.85   # a new request starts from what the draft achieved so far
    c.observe("a", 3, 0)
    assert c.acceptance("a")[0] > 0.75     # one miss after a long run of hits moves the estimate little
    for rows in range(1, 9):
        c.verify_costs.record(rows, 1.0)
    c.record_draft(1, 0.2)
    assert c.next_k("a", 10, 1, remaining=100) == 3


def test_cost_model_weighs_the_drafts_catch_up_against_the_remaining_tokens():
    c = SpecController(controlled(3, acceptance_threshold=0.0))
    for rows in range(1, 9):
        c.verify_costs.record(rows, 1.0)          # one target step: 1 s for up to 8 tokens
    c.record_draft(1, 0.2)
    c.record_draft(512, 20.0)                # the draft prefills ~25 tokens/s
    for _ in range(10):
        c.observe("r", 3, 3)
    # ~2.8 tokens per 1.6 s step saves ~0.43 s a token: 600 tokens of catch-up (~23 s) pay off only
    # when enough tokens remain
    assert c.next_k("r", 0, 1, remaining=20, catch_up=600) == 0
    assert c.next_k("r", 0, 1, remaining=200, catch_up=600) == 3
    assert c.next_k("r", 0, 1, remaining=20, catch_up=2) == 3


def test_acceptance_prior_is_kept_per_domain():
    """A new request starts from what the draft achieved on its own domain (code acceptance says little
    about prose), else over all domains."""
    c = SpecController(controlled(2, acceptance_threshold=0.0))
    c.next_k("code", 0, 1, domain="code_gen")
    c.next_k("prose", 0, 1, domain="prose")
    for _ in range(30):
        c.observe("code", 2, 2)
        c.observe("prose", 2, 0)
    c.next_k("code2", 0, 1, domain="code_gen")
    c.next_k("prose2", 0, 1, domain="prose")
    c.next_k("chat", 0, 1, domain="chat")
    code, prose, chat = (c.acceptance(r)[0] for r in ("code2", "prose2", "chat"))
    assert code > 0.9 and prose < 0.1 and prose < chat < code


def test_deterministic_cost_model_depends_on_counts_only():
    cfg = controlled(4, deterministic=True, acceptance_threshold=0.0)
    a, b = SpecController(cfg), SpecController(cfg)
    a.verify_costs.record(4, 0.1)
    b.verify_costs.record(4, 9.0)
    b.record_draft(1, 5.0)
    for c in (a, b):
        for accepted in (4, 2, 3, 0, 4):
            c.observe("r", 4, accepted)
    assert [a.next_k("r", 5, 1, 50, 0) for _ in range(5)] == [b.next_k("r", 5, 1, 50, 0) for _ in range(5)]


def test_cost_model_backs_off_when_the_batch_is_large():
    c = SpecController(controlled(3, acceptance_threshold=0.0))
    for rows in range(1, 65):
        c.verify_costs.record(rows, 0.1 * max(1.0, rows / 8))  # flat up to 8 rows, then linear in rows
    for rows in range(1, 17):
        c.record_draft(rows, 0.02 * max(1.0, rows / 8))
    for _ in range(10):
        c.observe("r", 3, 2)
    assert c.next_k("r", 5, 1, remaining=100) > 0    # alone: verification of 4 tokens costs one step
    assert c.next_k("r", 5, 16, remaining=100) == 0  # 16 requests x 4 tokens: verification is not free


def test_abort_frees_both_pools(tiny_qwen, tiny_llama):
    llm = spec_llm(tiny_qwen, draft=tiny_llama, k=3)
    eng = llm.engine
    req = eng.add_request(PROMPTS[3], SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(4):
        eng.step()
    assert eng.speculator.proposers[eng.speculator.default_id].kv.num_free_blocks() < eng.speculator.proposers[eng.speculator.default_id].kv.num_blocks
    eng.abort(req.request_id)
    assert_all_free(llm) and not eng.has_unfinished()


@pytest.mark.parametrize("precision", ["float32", "int4"])
def test_subvocab_draft_is_lossless_and_scores_only_its_tokens(tiny_qwen, tiny_llama, precision):
    """A draft restricted to a frequent-token sub-vocabulary: cheaper output layer, scores no token
    outside it but the request's own, and speculative greedy output still equals plain."""
    import torch
    cpu_precision(precision)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = LLM(config=engine_config(str(tiny_qwen), precision=precision), progress=False)
    cfg = engine_config(str(tiny_qwen), precision=precision)
    cfg.speculative = SpeculativeConfig(method="draft_model", draft_model=str(tiny_llama), num_speculative_tokens=3,
                                        policy="fixed", draft=DraftConfig(vocab_size=256))
    llm = LLM(config=cfg, progress=False)
    proposer = llm.engine.speculator.proposers[llm.engine.speculator.default_id]
    model = proposer.runner.model
    ids = model.vocab_ids
    vocab = model.cfg.vocab_size
    assert ids is not None and len(ids) == 256 < vocab and torch.equal(ids, ids.sort().values)
    assert set(plain.engine.loaded.tokenizer.eos_token_ids) <= set(ids.tolist())
    assert model.lm_head.shape[0] == 256
    logits = model.compute_logits(torch.randn(model.row_align, model.cfg.hidden_size, device=model.device))
    outside = torch.ones(vocab, dtype=torch.bool, device=model.device)
    outside[ids] = False
    assert logits.shape == (model.row_align, vocab) and torch.isinf(logits[:, outside]).all()
    assert torch.isfinite(logits[:, ids]).all()
    # and a prompt of tokens outside it, which that request's draft then scores too
    outside[proposer.runner.never_sample] = False
    prompts = [*PROMPTS, outside[:proposer.vocab_size].nonzero()[:12, 0].tolist()]
    ref = tokens(plain, params, prompts)
    request_vocab, widened = proposer.request_vocab, []
    take_in = request_vocab.take_in
    request_vocab.take_in = lambda rid, *text: (take_in(rid, *text),
                                                widened.append(request_vocab._requests[rid].ids is not None))
    greedy = llm.generate(prompts, params)
    assert [o.token_ids for o in greedy] == ref and any(widened)
    sampled = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=1.0, seed=3, ignore_eos=True))
    assert all(len(o.token_ids) == 20 for o in sampled)
    assert all(o.stats.drafted_tokens > 0 for o in greedy + sampled)  # no proposer failure
    assert_all_free(llm)


@pytest.mark.parametrize("precision", ["float32", "int4"])
def test_a_subvocab_draft_also_scores_each_requests_own_tokens(tiny_qwen, tiny_llama, precision):
    """Tokens of a request's prompt and output outside the sub-vocabulary get the full output layer's
    logits for that request only; never-sample ids stay unscored."""
    import torch
    cpu_precision(precision)
    cfg = engine_config(str(tiny_qwen), precision=precision)
    cfg.speculative = SpeculativeConfig(method="draft_model", draft_model=str(tiny_llama), num_speculative_tokens=3,
                                        policy="fixed", draft=DraftConfig(vocab_size=256))
    llm = LLM(config=cfg, progress=False)
    proposer = llm.engine.speculator.proposers[llm.engine.speculator.default_id]
    model, vocab = proposer.runner.model, proposer.request_vocab
    hidden = torch.randn(model.row_align, model.cfg.hidden_size)
    restricted = model.compute_logits(hidden)[0]
    full = linear(hidden, vocab.full, options=model.options)[0].float()
    never = proposer.runner.never_sample.tolist()
    inside = set(model.vocab_ids.tolist())
    outside = [t for t in range(proposer.vocab_size) if t not in inside and t not in never]
    a, b, c = outside[:3]
    vocab.take_in("a", [a, b, a, never[0], min(inside)], [])   # one already scored, one never to be
    vocab.take_in("a", [a, b], [c])                           # the prompt once; only new output after
    row = restricted.clone()
    vocab.score("a", row, hidden[0])
    assert torch.equal(row[[a, b, c]], full[[a, b, c]])
    assert torch.isinf(row[never[0]]) and vocab._requests["a"].ids.tolist() == [a, b, c]
    assert (row != restricted).nonzero()[:, 0].tolist() == [a, b, c]
    other = restricted.clone()
    vocab.score("b", other, hidden[0])   # another request: its own tokens only
    assert torch.equal(other, restricted)
    # an output that keeps falling outside what was scored: the whole vocabulary from then on
    text = [min(inside)] * 6 + outside[3:6]   # 3 of 9 outside (0.33 > MAX_MISSED)
    vocab.take_in("z", [], text[:7])
    assert not vocab.whole("z")
    vocab.take_in("z", [], text)
    assert vocab.whole("z")
    row = restricted.clone()
    vocab.score("z", row, hidden[0])
    expect = full.clone()
    expect[proposer.runner.never_sample] = float("-inf")
    assert torch.equal(row, expect)
    vocab.free("a")
    assert "a" not in vocab._requests


@pytest.mark.parametrize("precision", ["float32", "int4"])
def test_greedy_drafts_from_a_subvocab_are_the_picks_over_the_whole_row(tiny_qwen, tiny_llama, precision):
    """Greedy drafts keep the sub-vocabulary's logits as they are (no vocabulary-wide row), in one C++
    call a propose (the draft chain) or one forward a position: the same drafts as the whole row with
    the request's own tokens written in, in every case that row has."""
    import types

    import torch
    from specdec.speculation.proposers import draft_model
    cpu_precision(precision)
    cfg = engine_config(str(tiny_qwen), precision=precision)
    cfg.speculative = SpeculativeConfig(method="draft_model", draft_model=str(tiny_llama), num_speculative_tokens=3,
                                        policy="fixed", draft=DraftConfig(vocab_size=256))
    runs = []
    for mode in ("chain", "lean", "whole row"):
        llm = LLM(config=cfg, progress=False)
        proposer = llm.engine.speculator.proposers[llm.engine.speculator.default_id]
        seen, propose = [], proposer.propose

        def recorded(*args, propose=propose, seen=seen):
            drafts = propose(*args)
            seen.append([p.token_ids for p in drafts.proposals])
            return drafts
        proposer.propose = recorded
        if mode != "chain":
            proposer.runner.model.options = dataclasses.replace(proposer.runner.model.options, draft_chain=False)
        if mode == "whole row":
            proposer._lean = lambda *a: False
        chained, draft_chain = [], proposer.runner.draft_chain
        proposer.runner.draft_chain = lambda *a, f=draft_chain, chained=chained: chained.append(a) or f(*a)
        widths, execute = [], proposer.runner.execute
        proposer.runner.execute = lambda sched, sub_vocab=False, execute=execute, widths=widths: \
            widths.append((out := execute(sched, sub_vocab)).logits.shape[1]) or out
        outside = torch.ones(proposer.vocab_size, dtype=torch.bool)
        outside[proposer.runner.model.vocab_ids] = False
        outside[proposer.runner.never_sample] = False
        prompts = [*PROMPTS, outside.nonzero()[:12, 0].tolist()]  # a request with tokens of its own
        out = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
        runs.append((seen, [o.token_ids for o in out]))
        assert set(widths) == {"chain": set(), "lean": {256}, "whole row": {proposer.runner.model.cfg.vocab_size}}[mode]
        # the chain: one C++ call a propose, with the own-token rows of a request that has some
        assert bool(chained) == (mode == "chain")
        assert mode != "chain" or any(c.own_head is not None for a in chained for c in a[0])
    assert runs[0] == runs[1] == runs[2] and sum(len(d) for step in runs[0][0] for d in step) > 0
    # each case on its own: no tokens of its own, some, the whole vocabulary
    model, vocab = proposer.runner.model, proposer.request_vocab
    inside = set(model.vocab_ids.tolist())
    others = [t for t in outside.nonzero()[:, 0].tolist() if t not in inside]
    vocab.take_in("own", others[:4], [])
    vocab.take_in("whole", [], [min(inside)] * 6 + others[4:7])
    assert vocab.whole("whole")
    for rid in ("none", "own", "whole"):
        for seed in range(4):
            hidden = torch.randn(model.row_align, model.cfg.hidden_size, generator=torch.Generator().manual_seed(seed))
            sub = model.compute_logits(hidden, scatter=False)[0].index_fill_(0, proposer.runner.never_sub, float("-inf"))
            row = model.compute_logits(hidden)[0].index_fill_(0, proposer.runner.never_sample, float("-inf"))
            vocab.score(rid, row, hidden[0])
            req = types.SimpleNamespace(request_id=rid)
            assert proposer._greedy(req, sub, hidden[0], model.vocab_ids) == int(row[: proposer.vocab_size].argmax())
    # ties go to the smaller id and NaN wins, as a whole row's argmax
    assert max((1.0, 7), (1.0, 3), key=draft_model._max_key) == (1.0, 3)
    assert max((2.0, 1), (float("nan"), 9), key=draft_model._max_key)[1] == 9


@pytest.mark.parametrize("precision", ["float32", "int4"])
def test_the_draft_chain_proposes_what_one_forward_a_position_does(tiny_qwen, tiny_llama, precision):
    """Lean greedy drafts past the first run in one C++ call: the same drafts, the same draft cache and
    the same draft forwards as one engine round trip a position, whatever each request's k, over
    rounds with rollbacks in between, with and without tokens of a request's own."""
    import torch
    from specdec.request import Request
    cpu_precision(precision)
    cfg = engine_config(str(tiny_qwen), precision=precision)
    cfg.speculative = SpeculativeConfig(method="draft_model", draft_model=str(tiny_llama), num_speculative_tokens=6,
                                        policy="fixed", draft=DraftConfig(vocab_size=256))
    runs = []
    for chain in (True, False):
        speculator = LLM(config=cfg, progress=False).engine.speculator
        proposer = speculator.proposers[speculator.default_id]
        if not chain:
            proposer.runner.model.options = dataclasses.replace(proposer.runner.model.options, draft_chain=False)
        calls, draft_chain = [], proposer.runner.draft_chain
        proposer.runner.draft_chain = lambda *a, f=draft_chain, calls=calls: calls.append(a) or f(*a)
        outside = torch.ones(proposer.vocab_size, dtype=torch.bool)
        outside[proposer.runner.model.vocab_ids] = False
        outside[proposer.runner.never_sample] = False
        prompts = [[5, 6, 7, 8, 9], list(range(40, 71)), outside.nonzero()[:9, 0].tolist()]
        reqs = [Request(f"r{i}", None, p, SamplingParams(max_tokens=64)) for i, p in enumerate(prompts)]
        seen = []
        for ks in ([4, 1, 6], [2, 5, 3], [6, 6, 6]):
            drafts = proposer.propose(reqs, ks, ks)
            seen.append(([p.token_ids for p in drafts.proposals], [rows for rows, _ in drafts.forward_costs],
                         dict(proposer.kv.num_slots)))
            for req, p in zip(reqs, drafts.proposals):  # keep a prefix of each, as verification would
                kept = p.token_ids[: len(p.token_ids) // 2]
                req.output_token_ids += kept + [7]
                proposer.on_verified(req, len(p.token_ids), len(kept))
        runs.append(seen)
        assert len(calls) == (3 if chain else 0)
    assert runs[0] == runs[1]
    assert [len(d) for d in runs[0][0][0]] == [4, 1, 6] and runs[0][0][1][1:] == [2, 2, 2, 1, 1]


def _chain_proposers(tiny_qwen, tiny_llama, coupling: str, k: int) -> dict[bool, object]:
    """Two draft proposers of one sub-vocabulary draft, the draft chain on (True: each call to it
    recorded in its `chained`) and off."""
    from specdec.config import SamplingConfig
    cfg = engine_config(str(tiny_qwen))
    cfg.sampling = SamplingConfig(coupling=coupling)
    cfg.speculative = SpeculativeConfig(method="draft_model", draft_model=str(tiny_llama), num_speculative_tokens=k,
                                        policy="fixed", draft=DraftConfig(vocab_size=256))
    proposers = {}
    for chain in (True, False):
        speculator = LLM(config=cfg, progress=False).engine.speculator
        proposers[chain] = speculator.proposers[speculator.default_id]
        runner = proposers[chain].runner
        if not chain:
            runner.model.options = dataclasses.replace(runner.model.options, draft_chain=False)
        runner.chained, draft_chain = [], runner.draft_chain
        runner.draft_chain = lambda *a, f=draft_chain, seen=runner.chained: seen.append(a) or f(*a)
    return proposers


def _own_prompt(proposer) -> list[int]:
    """A prompt with tokens outside the draft's sub-vocabulary (scored as the request's own)."""
    import torch
    outside = torch.ones(proposer.vocab_size, dtype=torch.bool)
    outside[proposer.runner.model.vocab_ids] = False
    outside[proposer.runner.never_sample] = False
    return [5, 6, 7, 8, 9] + outside.nonzero()[:9, 0].tolist()


def test_drafts_drawn_in_the_chain_follow_the_distribution_it_returns(tiny_qwen, tiny_llama):
    """Drafts drawn on the C++ side (rejection coupling): q is the Python processing of the same logits
    (temperature, top-k, top-p, min-p over the sub-vocabulary and the request's own tokens), and the
    picks follow q (chi-squared over 1500 seeded draws)."""
    import collections

    import torch
    from scipy import stats
    from specdec.request import Request
    proposers = _chain_proposers(tiny_qwen, tiny_llama, "rejection", 2)
    prompt = _own_prompt(proposers[True])
    params = SamplingParams(temperature=1.3, top_k=40, top_p=0.9, min_p=0.01, max_tokens=64)
    qs = {}
    for chain, proposer in proposers.items():
        drafts = proposer.propose([Request("q", None, prompt, params)], [2], [2])
        qs[chain] = drafts.proposals[0].probs
        proposer.free("q")
    assert qs[True].shape == qs[False].shape == (2, proposers[True].vocab_size)
    assert torch.allclose(qs[True][0], qs[False][0], atol=1e-6)
    assert qs[True][0].sum().item() == pytest.approx(1, abs=1e-5)
    proposer, q, n = proposers[True], qs[True][0], 1500
    counts = collections.Counter()
    for seed in range(n):
        req = Request(f"s{seed}", None, prompt, SamplingParams(temperature=1.3, top_k=40, top_p=0.9, min_p=0.01,
                                                               max_tokens=64, seed=seed))
        counts[proposer.propose([req], [1], [1]).proposals[0].token_ids[0]] += 1
        proposer.free(req.request_id)
    assert all(q[t] > 0 for t in counts) and (q > 0).sum() > 3
    common = [t for t in (q > 0).nonzero()[:, 0].tolist() if q[t] * n >= 5]
    observed = [counts[t] for t in common] + [n - sum(counts[t] for t in common)]
    expected = [float(q[t]) * n for t in common] + [n - sum(float(q[t]) * n for t in common)]
    if expected[-1] < 1e-9:
        observed, expected = observed[:-1], expected[:-1]
    assert stats.chisquare(observed, expected).pvalue > 1e-3
    assert len(proposer.runner.chained) == n + 1 and not proposers[False].runner.chained


def test_gumbel_coupled_drafts_in_the_chain_are_the_python_picks(tiny_qwen, tiny_llama):
    """Coupled drafts picked on the C++ side (the target's positional Gumbel noise over the processed
    logits, computed only where it can win) are the tokens the Python side picks, position after
    position, batched with a greedy request."""
    from specdec.request import Request
    from specdec.sample.noise import noise_key
    proposers = _chain_proposers(tiny_qwen, tiny_llama, "gumbel", 4)
    prompt = _own_prompt(proposers[True])
    picks = {}
    for chain, proposer in proposers.items():
        picks[chain] = []
        for seed in range(12):
            params = SamplingParams(temperature=0.5 + seed / 4, top_p=0.95 if seed % 2 else 1.0, top_k=seed * 5,
                                    min_p=0.02 if seed % 3 == 0 else 0.0, max_tokens=64, seed=seed)
            reqs = [Request(f"c{seed}", None, prompt, params, noise_key=noise_key(seed)),
                    Request(f"g{seed}", None, prompt[:7], SamplingParams(max_tokens=64))]
            picks[chain].append([p.token_ids for p in proposer.propose(reqs, [4, 2], [4, 2]).proposals])
            for req in reqs:
                proposer.free(req.request_id)
    assert picks[True] == picks[False] and len({tuple(p[0]) for p in picks[True]}) > 3
    assert len(proposers[True].runner.chained) == 12 and not proposers[False].runner.chained


@pytest.mark.parametrize("target_precision, draft_precision", [("float32", "int4-a8"), ("int4", "float32"),
                                                              ("float32", "bfloat16")])
def test_a_draft_in_another_precision_is_lossless(tiny_qwen, tiny_llama, target_precision, draft_precision):
    """The draft's numbers only change what gets accepted: a fast int4-a8 draft can serve a float32 target."""
    cpu_precision(target_precision)
    cpu_precision(draft_precision)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = tokens(LLM(config=engine_config(str(tiny_qwen), precision=target_precision), progress=False), params)
    cfg = engine_config(str(tiny_qwen), precision=target_precision)
    cfg.speculative = SpeculativeConfig(method="draft_model", draft_model=str(tiny_llama), num_speculative_tokens=3,
                                        policy="fixed", draft=DraftConfig(precision=draft_precision))
    llm = LLM(config=cfg, progress=False)
    assert llm.engine.speculator.proposers[llm.engine.speculator.default_id].loaded.precision == draft_precision
    assert llm.engine.loaded.precision == target_precision
    out = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in out] == ref and all(o.stats.precision == target_precision for o in out)
    assert sum(o.stats.drafted_tokens for o in out) > 0
    controller = next(iter(llm.engine.speculator.controllers.values()))
    assert controller.draft_costs.row_align == llm.engine.speculator.proposers[llm.engine.speculator.default_id].runner.model.row_align
    assert_all_free(llm)


def test_draft_precision_is_validated(tiny_qwen):
    with pytest.raises(ValueError, match=r"draft\.precision"):
        SpeculativeConfig(draft=DraftConfig(precision="fp8"))
    cfg = engine_config(str(tiny_qwen), precision="float32")
    cfg.speculative = SpeculativeConfig(method="draft_model", draft_model="self:skip=1-1",
                                        draft=DraftConfig(precision="int4"))
    with pytest.raises(ValueError, match="self-speculation runs the target's own weights"):
        LLM(config=cfg, progress=False)


def test_draft_vocab_size_is_validated():
    for bad in (10, "most", 4096.0):
        with pytest.raises(ValueError, match=r"draft\.vocab_size"):
            SpeculativeConfig(draft=DraftConfig(vocab_size=bad))


def test_auto_sub_vocabulary_where_it_cuts_a_tenth_of_a_draft_step(tiny_qwen, monkeypatch):
    """`vocab_size: auto` scores AUTO_SIZE tokens where the rows left out are a tenth or more of a draft
    step's multiply-adds, the whole vocabulary elsewhere (and always when it is no larger)."""
    import math

    import torch
    from specdec.models.llama import LlamaModel
    from specdec.models.loader import load_model
    from specdec.speculation.proposers import subvocab
    loaded = load_model(str(tiny_qwen), "float32", progress=False)
    cfg = loaded.config
    model = LlamaModel(cfg, loaded.weights, 64, torch.device("cpu"))
    layers = sum(math.prod(w.shape) for n, w in loaded.weights.items() if n.startswith("layers.") and w.dim() == 2)
    monkeypatch.setattr(subvocab, "AUTO_SIZE", 64)
    share = (cfg.vocab_size - 64) * cfg.hidden_size / (layers + cfg.vocab_size * cfg.hidden_size)
    for cut, expect in ((share * 0.99, 64), (share * 1.01, None)):
        monkeypatch.setattr(subvocab, "AUTO_MIN_CUT", cut)
        assert subvocab.auto_vocab_size(model, cfg.vocab_size) == expect
    assert subvocab.auto_vocab_size(model, 64) is None


def test_self_auto_refuses_a_model_too_shallow_to_skip(tiny_qwen):
    cfg = engine_config(str(tiny_qwen))  # two layers: nothing between the kept edges
    cfg.speculative = SpeculativeConfig(method="draft_model", draft_model="self:auto")
    with pytest.raises(ValueError, match="too few layers"):
        LLM(config=cfg, progress=False)


def test_self_draft_references_parse_and_candidates_keep_the_edges():
    from specdec.speculation.proposers.self_draft import candidates, format_skip, parse_skip
    assert parse_skip("self:skip=3-5,9", 12) == frozenset({3, 4, 5, 9})
    assert format_skip(frozenset({3, 4, 5, 9})) == "self:skip=3-5,9-9"
    assert parse_skip("self:auto", 12) is None and parse_skip("self", 12) is None
    for bad in ("self:skip=5-20", "self:skip=x", "self:drop=3", "self:skip=0-11"):
        with pytest.raises(ValueError):
            parse_skip(bad, 12)
    for skip in candidates(28):
        assert min(skip) >= 2 and max(skip) <= 25 and len(skip) in (7, 9, 14)


@pytest.mark.parametrize("reference", ["self:skip=2-3", "self:auto"])
def test_self_draft_is_lossless(tiny_dir, reference, tmp_path, monkeypatch):
    """The target with layers skipped drafts for itself: shared weights, own KV pool, exact output."""
    from tiny_gguf import write_tiny_gguf
    target = tiny_dir / "tiny-qwen2-6l.gguf"
    if not target.exists():
        write_tiny_gguf(target, arch="qwen2", seed=4, num_layers=6)
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))  # self:auto measures and caches here
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = tokens(LLM(config=engine_config(str(target)), progress=False), params)
    cfg = engine_config(str(target))
    cfg.speculative = SpeculativeConfig(method="draft_model", draft_model=reference, num_speculative_tokens=3,
                                        policy="fixed")
    llm = LLM(config=cfg, progress=False)
    proposer = llm.engine.speculator.proposers[llm.engine.speculator.default_id]
    assert proposer.name.startswith("self:skip=") and proposer.loaded is llm.engine.loaded  # no second copy
    assert proposer.runner.model.skip_layers
    assert tokens(llm, params) == ref
    assert_all_free(llm)
    if reference == "self:auto":
        assert list((tmp_path / "self-draft").glob("*.json"))


def test_cost_table_follows_the_runners_row_padding():
    """float32 pads rows to 4 (1-4 rows cost the same); int4 does not, so each row is priced."""
    from specdec.speculation.costs import CostTable
    padded, exact = CostTable(row_align=4), CostTable(row_align=1)
    for t in (padded, exact):
        t.record(1, 0.10)
        t.record(4, 0.40)
    assert padded.estimate(2) == 0.40                 # one key for 1..4 rows: the newest timing
    assert exact.estimate(1) == 0.10 and exact.estimate(4) == 0.40
    assert exact.estimate(2) == pytest.approx(0.20)   # interpolated between measured row counts
    c = SpecController(SpeculativeConfig(), row_align=1)
    assert c.verify_costs.row_align == 1 and c.draft_costs.row_align == 1


def test_one_slow_forward_does_not_move_a_cost():
    """The plain step's cost is not measured again while a request speculates: one outlier (the thread
    tuner trying one thread, a page fault) must not make plain decoding look slow from then on."""
    from specdec.speculation.costs import CostTable
    t = CostTable(row_align=1)
    for s in (0.45, 0.20, 0.20, 0.20, 0.45):  # a cold first forward, then one try of one thread
        t.record(1, s)
        assert t.estimate(1) == (0.45 if s == 0.45 and len(t._recent[1]) == 1 else 0.20)
    for _ in range(2):
        t.record(1, 0.45)  # most of the last five: a real change, which it follows
    assert t.estimate(1) == 0.45


def test_no_row_count_is_priced_above_a_larger_ones_measurement():
    """One slow forward at 4 rows (a noisy neighbour) must not price 4 rows above 5: the controller
    would then avoid 3 drafts and never measure 4 rows again."""
    from specdec.speculation.costs import CostTable
    t = CostTable(row_align=1)
    for rows, s in ((1, 0.034), (2, 0.042), (3, 0.041), (4, 0.072), (5, 0.043), (9, 0.060)):
        t.record(rows, s)
    assert [t.estimate(n) for n in (1, 2, 3, 4, 5)] == [0.034, 0.041, 0.041, 0.043, 0.043]
    assert t.estimate(7) == pytest.approx(0.0515) and t.estimate(12) == pytest.approx(0.080)


def _measured(cfg, verify, draft, accepted, draft_cost_ratio=None):
    """A cost-model controller with measured (rows, seconds) costs and 20 steps of 4 drafts, each
    with `accepted` of them accepted."""
    c = SpecController(cfg, draft_cost_ratio=draft_cost_ratio, row_align=1)
    for rows, seconds in verify:
        c.verify_costs.record(rows, seconds)
    for rows, seconds in draft:
        c.record_draft(rows, seconds)
    for _ in range(20):
        c.observe("r", 4, accepted)
    return c


def test_cost_model_probes_only_while_a_probe_could_pay():
    """A draft nearly as slow as the target (int4 on a small CPU): even with every draft accepted,
    speculation would not clear min_gain, so no probes (each would make the draft catch up on the
    tokens it skipped, for nothing)."""
    cfg = controlled(4, acceptance_threshold=0.0, reprobe_interval=4)
    # perfect acceptance: 5 tokens per 1.03 s against 0.21 s a token plain
    c = _measured(cfg, ((1, 0.21), (2, 0.40), (3, 0.55), (4, 0.60), (5, 0.65), (17, 2.3), (64, 8.6)),
                  ((1, 0.095), (17, 0.55), (57, 2.5)), accepted=4)
    assert [c.next_k("r", 10 + i, 1, remaining=1000, catch_up=2 + i) for i in range(40)] == [0] * 40
    assert c.num_reprobes == 0
    # a draft that would pay with perfect acceptance, but not enough tokens remain to repay its catch-up
    slow = _measured(cfg, ((1, 0.21), (5, 0.45), (17, 2.3)), ((1, 0.05), (17, 0.9)), accepted=0)
    ks = [slow.next_k("r", 10 + i, 1, remaining=5, catch_up=17) for i in range(8)]
    assert ks == [0] * 8 and slow.num_reprobes == 0
    # enough tokens remain, but a probe would pay a catch-up of 17 tokens on a best-case bet: not with
    # the remaining tokens known and this domain's acceptance measured (the expected saving decides);
    # with a catch-up of k + 1 tokens it probes, and on a domain never verified it explores
    assert [slow.next_k("r", 10 + i, 1, remaining=500, catch_up=17) for i in range(8)] == [0] * 8
    # ... at its first plain step: the catch-up only grows while it waits
    assert slow.next_k("new", 10, 1, remaining=500, catch_up=17, domain="zh") == 2
    assert 2 in [slow.next_k("r", 20 + i, 1, remaining=500, catch_up=2) for i in range(8)]
    assert 2 in [slow.next_k("r", 30 + i, 1, remaining=None, catch_up=17) for i in range(8)]
    # one failed probe on a domain leaves its acceptance uncertain: a request with a large catch-up
    # probes again (at the doubled interval), where twenty failures above kept it plain
    once = _measured(cfg, ((1, 0.21), (5, 0.45), (17, 2.3)), ((1, 0.05), (17, 0.9)), accepted=0)
    once.domain_counts.clear()
    once.observe("first", 2, 0)
    assert 2 in [once.next_k("r2", 10 + i, 1, remaining=500, catch_up=17) for i in range(12)]
    # a model-free proposer (no catch-up, drafts for free) on the same target still probes
    lookup = _measured(cfg, ((1, 0.21), (5, 0.65), (17, 2.3)), ((1, 1e-5),), accepted=0, draft_cost_ratio=0.0)
    assert 2 in [lookup.next_k("r", 10 + i, 1, remaining=100, catch_up=0) for i in range(8)]
    # and a draft that is cheap enough goes back to drafting
    cheap = _measured(cfg, ((1, 0.21), (5, 0.30), (17, 0.9)), ((1, 0.01), (17, 0.1)), accepted=4)
    assert cheap.next_k("r", 10, 1, remaining=100, catch_up=2) == 4


def test_cost_model_learns_what_whole_steps_cost():
    """The forward costs predict a gain (the bench's chat prompts on int4: 2-row verification priced
    from 1 row and a prefill, one 1-row draft), but whole speculative steps measure 30% more than
    their forwards (the draft's 2-row catch-up, sampling over the vocabulary): the controller scales
    its prediction by what steps measured and goes back to plain decoding."""
    cfg = controlled(4, acceptance_threshold=0.0, reprobe_interval=1000)
    c = _measured(cfg, ((1, 0.20), (2, 0.27), (5, 0.50), (40, 3.2)), ((1, 0.05),), accepted=1)
    k = c.next_k("r", 10, 1, remaining=100)
    assert k == 1  # forwards alone: (0.05 + 0.27) s for 2 tokens beats 0.20 s a token
    for _ in range(5):
        c.record_step(0, 1, 0.206)  # plain steps: 3% over their forward
        c.record_step(k, 1, 1.3 * c._forward_cost(k, 1))
    assert c.step_ratio[0] == pytest.approx(1.03) and c.step_ratio[k] == pytest.approx(1.3)
    assert c.next_k("r", 11, 1, remaining=100) == 0
    # an unmeasured k is priced with the last speculative step's ratio, not the plain steps'
    other = next(j for j in range(1, 5) if j != k)
    assert c._step_cost(other, 1) == pytest.approx(1.3 * c._forward_cost(other, 1))
    # static costs (deterministic mode) ignore wall times
    d = SpecController(controlled(4, deterministic=True))
    d.record_step(2, 1, 5.0)
    assert d.step_ratio == {} and d._step_cost(2, 1) == d._forward_cost(2, 1)


def test_speculation_that_loses_in_wall_time_holds_plain_decoding():
    """Whatever the forward costs predict, a request whose speculative steps cost more wall time per
    emitted token than a plain step holds plain decoding for a probe interval, doubled each time;
    steps that win, or lose within min_gain (noise), leave it speculating. Deterministic mode ignores
    wall times."""
    from specdec.speculation.controller import _REALIZED_WINDOW as window
    cfg = controlled(4, acceptance_threshold=0.0, reprobe_interval=8)
    c = _measured(cfg, ((1, 0.20), (2, 0.27), (5, 0.50), (40, 3.2)), ((1, 0.05),), accepted=1)
    k = c.next_k("r", 10, 1, remaining=1000)
    assert k > 0
    plain = c._step_cost(0, 1)
    for _ in range(window):  # winning: 2 tokens for 1.5 plain steps
        c.record_request_step("r", k, 1, 1.5 * plain, 2)
    assert c.states["r"].hold == 0 and c.next_k("r", 11, 1, remaining=1000) > 0
    for _ in range(window):  # a 2 % loss: 2 tokens for 2.04 plain steps
        c.record_request_step("r", k, 1, 2.04 * plain, 2)
    assert c.states["r"].hold == 0
    for _ in range(window):  # losing: 2 tokens for 2.2 plain steps
        c.record_request_step("r", k, 1, 2.2 * plain, 2)
    assert c.states["r"].hold == 8
    assert [c.next_k("r", 12 + i, 1, remaining=1000) for i in range(8)] == [0] * 8
    assert c.next_k("r", 20, 1, remaining=1000) > 0  # the prediction decides again ...
    for _ in range(window):
        c.record_request_step("r", k, 1, 2.2 * plain, 2)
    assert c.states["r"].hold == 16  # ... and losing again waits twice as long
    d = SpecController(controlled(4, deterministic=True))
    for _ in range(8):
        d.record_request_step("r", 2, 1, 100.0, 1)
    assert d._state("r").hold == 0


def test_engine_times_whole_decode_steps_for_the_cost_model(tiny_qwen):
    cfg = engine_config(str(tiny_qwen))
    cfg.speculative = SpeculativeConfig(method="ngram", num_speculative_tokens=3, policy="fixed")
    llm = LLM(config=cfg, progress=False)
    llm.generate(["the cat sat on the mat and then the cat sat on the mat"], SamplingParams(max_tokens=24,
                                                                                            ignore_eos=True))
    ratios = next(iter(llm.engine.speculator.controllers.values())).step_ratio
    assert ratios and all(r > 0 for r in ratios.values())
    assert any(k > 0 for k in ratios)  # speculative steps were timed, not only plain ones


def test_forwards_on_a_thread_count_being_tried_are_no_cost_measurement(tiny_qwen, monkeypatch):
    """The tuner's tries (one thread on a 2-core machine) would make plain decoding look slow to the
    cost model, which measures the plain step rarely while a request speculates."""
    from specdec.runner.threads import ThreadTuner
    cfg = engine_config(str(tiny_qwen))
    cfg.speculative = SpeculativeConfig(method="ngram", num_speculative_tokens=3, policy="fixed")
    llm = LLM(config=cfg, progress=False)
    tuner = llm.engine.runner.tuner = ThreadTuner(2)
    for rows in (1, 4, 64):
        tuner.record(rows, 2, 0.01)  # a warm-up, not measured
        tuner.record(rows, 2, 0.01)
    # every forward tries the count that is not the best so far
    monkeypatch.setattr(tuner, "choose", lambda rows: 1 if tuner.best(rows) == 2 else 2)
    llm.generate(["the cat sat on the mat and then the cat sat on the mat"], SamplingParams(max_tokens=8))
    controller = next(iter(llm.engine.speculator.controllers.values()))
    assert controller.verify_costs.seconds == {} and controller.step_ratio == {}


def test_failed_probes_back_off():
    """n-gram lookup on prose: each probe verifies k + 1 rows and finds nothing; the wait before the
    next doubles (16, 32, 64 plain steps), and a probe that finds acceptance resets it."""
    cfg = controlled(4, reprobe_interval=16)
    c = _measured(cfg, ((1, 0.20), (3, 0.36), (5, 0.54), (40, 3.2)), ((1, 1e-5),), accepted=0, draft_cost_ratio=0.0)
    probes = []
    for i in range(16 + 32 + 64):
        if c.next_k("r", 10 + i, 1, remaining=1000) > 0:
            probes.append(i)
            c.observe("r", 2, 0)
    assert probes == [15, 47, 111]
    st = c.states["r"]
    assert st.failed_probes == 3
    st.plain_steps = c._probe_interval(st) - 1
    assert c.next_k("r", 200, 1, remaining=1000) == 2
    c.observe("r", 2, 2)  # the text turned repetitive: probes come at the base interval again
    assert st.failed_probes == 0 and c._probe_interval(st) == 16


def test_cost_model_needs_a_margin_to_speculate():
    """A predicted gain inside `min_gain` is noise in the measured costs: stay plain."""
    for min_gain, speculates in ((0.0, True), (0.03, False)):
        cfg = controlled(4, acceptance_threshold=0.0, min_gain=min_gain, reprobe_interval=1000)
        c = _measured(cfg, ((1, 0.21), (5, 0.65)), ((1, 0.09),), accepted=4)
        # best k: 0.204 s a token against 0.21 s plain, a 2.9% gain
        assert (c.next_k("r", 10, 1, remaining=100) > 0) == speculates
    with pytest.raises(ValueError, match=r"controller\.min_gain"):
        SpeculativeConfig(controller=ControllerConfig(min_gain=1.0))


def test_drafts_the_budget_cannot_hold_are_trimmed(plain, tiny_qwen, tiny_llama):
    """Drafts are proposed before scheduling; a token budget too small for every request's k + 1
    rows trims some requests' drafts (sampled drafts keep their distribution row for row)."""
    cfg = engine_config(str(tiny_qwen), max_num_batched_tokens=6)
    cfg.speculative = SpeculativeConfig(method="draft_model", draft_model=str(tiny_llama), num_speculative_tokens=3,
                                        policy="fixed")
    llm = LLM(config=cfg, progress=False)
    greedy = SamplingParams(max_tokens=10, ignore_eos=True)
    assert tokens(llm, greedy) == tokens(plain, greedy)
    sampled = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, seed=3)
    outs = llm.generate(PROMPTS, sampled)
    assert all(len(o.token_ids) == 10 for o in outs) and sum(o.stats.drafted_tokens for o in outs) > 0
    pool = llm.engine.speculator.pools["tiny-llama.gguf"]
    assert pool.num_free_blocks() == pool.num_blocks  # every draft slot given back


def test_the_draft_feeds_exactly_the_tokens_past_what_its_cache_holds():
    """The tokens a draft forward feeds: (prompt + output + drafts)[seen:], wherever `seen` falls."""
    import itertools
    import types

    from specdec.speculation.proposers.draft_model import _tail
    for p, o, d in itertools.product(range(4), repeat=3):
        req = types.SimpleNamespace(prompt_token_ids=list(range(p)), output_token_ids=list(range(10, 10 + o)))
        drafts = list(range(20, 20 + d))
        for seen in range(p + o + d + 2):
            assert _tail(req, drafts, seen) == (req.prompt_token_ids + req.output_token_ids + drafts)[seen:]
