"""Two engine replicas of SmolLM2-135M on a local Ray instance behind `specdec serve --replicas 2`,
driven as the single-process server is: the official openai client (completions, chat, streaming,
per-request speculation), bad input and the API key; 16 concurrent clients whose greedy outputs equal
the offline engine's, served by both replicas; per-replica metrics; prefix-affinity routing of a
conversation; hostile requests answered as the single process answers them (but for the framing Ray's
proxy rejects first); a replica killed under a burst of one hot prompt (streams on it end cleanly, the
rest succeed, Ray brings the deployment back to two, and the hot prompt reaches the new replica); a
short soak with a replica killed mid-run (nothing lost but what was in flight on it, no KV block
leaked, no ERROR line); last, SIGTERM drains a stream to [DONE] and no Ray process outlives the server."""
from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import AuthenticationError, BadRequestError, NotFoundError

from conftest import engine_config
from ray_server import PROBES, PROXY_ANSWERS, SMOLLM, RayServer, config_yaml, probe
from server_process import http_json, yaml_server
from specdec.llm import LLM
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.real_model
KEY = "sk-ray-test"
TOPICS = ["rivers", "owls", "bread", "trains", "glaciers", "violins", "tides", "maps",
          "bees", "lanterns", "comets", "ferns", "harbors", "kites", "deserts", "clocks"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("ray")
    server = RayServer(d, config_yaml("  replicas: 2\n  routing: affinity\n", max_body=65536), 2, api_key=KEY)
    yield server
    assert server.stop() == [], "processes of the Ray instance outlived the server"


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The same config in one process, no Ray: the answers the deployment must give too."""
    server = yaml_server(tmp_path_factory.mktemp("single"), config_yaml("", max_body=65536), args=(), api_key=KEY)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def offline(smollm_loaded):
    return LLM(config=engine_config(SMOLLM), loaded=smollm_loaded, progress=False)


def test_routes_streaming_and_speculation_controls(cluster, offline):
    c = cluster.client()
    raw = c.completions.with_raw_response.create(model=SMOLLM, prompt="The three primary colors are", max_tokens=16,
                                                 temperature=0)
    out = raw.parse()
    ref = offline.generate("The three primary colors are", SamplingParams(max_tokens=16))[0]
    assert out.choices[0].text == ref.text and raw.headers["x-specdec-replica"]
    assert out.model_extra["speculative"]["proposer"].startswith("ngram")

    messages = [{"role": "user", "content": "Name two planets."}]
    chat = c.chat.completions.create(model=SMOLLM, messages=messages, max_tokens=16, temperature=0)
    pieces = [ch.delta.content or "" for chunk in c.chat.completions.create(
        model=SMOLLM, messages=messages, max_tokens=16, temperature=0, stream=True) for ch in chunk.choices]
    assert "".join(pieces) == chat.choices[0].message.content
    assert chat.choices[0].message.content == offline.chat(messages, SamplingParams(max_tokens=16)).text

    off = c.completions.create(model=SMOLLM, prompt="a b c a b c a b c", max_tokens=8, temperature=0,
                               extra_body={"speculative": {"enabled": False}})
    assert off.model_extra["speculative"]["drafted_tokens"] == 0


def test_bad_input_and_auth_answer_as_the_single_process_server(cluster):
    with pytest.raises(AuthenticationError):
        cluster.client(api_key="wrong").completions.create(model=SMOLLM, prompt="x", max_tokens=2)
    c = cluster.client()
    with pytest.raises(NotFoundError) as e:
        c.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(BadRequestError) as e:
        c.completions.create(model=SMOLLM, prompt="x", max_tokens=2, extra_body={"bogus": 1})
    assert e.value.body["param"] == "bogus"
    status, body = http_json(cluster, "/v1/completions", b"{not json", key=KEY)
    assert status == 400 and body["error"]["message"] == "request body is not valid JSON"
    status, body = http_json(cluster, "/v1/completions", {"prompt": "x" * 100_000}, key=KEY)
    assert status == 413 and "larger than 65536" in body["error"]["message"]
    assert http_json(cluster, "/v1/nowhere", key=KEY)[0] == 404
    assert http_json(cluster, "/health") == (200, {"status": "ok"})
    assert http_json(cluster, "/v1/models", key=KEY)[1]["data"][0]["id"] == SMOLLM


def _ask_all(server, prompts: list[str]) -> list[tuple[str | None, str]]:
    """Every prompt at once, one openai client each: (replica, greedy answer) in prompt order."""
    start = threading.Barrier(len(prompts))

    def ask(p: str):
        c = server.client()
        start.wait()
        raw = c.chat.completions.with_raw_response.create(model=SMOLLM, messages=[{"role": "user", "content": p}],
                                                          max_tokens=24, temperature=0)
        return raw.headers.get("x-specdec-replica"), raw.parse().choices[0].message.content

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(ask, prompts))


def test_sixteen_clients_on_two_replicas_match_the_single_process_server(cluster, single):
    prompts = [f"Write one sentence about {t}." for t in TOPICS]
    results = _ask_all(cluster, prompts)
    assert set(cluster.replicas()) == {replica for replica, _ in results}  # both served
    assert [text for _, text in results] == [text for _, text in _ask_all(single, prompts)]


def test_hostile_requests_get_the_single_process_answers(cluster, single):
    for name, request in PROBES.items():
        status, headers, body = probe(cluster.port, request)
        if name in PROXY_ANSWERS:   # Ray's proxy answers first; the single process answers in JSON
            assert (status, headers["content-type"], body) == PROXY_ANSWERS[name], name
            assert probe(single.port, request)[0] in (400, 404), name
            continue
        expected = probe(single.port, request)
        assert (status, headers) == expected[:2], (name, status, headers, body[:200])
        ours, theirs = json.loads(body), json.loads(expected[2])
        if status == 200:   # served: the same length (ids and timestamps differ)
            assert ours["usage"]["completion_tokens"] == theirs["usage"]["completion_tokens"], name
        else:
            assert ours == theirs, name


def test_seeded_sampling_reproduces_through_the_replicas(cluster, single, offline):
    """n = 2 at temperature 0.8 with a seed: the same choices speculative or plain, through either
    replica, from the single process and from the offline engine (choice j: noise keyed by (seed, j))."""
    prompt = "red, green, blue, red, green, blue, red, green, blue, red,"

    def ask(server, **extra):
        out = server.client().completions.create(model=SMOLLM, prompt=prompt, max_tokens=24, temperature=0.8,
                                                 seed=4242, n=2, extra_body=extra or None)
        return [ch.text for ch in sorted(out.choices, key=lambda ch: ch.index)], out.model_extra["speculative"]

    texts, spec = ask(cluster)
    assert spec["seed"] == 4242 and spec["coupling"] == "gumbel" and spec["drafted_tokens"] > 0
    assert texts[0] != texts[1]
    assert ask(cluster)[0] == texts
    assert ask(cluster, speculative={"enabled": False})[0] == texts
    assert ask(single)[0] == texts
    offline_texts = [o.text for o in offline.generate(
        [prompt] * 2, [SamplingParams(temperature=0.8, max_tokens=24, seed=4242, choice=j) for j in (0, 1)])]
    assert offline_texts == texts


def test_metrics_per_replica_and_summed(cluster):
    deadline = time.time() + 10
    while True:  # each replica pushes its page every second
        m = cluster.metrics()
        per = {k: v for k, v in m.items() if k.startswith('specdec_requests_total{status="stop"') or
               k.startswith('specdec_requests_total{status="length"')}
        total = sum(v for k, v in per.items() if 'replica="all"' in k)
        if total >= 18 or time.time() > deadline:
            break
        time.sleep(0.5)
    assert m["specdec_replicas"] == 2 and total >= 18
    assert total == sum(v for k, v in per.items() if 'replica="all"' not in k)
    for replica in cluster.replicas():
        assert f'specdec_kv_blocks_free{{pool="target",replica="{replica}"}}' in m
        assert m[f'specdec_replica_degraded{{replica="{replica}"}}'] == 0
    assert 'specdec_generation_tokens_total{replica="all"}' in m
    assert 'specdec_prefix_cache_hit_tokens_total{replica="all"}' in m


def test_a_conversation_stays_on_the_replica_holding_its_prefix(cluster):
    c = cluster.client()
    messages = [{"role": "system", "content": "You are a helpful assistant who answers in one short sentence. " * 3}]
    served, cached = [], []
    for question in ("What is a river?", "Where do rivers end?", "Name a long one.", "Which continent is it on?"):
        messages.append({"role": "user", "content": question})
        raw = c.chat.completions.with_raw_response.create(model=SMOLLM, messages=messages, max_tokens=12, temperature=0)
        out = raw.parse()
        served.append(raw.headers["x-specdec-replica"])
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
        messages.append({"role": "assistant", "content": out.choices[0].message.content})
    assert len(set(served)) == 1, served
    assert all(n > 0 for n in cached[1:]), cached


def test_a_client_that_goes_away_aborts_its_request_on_the_replica(cluster):
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", cluster.port, timeout=60)
    body = json.dumps({"model": SMOLLM, "prompt": "Count to a million:", "max_tokens": 1500, "ignore_eos": True,
                       "stream": True})
    conn.request("POST", "/v1/completions", body,
                 {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    conn.close()  # gone after the first event
    deadline = time.time() + 30
    while True:
        m = cluster.metrics()
        aborted = m.get('specdec_requests_total{status="abort",replica="all"}', 0)
        if m.get('specdec_num_requests_running{replica="all"}') == 0 and aborted >= 1:
            break
        assert time.time() < deadline, "the request kept running after its client went away"
        time.sleep(0.5)


def _stream(url: str, prompt: str, stream: bool) -> tuple[int, list[str] | dict]:
    body = json.dumps({"model": SMOLLM, "prompt": prompt, "max_tokens": 160, "temperature": 0, "ignore_eos": True,
                       "stream": stream}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json",
                                                                "Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=180) as r:
            text = r.read().decode()
            if not stream:
                return r.status, json.loads(text)
            return r.status, [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


HOT = "You are a patient storyteller for children. Keep every sentence short and kind. " * 3


def _hot_burst(server, n: int = 16) -> list[str]:
    """n identical prompts at once (a shared system prompt's common case): the replica of each."""
    start = threading.Barrier(n)

    def ask(_):
        start.wait()
        raw = server.client().completions.with_raw_response.create(model=SMOLLM, prompt=HOT + "Begin.", max_tokens=8,
                                                                   temperature=0)
        return raw.headers["x-specdec-replica"]

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(ask, range(n)))


def test_a_killed_replica_is_replaced_only_its_streams_fail_and_it_gets_the_hot_prompt(cluster):
    """A replica is SIGKILLed under a burst of one hot prompt: streams on it end cleanly, whole
    answers are retried, Ray brings up a new replica, and the hot prompt reaches the new replica
    within 30 s of its readiness, also after Ray's queue-length cache for it has gone stale (10 s)."""
    before = cluster.wait_replicas(2)
    victim, pid = sorted(before.items())[0]
    with ThreadPoolExecutor(12) as pool:
        running = [pool.submit(_stream, cluster.url, HOT + "Begin.", i % 2 == 0) for i in range(8)]
        time.sleep(2.0)
        os.kill(pid, signal.SIGKILL)
        later = [pool.submit(_stream, cluster.url, HOT + "Begin.", i % 2 == 0) for i in range(4)]
        outcomes = [f.result() for f in running + later]
    failed_streams = 0
    for status, result in outcomes:
        assert status == 200, result
        if isinstance(result, dict):  # a whole answer: retried on the other replica if its own died
            assert result["choices"][0]["finish_reason"] == "length"
            continue
        assert result[-1] == "[DONE]"
        last = json.loads(result[-2])
        if "error" in last:  # streaming from the killed replica: a clean error event, retryable
            assert last["error"]["code"] == "replica_failed"
            failed_streams += 1
        else:
            assert last["choices"][0]["finish_reason"] == "length"
    assert failed_streams <= 4
    t0 = time.time()
    after = cluster.wait_replicas(2, timeout=60)
    ready = time.time()
    assert victim not in after and ready - t0 < 60
    assert set(_hot_burst(cluster)) == set(after)       # at once: both serve the hot prompt
    time.sleep(max(0.0, ready + 12 - time.time()))      # Ray's cached queue length of the new replica is stale
    assert set(_hot_burst(cluster)) == set(after) and time.time() - ready < 30
    m = cluster.metrics()
    assert m["specdec_ingress_replica_failures_total"] >= failed_streams


def test_a_short_soak_with_a_replica_killed_loses_only_its_requests(cluster):
    from specdec.bench.soak import _ERROR_LINE, soak
    from specdec.bench.soak_clients import Soak
    from specdec.prompts import read_set
    cluster.wait_replicas(2)
    s = Soak(cluster.url, "127.0.0.1", cluster.port, 16, read_set("chat")[:3] + read_set("prose")[:3], api_key=KEY)
    a = argparse.Namespace(clients=4, minutes=2.0, max_requests=48, warmup_minutes=0.0, seed=1, kill_replica_at=3.0,
                           replicas=2)
    r = soak(s, a, None)
    print("soak:", {k: r[k] for k in ("by_outcome", "killed_replicas", "kv_blocks_used_after", "wall_seconds")})
    assert r["requests"] == 48 and r["by_outcome"]["failed"] == 0, r["failures"]
    (kill,) = r["killed_replicas"]
    assert kill["at"] < r["wall_seconds"] and r["replicas_after"] == 2
    assert all(k["replica"] == kill["replica"] for k in r["killed_requests"])
    assert r["by_outcome"]["ok"] > 0 and r["kv_blocks_leaked"] == {}, r["kv_blocks_used_after"]
    assert not [line for line in cluster.log_path.read_text().splitlines() if _ERROR_LINE.search(line)]


def test_sigterm_drains_a_stream_to_done_and_leaves_no_ray_process(cluster):
    """Last (it stops the deployment): as the single process, new work gets 503 shutting_down, the
    stream in flight ends after drain_seconds (2) with an error event and [DONE], and the process
    exits 0."""
    body = json.dumps({"model": SMOLLM, "prompt": "Count to a million:", "max_tokens": 1500, "ignore_eos": True,
                       "stream": True}).encode()
    req = urllib.request.Request(cluster.url + "/v1/completions", body, {"Content-Type": "application/json",
                                                                         "Authorization": f"Bearer {KEY}"})
    stream = urllib.request.urlopen(req, timeout=120)
    assert stream.readline().startswith(b"data: ")
    cluster.proc.send_signal(signal.SIGTERM)
    t0, deadline = time.time(), time.time() + 10
    while http_json(cluster, "/health") != (503, {"status": "draining"}):
        assert time.time() < deadline, "the replicas did not start draining"
        time.sleep(0.1)
    status, late = http_json(cluster, "/v1/completions", {"prompt": "late", "max_tokens": 2}, key=KEY)
    assert status == 503 and late["error"]["code"] == "shutting_down"
    events = [line.decode().removeprefix("data: ").strip() for line in stream if line.strip()]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "shutting_down"
    assert cluster.proc.wait(60) == 0
    print(f"SIGTERM to exit: {time.time() - t0:.1f} s")
    assert cluster.stop() == [], "processes of the Ray instance outlived the server"
    log = cluster.log_path.read_text()
    assert " ERROR " not in log and "Traceback" not in log
