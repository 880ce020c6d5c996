"""The server as vLLM users expect it: x-request-id on every answer and one access-log line per
request, /tokenize /detokenize /version, logit_bias (exact under speculation), null content, tool
calls cut off by max_tokens, offline /docs, model_name on every metric, and /metrics behind the key.
On the tiny random model, in process (Starlette's TestClient)."""
from __future__ import annotations

import hashlib
import logging
import re

import pytest
from conftest import engine_config
from fastapi.testclient import TestClient

from specdec.config import ServerConfig, SpeculativeConfig
from specdec.engine import LLMEngine
from specdec.llm import LLM
from specdec.sampling_params import SamplingParams
from specdec.server.app import build_app
from specdec.server.async_engine import AsyncEngine
from specdec.server.metrics import read_samples
from server_process import started_client

KEY = "vllm-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
NOW = {"type": "function", "function": {"name": "now", "description": "the time"}}


def _client(model, config: ServerConfig):
    return started_client(lambda: LLMEngine(engine_config(str(model)), progress=False), config)


@pytest.fixture(scope="module")
def client(tiny_qwen):
    c, engine = _client(tiny_qwen, ServerConfig(api_key=KEY, metrics_require_key=True))
    with c:
        yield c
    engine.shutdown()


def post(client, path: str, body: dict, headers: dict | None = None):
    return client.post(path, json=body, headers={**AUTH, **(headers or {})})


# ---- request id and access log ------------------------------------------------------------------

