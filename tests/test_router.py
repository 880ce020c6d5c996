"""The multi-draft router and the draft lifecycle, on tiny models: domain guesses on the shipped
sets, the bandit's choices from designed gains, switching when acceptance collapses, drafts that
load on first use, unload under load and fail to load, without a request failing or changing."""
from __future__ import annotations

import time
from collections import Counter

import pytest

from conftest import engine_config
from specdec.config import ControllerConfig, DraftConfig, RouterConfig, SpeculativeConfig
from specdec.llm import LLM
from specdec.prompts import PROMPTS_DIR, SETS, read_prompts_file
from specdec.request import SpecOptions
from specdec.sampling_params import SamplingParams
from specdec.speculation.router import DOMAINS, DraftRouter, guess_domain


def test_domain_guess_on_the_shipped_sets():
    for name in DOMAINS:   # every router domain has its set (agentic traffic mixes them)
        guesses = Counter(guess_domain(p) for p in read_prompts_file(str(PROMPTS_DIR / f"{name}.jsonl")))
        assert guesses[name] / sum(guesses.values()) >= 0.9, (name, guesses)
    templated = "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n写一首诗<|im_end|>\n"
    assert guess_domain(templated) == "zh"  # only the user turn counts
    assert set(DOMAINS) == set(SETS) - {"agentic"}


def test_bandit_tries_each_then_follows_the_measured_gain():
    r = DraftRouter(exploration=0.1)
    cands = ["draft-a", "ngram"]
    assert r.choose("code_edit", cands) == "ngram"      # prior: prompt lookup first on code edits
    r.observe("code_edit", "ngram", 30, 10.0)
    assert r.choose("code_edit", cands) == "draft-a"    # then the untried one
    r.observe("code_edit", "draft-a", 20, 10.0)
    assert [r.choose("code_edit", cands) for _ in range(5)] == ["ngram"] * 5
    assert r.choose("prose", cands) == "draft-a"         # elsewhere a draft model first
    r.observe("prose", "draft-a", 25, 10.0)
    assert r.choose("prose", cands) == "ngram"
    r.observe("prose", "ngram", 10, 10.0)
    assert r.choose("prose", cands) == "draft-a"
    # traffic drifts: the draft now loses on prose, and the discounted means follow
    for _ in range(20):
        r.observe("prose", "draft-a", 5, 10.0)
    assert r.choose("prose", cands) == "ngram"
    # a collapse mid-request moves to what the request has not tried; nothing left: None
    assert r.switch("prose", "draft-a", {"draft-a"}, cands) == "ngram"
    assert r.switch("prose", "ngram", {"draft-a", "ngram"}, cands) is None
    r.forget("draft-a")
    assert all(p != "draft-a" for _, p in r.arms)


def test_bandit_explores_an_arm_it_has_not_seen_for_long():
    r = DraftRouter(exploration=2.0)
    r.observe("chat", "a", 10, 10.0)
    r.observe("chat", "b", 9, 10.0)
    for _ in range(30):
        r.observe("chat", "a", 10, 10.0)
    assert r.choose("chat", ["a", "b"]) == "b"  # large bonus for the rarely observed arm


def _spec(**kw) -> SpeculativeConfig:
    return SpeculativeConfig(method="ngram", num_speculative_tokens=3, policy="fixed", **kw)


@pytest.fixture(scope="module")
def plain_llm(tiny_qwen):
    return LLM(config=engine_config(str(tiny_qwen)), progress=False)


def _run(llm: LLM, prompts: list[str], params: SamplingParams, method: str | None = None,
         between=None) -> list:
    eng = llm.engine
    ids = [eng.add_request(p, params, speculative=SpecOptions(method=method)).request_id for p in prompts]
    final, steps = {}, 0
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
        steps += 1
        if between is not None:
            between(steps)
    return [final[i] for i in ids]


PROMPTS = ["the cat sat on the mat, the cat sat on the", "once upon a time there was a", "a b c a b c a b"]


