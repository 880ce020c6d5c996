"""Engine behaviour on a tiny random model: batching, prefix caching, chunked prefill, preemption,
stop conditions, streaming, seeds, aborts and bad requests."""
from __future__ import annotations

from dataclasses import replace

import pytest

from conftest import engine_config
from specdec.engine import LLMEngine
from specdec.llm import LLM
from specdec.sampling_params import SamplingParams

PROMPTS = ["hello there", "the cat sat on the mat and then it sat again", "a",
           "in the beginning " * 6, "xyz 123"]


def make_llm(path, **overrides) -> LLM:
    return LLM(config=engine_config(str(path), **overrides), progress=False)


@pytest.fixture(scope="module")
def tiny(tiny_qwen):
    return make_llm(tiny_qwen)


def ids(outs):
    return [o.token_ids for o in outs]


def test_batched_equals_one_by_one(tiny):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    assert ids(tiny.generate(PROMPTS, params, batch=True)) == ids(tiny.generate(PROMPTS, params, batch=False))


@pytest.mark.parametrize("overrides", [
    {"enable_prefix_caching": False},
    {"max_num_batched_tokens": 7},                  # chunked prefill, small budget
    {"long_prefill_token_threshold": 3},
    {"block_size": 1}, {"block_size": 32},
    {"max_batch_size": 1},
])
def test_scheduling_knobs_do_not_change_tokens(tiny, tiny_qwen, overrides):
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    ref = ids(tiny.generate(PROMPTS, params))
    other = make_llm(tiny_qwen, **overrides)
    assert ids(other.generate(PROMPTS, params)) == ref


def test_prefix_cache_hits_and_gives_same_tokens(tiny_qwen):
    llm = make_llm(tiny_qwen, block_size=4)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    prompt = "in the beginning was the word and the word was"
    first = llm.generate([prompt], params)[0]
    kv = llm.engine.kv
    assert kv.find_cached_prefix(llm.tokenizer.encode(prompt)), "finished request left no cached blocks"
    second = llm.generate([prompt], params)[0]
    assert second.token_ids == first.token_ids
    assert kv.num_free_blocks() == kv.num_blocks


@pytest.mark.parametrize("max_tokens", [1, 9])
def test_a_finished_request_leaves_every_computed_block_cached(tiny_qwen, max_tokens):
    """Including the blocks filled by its last step (the prompt itself, when it finishes at prefill)."""
    llm = make_llm(tiny_qwen, block_size=4)
    out = llm.generate(["one two three four five six seven eight nine ten"],
                       SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]
    computed = out.prompt_token_ids + out.token_ids[:-1]  # the last token never went through the model
    # (a lookup leaves at least one token to compute: ask with one more)
    assert len(llm.engine.kv.find_cached_prefix(computed + [0])) == len(computed) // 4


def test_preemption_keeps_outputs(tiny_qwen):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ref = ids(make_llm(tiny_qwen).generate(PROMPTS, params))
    small = make_llm(tiny_qwen, block_size=4, target_cache_blocks=30)
    assert ids(small.generate(PROMPTS, params)) == ref
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.kv.num_free_blocks() == 30


def test_blocks_all_free_after_finish_and_abort(tiny):
    eng: LLMEngine = tiny.engine
    eng.add_request("hello there", SamplingParams(max_tokens=50, ignore_eos=True), request_id="x")
    eng.add_request("another one", SamplingParams(max_tokens=3, ignore_eos=True), request_id="y")
    for _ in range(4):
        eng.step()
    eng.abort("x")
    while eng.has_unfinished():
        eng.step()
    assert eng.kv.num_free_blocks() == eng.kv.num_blocks
    assert all(r == 0 for r in eng.kv.pool.ref_cnt)


def test_max_tokens_and_stop_token_ids(tiny):
    out = tiny.generate(["hello"], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    free = tiny.generate(["hello"], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    stop_id = free.token_ids[7]
    cut = tiny.generate(["hello"], SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id]))[0]
    first = free.token_ids.index(stop_id)
    assert cut.finish_reason == "stop" and cut.token_ids == free.token_ids[: first + 1]


