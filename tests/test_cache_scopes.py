"""Cache scopes (cache_salt, API keys): prefix-cache blocks and suffix-cache drafts shared only
within a scope; the suffix cache fed only where suffix drafting is used, each scope within its
budget; and the suffix cache saved and loaded (server.suffix_cache_path)."""
from __future__ import annotations

import json

import pytest

from conftest import engine_config
from specdec.config import SpeculativeConfig, SuffixConfig
from specdec.core.kv_cache_manager import KVCacheManager
from specdec.llm import LLM
from specdec.sampling_params import SamplingParams, cache_scope
from specdec.speculation import suffix_file
from specdec.speculation.proposers.suffix_cache import DraftLimits
from specdec.speculation.proposers.suffix_scopes import ScopedSuffixCache

LOOSE = DraftLimits(max_depth=32, min_prob=0.0, factor=8.0)
A, B = cache_scope("tenant-a"), cache_scope("b")
PROMPT = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma"


def test_a_scope_is_a_digest_and_no_salt_is_the_default_scope():
    assert cache_scope(None) == "" and len(A) == 32 and A != B and A == cache_scope("tenant-a")
    assert cache_scope("\ud800") != ""          # a lone surrogate (valid JSON) still names a scope
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="")


def test_prefix_blocks_are_found_only_in_their_scope():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    tokens = list(range(13))
    for rid, scope in (("r0", ""), ("r1", A)):
        kv.allocate(rid, len(tokens))
        kv.commit(rid, tokens, scope)
    assert len(kv.find_cached_prefix(tokens)) == 3 and len(kv.find_cached_prefix(tokens, A)) == 3
    assert kv.find_cached_prefix(tokens, B) == []
    assert set(kv.find_cached_prefix(tokens)).isdisjoint(kv.find_cached_prefix(tokens, A))


def test_suffix_scopes_keep_apart_and_only_where_suffix_drafts():
    cache = ScopedSuffixCache(max_tokens=100, max_scopes=3)
    cache.add("a0", [1, 2, 3, 4], A)             # no request of scope A has drafted by suffix: not kept
    assert cache.stats().num_tokens == 0 and cache.stats().num_scopes == 0
    assert cache.draft([1, 2], 2, LOOSE, A).token_ids == []
    cache.add("a1", [1, 2, 3, 4], A)
    assert cache.draft([1, 2], 2, LOOSE, A).token_ids == [3, 4]
    assert cache.draft([1, 2], 2, LOOSE, B).token_ids == []      # another scope: nothing of A's
    assert cache.draft([1, 2], 2, LOOSE).token_ids == []          # nor the default scope
    st = cache.stats()
    assert (st.num_scopes, st.num_sequences, st.num_tokens, st.max_tokens) == (3, 1, 4, 100)
    cache.draft([1], 1, LOOSE, A)
    cache.draft([9], 1, LOOSE, cache_scope("fourth"))  # past max_scopes: the least recently used (B) goes
    assert set(cache.scopes) == {A, "", cache_scope("fourth")} and cache.num_scopes_evicted == 1


def test_each_scope_has_the_whole_budget():
    cache = ScopedSuffixCache(max_tokens=6, max_scopes=4)
    for scope in (A, B):
        cache.draft([], 1, LOOSE, scope)
        cache.add("x", [1, 2, 3, 4], scope)
        cache.add("y", [5, 6, 7, 8], scope)      # 8 > 6: the scope's oldest output goes, not the other's
    st = cache.stats()
    assert (st.num_sequences, st.num_tokens, st.num_evicted) == (2, 8, 2)
    assert cache.state() == {A: [[5, 6, 7, 8]], B: [[5, 6, 7, 8]]}


def _suffix_llm(model: str) -> LLM:
    cfg = engine_config(model)
    cfg.speculative = SpeculativeConfig(method="suffix", suffix=SuffixConfig(spec_factor=4.0))
    return LLM(config=cfg, progress=False)


def _run(llm: LLM, salt: str | None):
    return llm.generate(PROMPT, SamplingParams(max_tokens=24, ignore_eos=True, cache_salt=salt))[0]