def test_a_draft_loads_on_first_use_and_unloads_under_load(tiny_qwen, tiny_llama, plain_llm):
    cfg = engine_config(str(tiny_qwen))
    cfg.speculative = _spec(draft=DraftConfig(extra_models=[str(tiny_llama)]))
    llm = LLM(config=cfg, progress=False)
    eng = llm.engine
    draft = "tiny-llama.gguf"
    assert draft not in eng.speculator.proposers and {d.id: d.state for d in eng.draft_status()}[draft] == "unloaded"
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ref = [o.token_ids for o in plain_llm.generate(PROMPTS, params)]

    def wait_for_load(step):  # a load takes a background thread; the engine steps on meanwhile
        if step == 1:
            eng.speculator.wait_loaded(timeout=60)
    outs = _run(llm, PROMPTS, params, method=draft, between=wait_for_load)
    assert [o.token_ids for o in outs] == ref
    assert draft in eng.speculator.proposers and sum(o.stats.drafted_tokens for o in outs) > 0
    assert all(o.stats.proposers_used == [draft] for o in outs)

    def unload(step):
        if step == 3:
            assert eng.unload_draft(draft) == draft
    outs = _run(llm, PROMPTS, params, method=draft, between=unload)
    assert [o.token_ids for o in outs] == ref            # nobody failed, nothing changed
    assert all(o.finish_reason == "length" for o in outs)
    assert draft not in eng.speculator.proposers and draft not in eng.speculator.pools
    assert {d.id: d.state for d in eng.draft_status()}[draft] == "unloaded"
    assert eng.kv.num_free_blocks() == eng.kv.num_blocks
    with pytest.raises(ValueError, match="not loaded"):
        eng.unload_draft(draft)
    with pytest.raises(ValueError, match="n-gram"):
        eng.unload_draft("ngram")


def test_a_draft_that_fails_to_load_is_reported_and_skipped(tiny_qwen, tmp_path, plain_llm):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    cfg = engine_config(str(tiny_qwen))
    cfg.speculative = _spec()
    llm = LLM(config=cfg, progress=False)
    eng = llm.engine
    assert eng.load_draft(str(bad)) == "broken.gguf"
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ref = [o.token_ids for o in plain_llm.generate(PROMPTS, params)]

    def wait(step):
        if step == 1:
            eng.speculator.wait_loaded(timeout=60)
    outs = _run(llm, PROMPTS, params, method="broken.gguf", between=wait)
    assert [o.token_ids for o in outs] == ref
    status = {d.id: d for d in eng.draft_status()}["broken.gguf"]
    assert status.state == "failed" and status.error
    assert eng.stats().speculation.num_load_failures == 1
    outs = _run(llm, PROMPTS[:1], params, method="broken.gguf")  # asked for again: plain, no retry
    assert outs[0].token_ids == ref[0] and outs[0].stats.method == "none"


def test_idle_drafts_unload(tiny_qwen, tiny_llama):
    cfg = engine_config(str(tiny_qwen))
    cfg.speculative = _spec(draft=DraftConfig(extra_models=[str(tiny_llama)], idle_seconds=0.2))
    eng = LLM(config=cfg, progress=False).engine
    eng.load_draft(str(tiny_llama))
    eng.speculator.wait_loaded(timeout=60)
    eng.poll_drafts()
    assert "tiny-llama.gguf" in eng.speculator.proposers
    time.sleep(0.3)
    eng.poll_drafts()
    assert "tiny-llama.gguf" not in eng.speculator.proposers and eng.stats().speculation.num_unloads == 1
    assert "ngram" in eng.speculator.proposers  # the configured proposer stays


def test_router_switches_a_request_whose_acceptance_collapses(tiny_qwen, tiny_llama, plain_llm):
    """n-gram lookup on text that never repeats accepts nothing: the health check trips and the
    router hands the request to the next proposer in the domain's prior order (the suffix lookup,
    which prices its own drafts) instead of decoding plainly."""
    cfg = engine_config(str(tiny_qwen))
    cfg.speculative = _spec(draft=DraftConfig(extra_models=[str(tiny_llama)]), router=RouterConfig(enabled=True),
                            controller=ControllerConfig(health_window=2, acceptance_threshold=0.99))
    llm = LLM(config=cfg, progress=False)
    eng = llm.engine
    eng.load_draft(str(tiny_llama))
    eng.speculator.wait_loaded(timeout=60)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompt = "Apply this change: rename x.\n```python\ndef f(x):\n    return x + 1\n```"
    assert guess_domain(prompt) == "code_edit"   # so the router starts with prompt lookup
    out = _run(llm, [prompt], params)[0]
    assert out.token_ids == plain_llm.generate([prompt], params)[0].token_ids
    assert out.stats.proposers_used == ["ngram[1-4]", "suffix"]
    assert eng.speculator.router.num_switches == 1 and out.stats.domain == "code_edit"
