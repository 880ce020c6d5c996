"""Suffix decoding and the hybrid proposer: the suffix index's matching and scoring, the shared
cache's budget, draft pricing, and on tiny models: output equal to plain decoding, the cache
carrying from one request to the next, surviving a draft's unload, and the hybrid's free share."""
from __future__ import annotations

import pytest

from conftest import engine_config
from specdec.config import SpeculativeConfig, SuffixConfig
from specdec.llm import LLM
from specdec.request import Request, SpecOptions
from specdec.sampling_params import SamplingParams
from specdec.speculation.costs import step_costs
from specdec.speculation.policy import best_k, expected_tokens
from specdec.speculation.proposers.suffix import SuffixProposer
from specdec.speculation.proposers.suffix_cache import DraftLimits, SuffixCache, SuffixIndex
from specdec.speculation.proposers.suffix_scopes import ScopedSuffixCache

LOOSE = DraftLimits(max_depth=32, min_prob=0.0, factor=8.0)


def _index(*seqs: list[int]) -> SuffixIndex:
    index = SuffixIndex()
    for i, s in enumerate(seqs):
        index.extend(i, s)
    return index


def test_the_longest_match_decides_the_continuation():
    # after (1 2 3) comes 4 twice and 9 once; but the context ends in (7 1 2 3), seen only before 9
    index = _index([1, 2, 3, 4, 1, 2, 3, 4, 7, 1, 2, 3, 9, 5])
    d = index.draft([0, 7, 1, 2, 3], 2, LOOSE)
    assert d.token_ids == [9, 5] and d.match_length == 4 and d.probs == [1.0, 1.0]
    d = index.draft([0, 8, 1, 2, 3], 1, LOOSE)   # only (1 2 3) matches: the frequent continuation
    assert d.token_ids == [4] and d.match_length == 3 and d.probs[0] == pytest.approx(2 / 3)


def test_draft_length_follows_the_match_and_the_probability():
    index = _index([5, 6, 7, 8, 9, 10, 11, 12])
    assert index.draft([6], 8, DraftLimits(factor=1.0, min_prob=0.0)).token_ids == [7]   # match of one
    assert index.draft([5, 6], 8, DraftLimits(factor=1.0, min_prob=0.0)).token_ids == [7, 8]
    assert index.draft([5, 6], 8, DraftLimits(factor=1.0, offset=2.0, min_prob=0.0)).token_ids == [7, 8, 9, 10]
    branchy = _index([1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2, 6])
    assert branchy.draft([1, 2], 4, DraftLimits(factor=8.0, min_prob=0.3)).token_ids == []  # 1/4 each
    assert branchy.draft([1, 2], 4, DraftLimits(factor=8.0, min_prob=0.2)).token_ids == [6]  # ties: most recent
    assert SuffixIndex().draft([1, 2], 4, LOOSE).token_ids == []


def test_the_context_itself_is_not_a_match():
    index = _index([1, 2, 3])
    assert index.draft([1, 2, 3], 4, LOOSE).token_ids == []


def test_the_shared_cache_keeps_to_its_budget():
    cache = SuffixCache(max_tokens=10)
    cache.add("a", [1, 2, 3, 4])
    cache.add("b", [5, 6, 7, 8])
    assert cache.draft([1, 2], 2, LOOSE).token_ids == [3, 4]
    cache.add("c", [9, 10, 11])                  # 11 tokens > 10: the oldest ("a") goes
    st = cache.stats()
    assert (st.num_sequences, st.num_tokens, st.num_evicted) == (2, 7, 1) and st.approx_bytes > 0
    assert cache.draft([1, 2], 2, LOOSE).token_ids == []
    assert all(e >> 32 != 0 for slots in cache.index.index.values() for e in slots)   # no stale entries
    assert st.num_index_entries == sum(len(v) for v in cache.index.index.values())
    cache.add("b", [5, 6, 7, 8, 12])             # the same request again (preempted, then longer)
    assert cache.stats().num_sequences == 2 and cache.draft([7, 8], 1, LOOSE).token_ids == [12]
    cache.clear()
    assert cache.stats().num_tokens == 0 and SuffixCache(0).draft([1], 1, LOOSE).token_ids == []