def test_another_salt_finds_nothing_cached_and_the_same_salt_shares_both(tiny_qwen):
    llm = _suffix_llm(str(tiny_qwen))
    cache, found = llm.engine.speculator.suffix_cache(), []
    lookup = cache.draft

    def spy(context, max_tokens, limits, scope=""):     # what each lookup of the shared cache found
        out = lookup(context, max_tokens, limits, scope)
        found.append((scope, len(out.token_ids)))
        return out

    cache.draft = spy
    first = _run(llm, "a")
    found.clear()
    other, unsalted = _run(llm, "b"), _run(llm, None)
    assert first.token_ids == other.token_ids == unsalted.token_ids      # exact either way
    # another salt (or none): no prefix blocks, no draft out of the first request's output
    assert other.stats.cached_prompt_tokens == 0 == unsalted.stats.cached_prompt_tokens
    assert found and {scope for scope, _ in found} == {B, ""} and all(n == 0 for _, n in found)
    found.clear()
    same = _run(llm, "a")
    # the same salt: the prompt's blocks, and the first output drafted from the first token on
    assert same.token_ids == first.token_ids and same.stats.cached_prompt_tokens > 0
    assert {scope for scope, _ in found} == {cache_scope("a")} and found[0][1] > 0
    st = llm.engine.stats().speculation.caches[0]
    assert st.num_scopes == 3 and st.num_sequences == 4     # a (two outputs), b, the default


def test_outputs_of_requests_that_never_draft_by_suffix_are_not_kept(tiny_qwen, tiny_llama):
    cfg = engine_config(str(tiny_qwen))
    cfg.speculative = SpeculativeConfig(method="draft_model", draft_model=str(tiny_llama))
    llm = LLM(config=cfg, progress=False)
    llm.generate([PROMPT, "one two three"], SamplingParams(max_tokens=8, ignore_eos=True))
    assert llm.engine.stats().speculation.caches[0].num_tokens == 0


# ---- saved and loaded ----------------------------------------------------------------------------
def _filled() -> ScopedSuffixCache:
    cache = ScopedSuffixCache(100, 4)
    for scope, tokens in (("", [1, 2, 3]), (A, [4, 5, 6, 7])):
        cache.draft([], 1, LOOSE, scope)
        cache.add("r", tokens, scope)
    return cache


def test_the_suffix_cache_round_trips_through_its_file(tmp_path):
    path = tmp_path / "suffix.json"
    assert suffix_file.save(path, _filled(), "tok1") == 7
    assert path.stat().st_mode & 0o777 == 0o600 and not list(tmp_path.glob(".*tmp"))
    assert "tenant-a" not in path.read_text()          # scopes by digest only
    back = ScopedSuffixCache(100, 4)
    assert suffix_file.load(path, back, "tok1", vocab_size=10) == 7
    assert back.state() == _filled().state()
    assert back.draft([4, 5], 2, LOOSE, A).token_ids == [6, 7]


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(version=2), "format version 2"),
    (lambda d: d.update(tokenizer="other"), "another tokenizer"),
    (lambda d: d.update(format="x"), "not a suffix cache file"),
    (lambda d: d["scopes"].update({"not-a-digest": []}), "scope"),
    (lambda d: d["scopes"][""].append([1, 99]), "token ids in 0..9"),
    (lambda d: d["scopes"][""].append([1, True]), "token ids"),
])
def test_a_file_it_cannot_trust_is_refused_whole(tmp_path, edit, message):
    path = tmp_path / "suffix.json"
    suffix_file.save(path, _filled(), "tok1")
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    cache = _filled()
    with pytest.raises(suffix_file.SuffixFileError, match=message):
        suffix_file.load(path, cache, "tok1", vocab_size=10)
    assert cache.state() == _filled().state()          # left as it was


def test_a_truncated_file_is_refused(tmp_path):
    path = tmp_path / "suffix.json"
    suffix_file.save(path, _filled(), "tok1")
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(suffix_file.SuffixFileError, match="not JSON"):
        suffix_file.load(path, ScopedSuffixCache(100, 4), "tok1", vocab_size=10)
