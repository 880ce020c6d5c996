"""End to end on the real models: batching, prefix caching and chunked prefill never change tokens."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import engine_config, expected_auto_precision
from specdec.llm import LLM
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.real_model

PROMPTS = [
    "def quicksort(arr):",
    "Explain in one sentence what a hash map is.",
    "用一句话介绍一下Python。",
    "# A function that parses an ISO date string and returns a datetime\nimport datetime\n\n"
    "def parse_iso(s: str) -> datetime.datetime:\n    ",
]


@pytest.fixture(scope="module")
def llm05(qwen05_loaded):
    return LLM(config=engine_config("qwen2.5-coder-0.5b-instruct", target_cache_blocks=512), loaded=qwen05_loaded)


@pytest.fixture(scope="module")
def reference(llm05):
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    return [o.token_ids for o in llm05.generate(PROMPTS, params, batch=False)]


def test_batch_equals_one_by_one(llm05, reference):
    outs = llm05.generate(PROMPTS, SamplingParams(max_tokens=20, ignore_eos=True), batch=True)
    assert [o.token_ids for o in outs] == reference
    assert all(len(r) == 20 for r in reference)


@pytest.mark.parametrize("overrides", [
    {"enable_prefix_caching": False},
    {"max_num_batched_tokens": 16, "block_size": 8},  # chunked prefill beside decodes
])
def test_caching_and_chunking_do_not_change_tokens(qwen05_loaded, reference, overrides):
    llm = LLM(config=engine_config("qwen2.5-coder-0.5b-instruct", target_cache_blocks=512, **overrides),
              loaded=qwen05_loaded)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=20, ignore_eos=True))
    assert [o.token_ids for o in outs] == reference


def test_prefix_cache_hit_gives_same_tokens(llm05, reference):
    # the same prompts again: their full blocks come from the prefix cache this time
    outs = llm05.generate(PROMPTS, SamplingParams(max_tokens=20, ignore_eos=True))
    assert [o.token_ids for o in outs] == reference
    kv = llm05.engine.kv
    assert kv.num_free_blocks() == kv.num_blocks


def test_chat_stops_on_im_end(llm05):
    out = llm05.chat([{"role": "user", "content": "Reply with the single word: yes"}], SamplingParams(max_tokens=16))
    assert out.finish_reason == "stop" and out.token_ids[-1] in (151645, 151643)
    assert "yes" in out.text.lower() and "<|im_end|>" not in out.text


def test_cli_default_target_json():
    """The default model (the 1.5B target) through the CLI, as a user runs it."""
    r = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "--json", "--max-tokens", "6",
                        "def add(a, b):"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    line = json.loads(r.stdout.strip().splitlines()[-1])
    default = expected_auto_precision("qwen2.5-coder-1.5b-instruct")  # the CLI's auto precision
    assert line["stats"]["generated_tokens"] == 6 and line["stats"]["precision"] == default
    assert f"precision: {default}" in r.stderr and "qwen2.5-coder-1.5b-instruct" in r.stderr