def test_stop_string_cuts_text_exactly(tiny):
    free = tiny.generate(["the"], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    text = free.text
    stop = text[10:13]
    if not stop.strip():
        pytest.skip("degenerate random text")
    out = tiny.generate(["the"], SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.find(stop)]
    assert len(out.token_ids) <= len(free.token_ids)


def test_stream_withholds_possible_stop_prefix(tiny):
    free = tiny.generate(["the"], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    stop = free.text[12:16] + "\u2603"  # starts like the text, never completes
    pieces = list(tiny.stream("the", SamplingParams(max_tokens=30, ignore_eos=True, stop=[stop])))
    assert "".join(p.delta_text for p in pieces) == free.text
    assert pieces[-1].finished
    for p in pieces[:-1]:
        assert not p.text.endswith(stop[:4]), "a possible stop prefix was shown early"


def test_seeded_sampling_reproducible_and_varied(tiny):
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=7, ignore_eos=True)
    a = tiny.generate(["hello"] * 3, p)
    b = tiny.generate(["hello"], p, batch=False)
    assert a[0].token_ids == a[1].token_ids == b[0].token_ids
    c = tiny.generate(["hello"], SamplingParams(temperature=1.0, max_tokens=16, seed=8, ignore_eos=True))[0]
    assert c.token_ids != a[0].token_ids


def test_never_samples_unused_tokens(tiny):
    out = tiny.generate(["x"] * 4, SamplingParams(temperature=2.0, max_tokens=64, ignore_eos=True, seed=1))
    bad = set(tiny.tokenizer.never_sample_ids)
    assert bad and not any(t in bad for o in out for t in o.token_ids)


def test_logprobs(tiny):
    out = tiny.generate(["hello"], SamplingParams(max_tokens=4, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and len(lp) == 3  # greedy token is the top one
        assert max(lp.values()) == lp[tok] <= 0.0


def test_bad_requests_are_refused_cleanly(tiny_qwen):
    llm = make_llm(tiny_qwen, max_model_len=64, target_cache_blocks=8, block_size=4)
    eng = llm.engine
    with pytest.raises(ValueError, match="context"):
        eng.add_request("word " * 100)
    with pytest.raises(ValueError, match="KV blocks"):
        eng.add_request("hi", SamplingParams(max_tokens=60))
    with pytest.raises(ValueError, match="vocabulary"):
        eng.add_request([1, 2, 10**6])
    with pytest.raises(ValueError, match="empty"):
        eng.add_request([])
    assert not eng.has_unfinished() and not eng.requests
    assert llm.generate(["ok"], SamplingParams(max_tokens=3))[0].token_ids


def test_stats_are_consistent(tiny):
    out = tiny.generate(["hello"], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    s = out.stats
    assert s.generated_tokens == 8 and s.prompt_tokens == len(out.prompt_token_ids)
    assert 0 < s.ttft_seconds <= s.seconds
    assert s.tokens_per_second == pytest.approx(8 / s.seconds)
    assert s.precision == "float32"


@pytest.mark.parametrize("prompt", [PROMPTS[1], PROMPTS[3]])
def test_parallel_samples_share_the_prompt_and_equal_separate_requests(tiny_qwen, prompt):
    """n choices of one prompt (sampled, fixed seeds): the first computes the prompt, the others share
    its blocks and compute only its last token; each choice equals the same request run alone."""
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True) for s in (1, 2, 3, 4)]
    alone = [ids(make_llm(tiny_qwen).generate(prompt, p)) for p in params]
    llm = make_llm(tiny_qwen, block_size=4)
    eng = llm.engine
    n_prompt = len(eng.tokenizer.encode(prompt))
    rows: list[int] = []
    execute = eng.runner.execute
    eng.runner.execute = lambda sched: (rows.append(sched.num_batched_tokens), execute(sched))[1]
    reqs = [eng.add_request(prompt, p) for p in params]
    assert [r.fork_of for r in reqs] == [None] + [reqs[0].request_id] * 3
    eng.step()                                          # the first computes the prompt alone
    assert rows == [n_prompt] and all(r.num_computed_tokens == 0 for r in reqs[1:])
    free_before = eng.kv.num_free_blocks()
    eng.step()                                          # the others join: one token each, blocks shared
    assert rows[1] == 1 + 3
    shared = (n_prompt - 1) // 4                        # full blocks before the prompt's last token
    assert all(eng.kv.block_tables[r.request_id][:shared] == eng.kv.block_tables[reqs[0].request_id][:shared]
               for r in reqs)
    # one block per sibling (a copy of the shared partial block, or a fresh one for the last token),
    # and one for the leader's next token if the prompt filled its last block
    assert free_before - eng.kv.num_free_blocks() == 3 + (n_prompt % 4 == 0)
    while eng.has_unfinished():
        eng.step()
    assert [r.output_token_ids for r in reqs] == [a[0] for a in alone]
    assert all(r.num_cached_tokens == n_prompt - 1 for r in reqs[1:])
    assert eng.kv.num_free_blocks() == eng.kv.num_blocks


@pytest.mark.parametrize("precision", ["float32", "int4-a8"])
def test_kv_cache_dtype(tiny_qwen, precision):
    """auto holds K/V in the model's dtype where the model has no measurement; a set format is used as
    given, recorded in every output's stats, and speculation stays exact under it."""
    from conftest import cpu_precision
    from specdec.config import CacheConfig, SpeculativeConfig
    cpu_precision(precision)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompt = [5, 17, 99, 3, 250, 41]
    for choice, want in (("auto", "float32"), ("float32", "float32"), ("float16", "float16"), ("int8", "int8")):
        config = engine_config(str(tiny_qwen), precision=precision, kv_cache_dtype=choice)
        plain = LLM(config=config).generate([prompt], params)[0]
        spec = LLM(config=replace(config, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3,
                                                                         policy="fixed"))).generate([prompt], params)[0]
        assert plain.stats.kv_cache_dtype == spec.stats.kv_cache_dtype == want
        assert spec.token_ids == plain.token_ids
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="fp8")
