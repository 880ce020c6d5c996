"""Speculative decoding end to end on the real default pair (1.5B target, 0.5B draft) in float32:
token-for-token equal to plain greedy decoding (and seeded sampling to seeded sampling), whatever k,
batch, proposer or policy."""
from __future__ import annotations

import pytest

from conftest import engine_config
from specdec.config import SpeculativeConfig
from specdec.llm import LLM
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.real_model

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
PROMPTS = [
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nWrite a SQL query that counts orders per customer.<|im_end|>\n<|im_start|>assistant\n",
    "The three laws of thermodynamics are",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        "
    "self.items.append(item)\n\n    def pop(self):\n        ",
]
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


def make(target_loaded, draft_loaded=None, method=None, k=3, policy="fixed", **cfg):
    config = engine_config(target_loaded.name, target_cache_blocks=256, **cfg)
    if method:
        config.speculative = SpeculativeConfig(method=method, draft_model=draft_loaded.name if draft_loaded else None,
                                               num_speculative_tokens=k, policy=policy)
    return LLM(config=config, loaded=target_loaded, draft_loaded=draft_loaded)


@pytest.fixture(scope="module")
def reference(qwen15_loaded):
    return [o.token_ids for o in make(qwen15_loaded).generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_draft_model_equals_plain(qwen15_loaded, qwen05_loaded, reference, k):
    llm = make(qwen15_loaded, qwen05_loaded, "draft_model", k)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert llm.generate(PROMPTS[:1], GREEDY, batch=False)[0].token_ids == reference[0]
    assert sum(o.stats.accepted_tokens for o in outs) > 0
    eng = llm.engine
    assert eng.kv.num_free_blocks() == eng.kv.num_blocks
    assert eng.speculator.proposers[eng.speculator.default_id].kv.num_free_blocks() == eng.speculator.proposers[eng.speculator.default_id].kv.num_blocks


@pytest.mark.parametrize("k", [1, 3, 5])
def test_ngram_equals_plain(qwen15_loaded, reference, k):
    llm = make(qwen15_loaded, None, "ngram", k)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert llm.generate(PROMPTS[3:], GREEDY, batch=False)[0].token_ids == reference[3]


def test_cost_model_policy_equals_plain(qwen15_loaded, qwen05_loaded, reference):
    llm = make(qwen15_loaded, qwen05_loaded, "draft_model", 4, policy="cost_model")
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference


def test_self_draft_accepts_every_token(qwen05_loaded):
    llm = make(qwen05_loaded, qwen05_loaded, "draft_model", 4)
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert out.stats.drafted_tokens > 0 and out.stats.acceptance_rate == 1.0


def test_seeded_sampling_equals_seeded_plain(qwen15_loaded, qwen05_loaded):
    """Gumbel coupling: the same seeded text with the draft model, with suffix drafts and without
    speculation, batched or alone."""
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=12, seed=3 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    ref = [o.token_ids for o in make(qwen15_loaded).generate(PROMPTS, params)]
    spec = make(qwen15_loaded, qwen05_loaded, "draft_model", 3)
    outs = spec.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == ref and sum(o.stats.accepted_tokens for o in outs) > 0
    assert spec.generate(PROMPTS[1:2], params[1:2], batch=False)[0].token_ids == ref[1]
    assert [o.token_ids for o in make(qwen15_loaded, None, "suffix", 4).generate(PROMPTS, params)] == ref


def test_stops_and_penalties_match_plain(qwen15_loaded, qwen05_loaded, reference):
    spec = make(qwen15_loaded, qwen05_loaded, "draft_model", 5)
    plain = make(qwen15_loaded)
    stop_id = reference[0][5]
    p = SamplingParams(max_tokens=16, ignore_eos=True, stop_token_ids=[stop_id])
    out = spec.generate(PROMPTS[0], p)[0]
    assert out.token_ids == reference[0][: reference[0].index(stop_id) + 1] and out.finish_reason == "stop"
    short = "<|im_start|>user\nWhat is 2 + 2? Answer with one number.<|im_end|>\n<|im_start|>assistant\n"
    chat = spec.generate(short, SamplingParams(max_tokens=40))[0]  # EOS inside an accepted block
    ref_chat = plain.generate(short, SamplingParams(max_tokens=40))[0]
    assert chat.finish_reason == "stop" and chat.token_ids[-1] == 151645
    assert (chat.token_ids, chat.text) == (ref_chat.token_ids, ref_chat.text)
    pen = SamplingParams(max_tokens=16, repetition_penalty=1.2, frequency_penalty=0.4, ignore_eos=True)
    assert spec.generate(PROMPTS[2:], pen)[0].token_ids == plain.generate(PROMPTS[2:], pen)[0].token_ids
    assert spec.engine.kv.num_free_blocks() == spec.engine.kv.num_blocks
