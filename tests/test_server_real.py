"""The server with real models, driven by the official openai client: completions, chat, streaming,
per-request speculative control and usage; 16 concurrent clients whose greedy outputs equal the
offline LLM.generate outputs; and one request on the default pair (1.5B target, 0.5B draft)."""
from __future__ import annotations

import json
import random
import threading

import pytest
from openai import BadRequestError

from conftest import engine_config
from server_process import ServerProcess
from specdec.llm import LLM
from specdec.prompts import PROMPTS_DIR
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.real_model
MODEL = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture(scope="module")
def server05(tmp_path_factory):
    d = tmp_path_factory.mktemp("server05")
    s = ServerProcess(["--model", MODEL, "--precision", "float32", "--spec", "ngram", "-k", "3",
                       "--max-batch-size", "16"], d / "server.log")  # compared with float32 offline
    yield s
    s.stop()


def test_openai_client_completions_chat_streaming(server05, qwen05_loaded):
    c = server05.client()
    out = c.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=24, temperature=0)
    offline = LLM(config=engine_config(MODEL), loaded=qwen05_loaded, progress=False)
    ref = offline.generate("def fibonacci(n):", SamplingParams(max_tokens=24))[0]
    assert out.choices[0].text == ref.text and out.choices[0].finish_reason == ref.finish_reason
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids) and out.usage.completion_tokens == len(ref.token_ids)
    spec = out.model_extra["speculative"]
    assert spec["proposer"].startswith("ngram") and spec["drafted_tokens"] >= spec["accepted_tokens"] >= 0
    assert set(spec) >= {"proposer", "drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length"}

    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    chat = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    streamed = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    pieces, usage, reasons = [], None, []
    for chunk in streamed:
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            pieces.append(ch.delta.content or "")
            reasons.append(ch.finish_reason)
    assert "".join(pieces) == chat.choices[0].message.content and chat.choices[0].message.role == "assistant"
    assert usage.completion_tokens == chat.usage.completion_tokens and reasons[-1] == chat.choices[0].finish_reason

    # per-request control: speculation off, a cap on k, and a method this server did not load
    off = c.completions.create(model=MODEL, prompt="a b c a b c a b c", max_tokens=12, temperature=0,
                               extra_body={"speculative": {"enabled": False}})
    assert off.model_extra["speculative"]["drafted_tokens"] == 0
    capped = c.completions.create(model=MODEL, prompt="a b c a b c a b c", max_tokens=12, temperature=0,
                                  extra_body={"speculative": {"max_k": 1}})
    assert capped.choices[0].text == off.choices[0].text
    with pytest.raises(BadRequestError, match="not loaded"):
        c.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"speculative": {"method": "draft_model"}})


def _prompts(n: int) -> list[str]:
    lines = []
    for name in ("code_gen", "chat", "prose", "zh"):
        lines += [json.loads(x)["prompt"] for x in (PROMPTS_DIR / f"{name}.jsonl").read_text().splitlines()[:4]]
    rng = random.Random(0)
    return [p[: rng.randint(20, 200)] for p in lines[:n]]


def test_sixteen_concurrent_clients_match_offline(server05, qwen05_loaded):
    prompts = _prompts(16)
    rng = random.Random(1)
    max_tokens = [rng.randint(4, 24) for _ in prompts]
    results: dict[int, tuple[str, int]] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            c = server05.client(timeout=600)
            if i % 2:
                out = c.completions.create(model=MODEL, prompt=prompts[i], max_tokens=max_tokens[i], temperature=0)
                results[i] = (out.choices[0].text, out.usage.completion_tokens)
            else:  # half of them stream
                stream = c.completions.create(model=MODEL, prompt=prompts[i], max_tokens=max_tokens[i],
                                              temperature=0, stream=True)
                results[i] = ("".join(ch.choices[0].text for ch in stream if ch.choices), -1)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    assert not errors and len(results) == len(prompts)
    offline = LLM(config=engine_config(MODEL), loaded=qwen05_loaded, progress=False)
    ref = offline.generate(prompts, [SamplingParams(max_tokens=m) for m in max_tokens])
    for i, r in enumerate(ref):
        assert results[i][0] == r.text, i
        assert results[i][1] in (-1, len(r.token_ids))
    m = server05.wait_idle()
    assert m['specdec_kv_blocks_used{pool="target"}'] == 0
    assert m['specdec_requests_total{status="stop"}'] + m['specdec_requests_total{status="length"}'] >= 16
    assert m["specdec_time_to_first_token_seconds_count"] >= 16


def test_default_pair_server(tmp_path, qwen15_loaded):
    # the default pair, in the precision of the plain reference (the default, auto, picks int4-a16 on a CPU)
    s = ServerProcess(["--config", "configs/default.yaml", "--precision", "float32", "--spec-policy", "fixed", "-k", "3"],
                      tmp_path / "server.log")
    try:
        c = s.client(timeout=600)
        messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
        out = c.chat.completions.create(model=s.model, messages=messages, max_tokens=16, temperature=0)
        plain = LLM(config=engine_config("qwen2.5-coder-1.5b-instruct"), loaded=qwen15_loaded, progress=False)
        assert out.choices[0].message.content == plain.chat(messages, SamplingParams(max_tokens=16)).text
        spec = out.model_extra["speculative"]
        assert spec["proposer"] == "qwen2.5-coder-0.5b-instruct" and spec["drafted_tokens"] > 0
        m = s.wait_idle()
        assert m['specdec_kv_blocks_used{pool="draft:qwen2.5-coder-0.5b-instruct"}'] == 0
        assert m['specdec_spec_drafted_tokens_total{proposer="qwen2.5-coder-0.5b-instruct"}'] > 0
    finally:
        s.stop()