def test_pricing_keeps_drafts_only_where_they_pay():
    costs = [1.0 + 0.3 * m for m in range(9)]    # every verified row costs 0.3 of a step
    assert best_k([1.0] * 8, costs, 0.03)[0] == 8
    assert best_k([0.2] * 8, costs, 0.03)[0] == 0
    assert 0 < best_k([0.9, 0.9, 0.9, 0.2, 0.2], costs, 0.03)[0] <= 3
    assert expected_tokens([0.5, 0.5]) == pytest.approx(1.75)
    assert step_costs(None, 1, 2, 0.1) == pytest.approx([1.0, 1.1, 1.2])


class _Table:
    def estimate(self, rows: int) -> float:
        return 0.1 + 0.0001 * (rows - 1)   # an extra row costs almost nothing


def test_the_proposer_reads_other_requests_outputs_only_as_drafts():
    cache = ScopedSuffixCache(1000, max_scopes=4)
    cache.draft([], 1, LOOSE)     # the default scope drafts by suffix lookup, so it keeps outputs
    cache.add("earlier", [40, 41, 42, 43, 44, 45, 46, 47])
    spec = SpeculativeConfig(method="suffix", suffix=SuffixConfig(spec_factor=4.0))
    proposer = SuffixProposer(cache, spec, _Table())
    req = Request("now", None, [7, 8, 40, 41, 42], SamplingParams())
    drafts = proposer.propose([req], [4], [4])
    assert drafts.proposals[0].token_ids == [43, 44, 45, 46] and drafts.proposals[0].free
    assert req.all_token_ids == [7, 8, 40, 41, 42]      # nothing written into the request
    proposer.on_verified(req, 4, 4)
    assert proposer.calibration[1].hits == 4.0           # a match of three: the bucket of 2-3


class _DearRows:
    def estimate(self, rows: int) -> float:
        return 0.1 * rows   # each verified row costs a whole step: no draft pays


@pytest.mark.parametrize("policy, deterministic, drafted", [
    ("cost_model", False, 0),   # priced from the measured costs: nothing is worth verifying
    ("cost_model", True, 4),    # deterministic: the static costs, not the measured ones
    ("fixed", False, 4),        # fixed: the whole lookup, whatever it costs
])
def test_the_policy_decides_whether_measured_costs_trim_the_lookup(policy, deterministic, drafted):
    cache = ScopedSuffixCache(1000, max_scopes=4)
    cache.draft([], 1, LOOSE)
    cache.add("earlier", [40, 41, 42, 43, 44, 45, 46, 47] * 4)
    spec = SpeculativeConfig(method="suffix", policy=policy, suffix=SuffixConfig(spec_factor=4.0))
    spec.controller.deterministic = deterministic
    proposer = SuffixProposer(cache, spec, _DearRows())
    req = Request("now", None, [7, 8, 40, 41, 42, 43], SamplingParams())
    assert proposer.propose([req], [4], [4]).proposals[0].token_ids == [44, 45, 46, 47][:drafted]


def _suffix_llm(model: str, **spec) -> LLM:
    cfg = engine_config(model)
    cfg.speculative = SpeculativeConfig(**{"method": "suffix", **spec})
    return LLM(config=cfg, progress=False)


PROMPT = "alpha beta gamma delta alpha beta gamma delta alpha beta gamma"


def test_suffix_greedy_equals_plain_and_the_cache_carries(tiny_qwen):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = LLM(config=engine_config(str(tiny_qwen)), progress=False)
    llm = _suffix_llm(str(tiny_qwen))
    prompts = [PROMPT, "one two three four", PROMPT]
    outs = llm.generate(prompts, params, batch=False)
    for p, out in zip(prompts, outs):
        assert out.token_ids == plain.generate(p, params)[0].token_ids
        assert out.stats.method == "suffix"
    assert sum(o.stats.drafted_tokens for o in outs) > 0
    # the third request repeats the first: its output is found in the cache from the first token
    assert outs[2].stats.accepted_tokens >= outs[0].stats.accepted_tokens
    spec = llm.engine.stats().speculation
    (cache,) = spec.caches
    # each output after the last 8 tokens of its prompt
    assert cache.num_sequences == 3 and cache.max_tokens == 100_000
    assert cache.num_tokens == sum(24 + min(8, o.stats.prompt_tokens) for o in outs)
    llm.engine.speculator.clear_caches()
    assert llm.engine.stats().speculation.caches[0].num_tokens == 0


