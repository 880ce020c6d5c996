"""The server's draft administration and shadow A/B, on tiny models in a real server process:
loading and unloading a draft while requests run loses none of them and changes no output, a draft
that fails to load is reported and skipped, the admin endpoints need the API key, and shadow A/B
exports an exact-match rate of 1 for greedy traffic."""
from __future__ import annotations

import threading
import time

import pytest
from conftest import engine_config
from server_process import ServerProcess, http_json

from specdec.llm import LLM
from specdec.sampling_params import SamplingParams

KEY = "admin-key"
DRAFT = "tiny-llama.gguf"


def call(server: ServerProcess, path: str, body: dict | None = None, key: str | None = KEY) -> tuple[int, dict]:
    return http_json(server, path, body, key)


def states(server: ServerProcess) -> dict[str, str]:
    return {d["id"]: d["state"] for d in call(server, "/admin/drafts")[1]["drafts"]}


def wait_state(server: ServerProcess, draft: str, wanted: str, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while states(server).get(draft) != wanted:
        assert time.time() < deadline, states(server)
        time.sleep(0.1)


@pytest.fixture(scope="module")
def server(tiny_qwen, tiny_llama, tmp_path_factory):
    d = tmp_path_factory.mktemp("drafts")
    cfg = d / "config.yaml"
    cfg.write_text(f"""
execution_config:
  target_model: {tiny_qwen}
  draft_model: ngram
  speculation_length: 3
  max_batch_size: 8
speculative:
  policy: fixed
  router: true
  extra_drafts: [{tiny_llama}]
server:
  shadow_fraction: 1.0
""")
    s = ServerProcess(["--config", str(cfg), "--threads", "1"], d / "server.log", api_key=KEY)
    yield s
    s.stop()


PROMPTS = [f"request {i}: " + "the cat sat on the mat " * (1 + i % 3) for i in range(8)]


def test_admin_needs_the_key(server, tiny_qwen, tmp_path):
    assert call(server, "/admin/drafts", key=None)[0] == 401
    assert call(server, "/admin/drafts", {"action": "load", "model": "x"}, key="wrong")[0] == 401
    status, body = call(server, "/admin/drafts", {"action": "explode", "model": "x"})
    assert status == 400 and "action" in body["error"]["message"]
    for bad in ("no-such-model", "/", "x" * 1000):  # refused at once, never a background load that fails later
        status, body = call(server, "/admin/drafts", {"action": "load", "model": bad})
        assert status == 400 and "no such model" in body["error"]["message"]
    assert states(server) == {"ngram": "loaded", "suffix": "loaded", DRAFT: "unloaded"}
    keyless = ServerProcess(["--model", str(tiny_qwen), "--spec", "ngram", "--threads", "1"], tmp_path / "s.log")
    try:
        status, body = call(keyless, "/admin/drafts", key=None)
        assert status == 403 and "API key" in body["error"]["message"]
    finally:
        keyless.stop()


def test_load_and_unload_under_load_loses_no_request(server, tiny_qwen, tiny_llama, tmp_path):
    results: dict[int, tuple[str, dict]] = {}

    def run(i: int) -> None:
        c = server.client()
        kw = dict(model=server.model, prompt=PROMPTS[i], max_tokens=48, temperature=0,
                  extra_body={"ignore_eos": True, "speculative": {"method": DRAFT if i % 2 else "auto"}})
        if i % 4 == 3:
            text = "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kw) if ch.choices)
            results[i] = (text, {})
        else:
            out = c.completions.create(**kw)
            results[i] = (out.choices[0].text, out.usage.model_extra)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    status, body = call(server, "/admin/drafts", {"action": "load", "model": str(tiny_llama)})
    assert status == 202 and body["id"] == DRAFT
    wait_state(server, DRAFT, "loaded")
    time.sleep(0.5)
    status, body = call(server, "/admin/drafts", {"action": "unload", "model": DRAFT})
    assert status == 200 and states(server)[DRAFT] == "unloaded"
    for t in threads:
        t.join(300)
    offline = LLM(config=engine_config(str(tiny_qwen)), progress=False)
    ref = offline.generate(PROMPTS, SamplingParams(max_tokens=48, ignore_eos=True))
    assert [results[i][0] for i in range(len(PROMPTS))] == [o.text for o in ref]
    for i, (_, usage) in results.items():  # usage names the proposer(s) that drafted
        if usage:
            assert "proposer" in usage and isinstance(usage["proposers_used"], list)
    # a file that is not a model: reported, skipped, and the next requests still succeed
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    assert call(server, "/admin/drafts", {"action": "load", "model": str(bad)})[0] == 202
    wait_state(server, "broken.gguf", "failed")
    out = server.client().completions.create(model=server.model, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                             extra_body={"speculative": {"method": "broken.gguf"}})
    assert out.choices[0].text == offline.generate(PROMPTS[0], SamplingParams(max_tokens=8))[0].text
    m = server.wait_idle()
    assert m["specdec_draft_load_failures_total"] == 1 and m["specdec_draft_loads_total"] >= 1
    assert m["specdec_draft_unloads_total"] >= 1
    assert m['specdec_kv_blocks_used{pool="target"}'] == 0
    assert any(k.startswith("specdec_requests_by_proposer_total") for k in m)


def test_shadow_ab_reports_exact_matches_for_greedy_traffic(server):
    c = server.client()
    for p in PROMPTS[:3]:
        out = c.completions.create(model=server.model, prompt=p, max_tokens=16, temperature=0,
                                   extra_body={"ignore_eos": True, "speculative": {"method": "ngram"}})
        assert out.model_extra["speculative"]["proposer"] == "ngram[1-4]"
    deadline = time.time() + 120
    while True:  # the plain copies run in the background after the originals finished
        m = server.wait_idle()
        if m.get('specdec_shadow_requests_total{outcome="compared"}', 0) >= 3 or time.time() > deadline:
            break
        time.sleep(0.2)
    assert m['specdec_shadow_requests_total{outcome="compared"}'] >= 3, m
    assert m["specdec_shadow_exact_match_rate"] == 1.0
    assert m["specdec_shadow_speedup"] > 0