def test_request_id_echoed_or_generated_on_every_answer(client):
    r = post(client, "/v1/chat/completions", CHAT, {"x-request-id": "trace-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    assert r.json()["id"] == "chatcmpl-trace-42"
    r = post(client, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    rid = r.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", rid) and r.json()["id"] == f"cmpl-{rid}"
    for bad in ("x" * 200, "has space", "tab\there"):  # too long, or not printable without spaces
        r = post(client, "/v1/completions", {"prompt": "hi", "max_tokens": 1}, {"x-request-id": bad})
        assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
    answers = [client.post("/v1/completions", json={"prompt": "x"}, headers={"x-request-id": "e1"}),  # 401
               post(client, "/v1/completions", {"prompt": 3}, {"x-request-id": "e2"}),               # 400
               client.get("/v2/nothing", headers={"x-request-id": "e3"}),                              # 404
               client.post("/v1/completions", content=b"x" * (2 << 20), headers={**AUTH, "x-request-id": "e4"}),
               client.get("/health", headers={"x-request-id": "e5"})]
    assert [a.status_code for a in answers] == [401, 400, 404, 413, 200]
    assert [a.headers["x-request-id"] for a in answers] == ["e1", "e2", "e3", "e4", "e5"]


def test_access_log_one_line_per_request(client, caplog):
    caplog.set_level(logging.INFO, logger="specdec.access")
    post(client, "/v1/completions", {"prompt": "hello", "max_tokens": 3, "ignore_eos": True}, {"x-request-id": "a1"})
    with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True, "ignore_eos": True},
                       headers={**AUTH, "x-request-id": "a2"}) as r:
        assert r.headers["x-request-id"] == "a2"
        body = "".join(r.iter_text())
    assert body.rstrip().endswith("data: [DONE]")
    post(client, "/v1/completions", {"prompt": 3}, {"x-request-id": "a3"})
    lines = {r.request_id: r for r in caplog.records if r.name == "specdec.access"}
    assert set(lines) >= {"a1", "a2", "a3"}
    a1, a2, a3 = lines["a1"], lines["a2"], lines["a3"]
    assert (a1.method, a1.route, a1.status, a1.completion_tokens) == ("POST", "/v1/completions", 200, 3)
    assert a1.prompt_tokens > 0 and a1.seconds > 0 and a1.levelno == logging.INFO
    assert re.fullmatch(r'a1 "POST /v1/completions" 200 prompt_tokens=\d+ completion_tokens=3 key=[0-9a-f]{12} '
                        r'\d+\.\d{3}s', a1.getMessage())
    assert a1.api_key_id == hashlib.sha256(KEY.encode()).hexdigest()[:12]
    assert (a2.route, a2.status, a2.completion_tokens) == ("/v1/chat/completions", 200, 4)  # logged at the end
    assert (a3.status, a3.prompt_tokens) == (400, None) and "prompt_tokens" not in a3.getMessage()


# ---- /tokenize, /detokenize, /version -----------------------------------------------------------

def test_tokenize_prompt_and_chat_forms(client):
    tok = client.app.state.specdec.engine.engine.tokenizer
    r = post(client, "/tokenize", {"prompt": "hello world", "return_token_strs": True})
    body = r.json()
    assert r.status_code == 200 and body["tokens"] == tok.encode("hello world")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 512
    assert body["token_strs"] == [tok.token_strings[i] for i in body["tokens"]]
    plain = post(client, "/tokenize", {"prompt": "hello", "add_special_tokens": False}).json()
    assert plain["tokens"] == tok.encode("hello", add_special_tokens=False) and plain["token_strs"] is None
    messages = CHAT["messages"]
    chat = post(client, "/tokenize", {"messages": messages}).json()
    templated = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert chat["tokens"] == tok.encode(templated, add_special_tokens=False)
    bare = post(client, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert bare["count"] < chat["count"]
    usage = post(client, "/v1/chat/completions", CHAT).json()["usage"]
    assert usage["prompt_tokens"] == chat["count"]   # what chat generates from
    assert post(client, "/detokenize", {"tokens": plain["tokens"]}).json() == {"prompt": "hello"}
    assert client.get("/version").json()["version"]


def test_tokenize_errors(client):
    cases = [({"prompt": "x", "model": "gpt-4o"}, 404, "model"),
             ({"prompt": "x", "messages": CHAT["messages"]}, 400, "prompt"),
             ({}, 400, "prompt"),
             ({"messages": [{"role": "user", "content": None}]}, 400, "messages.0.content")]
    for body, status, param in cases:
        r = post(client, "/tokenize", body)
        assert (r.status_code, r.json()["error"]["param"]) == (status, param), body
    r = post(client, "/detokenize", {"tokens": [1, 10 ** 6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert post(client, "/detokenize", {"tokens": [1], "model": "nope"}).status_code == 404
    assert client.post("/tokenize", json={"prompt": "x"}).status_code == 401
    assert client.post("/detokenize", json={"tokens": [1]}).status_code == 401
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/tokenize", "/detokenize", "/version"} <= set(paths)


# ---- logit_bias ---------------------------------------------------------------------------------

def test_sampling_params_check_logit_bias():
    assert SamplingParams(logit_bias={5: -100, 7: 2}).logit_bias == {5: -100.0, 7: 2.0}
    assert SamplingParams(logit_bias={}).logit_bias is None
    for bad in ({5: 101}, {-1: 1}, {"5": 1}, {5: float("nan")}, {True: 1}):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)


@pytest.fixture(scope="module")
def plain(tiny_qwen):
    return LLM(config=engine_config(str(tiny_qwen)), progress=False)


def test_logit_bias_bans_and_forces_plain_greedy(plain):
    first = plain.generate("hello there", SamplingParams(max_tokens=1, ignore_eos=True))[0].token_ids[0]
    banned = plain.generate("hello there", SamplingParams(max_tokens=1, ignore_eos=True,
                                                          logit_bias={first: -100}))[0].token_ids
    assert banned[0] != first
    forced = (first + 7) % 256
    out = plain.generate("hello there", SamplingParams(max_tokens=5, ignore_eos=True, logit_bias={forced: 100}))
    assert out[0].token_ids == [forced] * 5
    vocab = plain.tokenizer.vocab_size
    with pytest.raises(ValueError, match="logit_bias: token ids outside the vocabulary"):  # never dropped silently
        plain.generate("hello there", SamplingParams(max_tokens=1, logit_bias={vocab: 5.0}))


@pytest.mark.parametrize("method,draft", [("ngram", None), ("draft_model", "tiny_llama")])
def test_logit_bias_speculative_equals_plain(plain, tiny_qwen, request, method, draft):
    prompts = ["the cat sat on the mat and then the cat sat on the mat", "hello there", "in the beginning " * 4]
    ref_params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = [o.token_ids for o in plain.generate(prompts, ref_params)]
    # ban each prompt's first plain token and nudge a few others: the output changes, both ways alike
    bias = {ids[0]: -100.0 for ids in ref} | {97: 3.5, 116: -2.0, 32: 1.25}
    params = SamplingParams(max_tokens=24, ignore_eos=True, logit_bias=bias)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert want != ref
    cfg = engine_config(str(tiny_qwen))
    cfg.speculative = SpeculativeConfig(method=method, num_speculative_tokens=3, policy="fixed",
                                        draft_model=str(request.getfixturevalue(draft)) if draft else None)
    spec = LLM(config=cfg, progress=False)
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    assert sum(o.stats.drafted_tokens for o in outs) > 0


def test_logit_bias_on_both_routes(client):
    forced = 100
    r = post(client, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "ignore_eos": True,
                                         "logit_bias": {str(forced): 100}, "logprobs": 0})
    assert r.status_code == 200
    tok = client.app.state.specdec.engine.engine.tokenizer
    assert r.json()["choices"][0]["text"] == tok.decode([forced] * 3)
    r = post(client, "/v1/chat/completions", {**CHAT, "logit_bias": {str(forced): 100}, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    for bias, needle in (({"5": 101}, "[-100, 100]"), ({"5": -100.5}, "[-100, 100]"), ({"abc": 1}, "token ids"),
                         ({"-3": 1}, "token ids"), ({"1.5": 1}, "token ids"), ({str(10 ** 6): 1}, "vocabulary"),
                         ({"5": "x"}, "number")):
        for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 1}), ("/v1/chat/completions", CHAT)):
            r = post(client, path, {**body, "logit_bias": bias})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"].startswith("logit_bias") and needle in err["message"], \
                (bias, err)


# ---- chat messages and tool calls ---------------------------------------------------------------

def test_null_content(client):
    for role in ("user", "system"):
        messages = [{"role": role, "content": None}] + ([] if role == "user" else CHAT["messages"])
        r = post(client, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content", r.json()
    call = {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}
    messages = [*CHAT["messages"], {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]
    r = post(client, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, "tools": [NOW]})
    assert r.status_code == 200


def _stream_chat(client, body: dict) -> tuple[str, list, list[str]]:
    """(content, tool-call deltas, finish reasons) of a streamed chat."""
    import json
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}, headers=AUTH) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    deltas = [c["choices"][0] for c in chunks if c.get("choices")]
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    calls = [d["delta"]["tool_calls"] for d in deltas if d["delta"].get("tool_calls")]
    return content, calls, [d["finish_reason"] for d in deltas if d["finish_reason"]]


def test_a_tool_call_cut_off_leaks_no_markup(client):
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    for max_tokens in (3, 8, 14):   # inside the open tag, the head, or around it
        body = {**CHAT, "max_tokens": max_tokens, "tools": [weather], "tool_choice": "required"}
        r = post(client, "/v1/chat/completions", body)
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length", choice
        assert "<" not in (choice["message"]["content"] or "")   # no part of the tag either
        assert not choice["message"].get("tool_calls")
        content, _, finish = _stream_chat(client, body)
        assert finish == ["length"] and "tool_call" not in content and "<" not in content


def test_required_tool_call_stops_when_complete(client):
    # without parallel calls the grammar ends after one: the model must stop there (the bound on
    # parallel calls is checked on the grammar in test_tool_calls)
    body = {**CHAT, "max_tokens": 400, "tools": [NOW], "tool_choice": "required", "parallel_tool_calls": False}
    choice = post(client, "/v1/chat/completions", body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [{"name": "now", "arguments": "{}"}]


# ---- /docs offline, metrics ---------------------------------------------------------------------

def test_docs_are_served_offline(client, tiny_qwen):
    html = client.get("/docs").text
    assert not re.search(r"https?://", html), html
    assets = re.findall(r"""(?:src|href)=["'](/[^"']+)["']""", html)
    assert any(a.endswith(".js") for a in assets) and any(a.endswith(".css") for a in assets)
    for url in assets:
        assert client.get(url).status_code == 200, url
    quiet = TestClient(build_app(AsyncEngine(lambda: None), ServerConfig(openapi=False), "m"))
    assert [quiet.get(p).status_code for p in ("/docs", "/openapi.json", "/docs/assets/swagger-ui.css")] == [404] * 3


def test_metrics_carry_model_name_and_need_the_key(client):
    post(client, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert client.get("/metrics").status_code == 401
    text = client.get("/metrics", headers=AUTH).text
    samples = [line for line in text.splitlines() if line.startswith("specdec_")]
    assert samples and all('model_name="tiny"' in line for line in samples), \
        [line for line in samples if 'model_name="tiny"' not in line][:5]
    m = read_samples(text)
    assert m['specdec_requests_total{status="length"}'] >= 1 and "specdec_num_requests_running" in m
    assert 'specdec_num_requests_running{model_name="tiny"}' in read_samples(text, keep_model_name=True)


def test_metrics_require_key_without_a_key_refuses_to_start():
    with pytest.raises(ValueError, match="metrics_require_key"):
        build_app(AsyncEngine(lambda: None), ServerConfig(metrics_require_key=True), "m")
    open_app = TestClient(build_app(AsyncEngine(lambda: None), ServerConfig(api_key=KEY), "m"))
    assert open_app.get("/metrics").status_code == 200   # off by default