def test_suffix_sampled_and_batched_requests_equal_seeded_plain(tiny_qwen):
    # k fixed: the cost model prices drafts by measured time, so whether it drafts would vary
    llm = _suffix_llm(str(tiny_qwen), policy="fixed", num_speculative_tokens=3)
    plain = LLM(config=engine_config(str(tiny_qwen)), progress=False)
    params = [SamplingParams(max_tokens=16, temperature=0.8, seed=s, ignore_eos=True) for s in range(4)]
    outs = llm.generate([PROMPT] * 4, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate([PROMPT] * 4, params)]
    assert llm.engine.stats().speculation.free_drafts["suffix"].drafted_tokens > 0


def test_hybrid_equals_plain_and_its_cache_survives_the_unload(tiny_qwen, tiny_llama):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = LLM(config=engine_config(str(tiny_qwen)), progress=False)
    llm = _suffix_llm(str(tiny_qwen), method="hybrid", draft_model=str(tiny_llama))
    eng = llm.engine
    outs = llm.generate([PROMPT, "one two three four"], params, batch=False)
    for p, out in zip([PROMPT, "one two three four"], outs):
        assert out.token_ids == plain.generate(p, params)[0].token_ids
        assert out.stats.method == "hybrid"
    hybrid_id = eng.speculator.default_id
    assert hybrid_id == "hybrid:tiny-llama.gguf" and hybrid_id in eng.stats().speculation.pools
    before = eng.stats().speculation.caches[0].num_tokens
    assert before == sum(24 + min(8, o.stats.prompt_tokens) for o in outs)
    eng.unload_draft(hybrid_id)
    assert hybrid_id not in eng.speculator.proposers
    assert eng.stats().speculation.caches[0].num_tokens == before      # the shared cache stayed
    rid = eng.add_request(PROMPT, params, speculative=SpecOptions(method="suffix")).request_id
    out = {}
    while eng.has_unfinished():
        out.update({o.request_id: o for o in eng.step()})
    assert out[rid].token_ids == outs[0].token_ids and out[rid].stats.drafted_tokens > 0


def test_a_model_reference_can_name_the_new_kinds():
    from specdec.speculation.registry import resolve_config
    assert resolve_config(SpeculativeConfig(draft_model="suffix")).method == "suffix"
    spec = resolve_config(SpeculativeConfig(draft_model="hybrid:qwen2.5-coder-0.5b-instruct"))
    assert (spec.method, spec.draft_model) == ("hybrid", "qwen2.5-coder-0.5b-instruct")
    assert resolve_config(SpeculativeConfig(draft_model="hybrid")).draft_model is None
    with pytest.raises(ValueError, match=r"suffix\.min_prob"):
        SpeculativeConfig(method="suffix", suffix=SuffixConfig(min_prob=1.5))


def test_hybrid_sampled_batch_mixes_free_and_model_drafts(tiny_qwen, tiny_llama):
    """In one step some requests verify suffix drafts (point masses), others the model's drafts
    (with their distributions): every request finishes, with its own seed's text."""
    cfg = engine_config(str(tiny_qwen))
    cfg.speculative = SpeculativeConfig(method="hybrid", draft_model=str(tiny_llama), policy="fixed",
                                        num_speculative_tokens=3)
    llm = LLM(config=cfg, progress=False)
    prompts = [PROMPT, "one two three four", PROMPT, "the quick brown fox"]
    params = [SamplingParams(max_tokens=20, temperature=0.9, seed=s, ignore_eos=True) for s in range(4)]
    outs = llm.generate(prompts, params)
    again = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [20] * 4
    assert all(o.stats.drafted_tokens >= o.stats.free_drafted_tokens >= o.stats.free_accepted_tokens for o in outs)
    assert sum(o.stats.drafted_tokens - o.stats.free_drafted_tokens for o in outs + again) > 0   # the model drafted


def test_expected_output_lengths_follow_finished_requests():
    from specdec.speculation.costs import OutputLengths
    lengths = OutputLengths()
    assert lengths.expected_remaining("chat", 5, 200) == 200          # nothing known: the cap
    for n in (20, 30, 40):
        lengths.record("chat", n)
    assert lengths.expected_remaining("chat", 5, 200) == 25           # the median, 30, minus 5
    assert lengths.expected_remaining("chat", 50, 200) == 50          # past it: as many again
    assert lengths.expected_remaining("chat", 50, 10) == 10           # never past the cap
    assert lengths.expected_remaining("zh", 5, 200) == 200
