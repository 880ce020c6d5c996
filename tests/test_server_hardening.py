"""The server under hostile and heavy traffic: undecodable text, unknown models and methods, token
caps, the published schema, clients that drop their connections, a burst larger than the queue,
and a graceful drain on SIGTERM with streams in flight."""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from conftest import engine_config
from openai import NotFoundError
from server_process import ServerProcess, http_json, in_process_server, yaml_server
from tiny_gguf import write_tiny_gguf

from specdec.config import ServerConfig

KEY = "hardening-key"


@pytest.fixture(scope="module")
def capped(tiny_qwen, tmp_path_factory):
    s = yaml_server(tmp_path_factory.mktemp("capped"), f"""
execution_config:
  target_model: {tiny_qwen}
  draft_model: ngram
server:
  max_n: 2
  max_tokens_limit: 32
  max_request_tokens: 600
""", ("--threads", "1", "--precision", "float32"), api_key=KEY)
    yield s
    s.stop()


def post(server, path: str, body, key: str | None = KEY) -> tuple[int, dict]:
    return http_json(server, path, body, key)


def raw(server, method: str, path: str, body: bytes = b"") -> tuple[int, dict, dict]:
    req = urllib.request.Request(server.url + path, data=body or None, method=method,
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def test_undecodable_text_is_a_400(capped):
    bodies = [b'{"prompt": "a\\ud800b"}', b'{"prompt": ["ok", "\\udfff"]}', b'{"prompt": "x", "stop": ["\\ud83d"]}',
              b'{"messages": [{"role": "user", "content": "hi \\udc00"}]}',
              b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}']
    for body in bodies:
        path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
        status, _, err = raw(capped, "POST", path, body)
        assert status == 400 and "surrogate" in err["error"]["message"], (body, status, err)
    status, _, err = raw(capped, "POST", "/v1/completions", b'{"prompt": "a\xff\xfeb"}')  # not UTF-8
    assert status == 400 and err["error"]["type"] == "invalid_request_error"
    assert post(capped, "/v1/completions", {"prompt": "still serving", "max_tokens": 2})[0] == 200


def test_unknown_model_is_404_and_methods_carry_allow(capped):
    for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})):
        status, err = post(capped, path, {**body, "model": "gpt-4o"})
        assert status == 404 and err["error"]["code"] == "model_not_found" and err["error"]["param"] == "model"
        assert post(capped, path, {**body, "model": capped.model})[0] == 200
    with pytest.raises(NotFoundError):
        capped.client().completions.create(model="no-such-model", prompt="x", max_tokens=2)
    status, headers, err = raw(capped, "GET", "/v1/completions")
    assert status == 405 and headers["allow"] == "POST" and err["error"]["type"] == "invalid_request_error"
    status, headers, _ = raw(capped, "DELETE", "/health")
    assert status == 405 and "GET" in headers["allow"]
    with urllib.request.urlopen(urllib.request.Request(capped.url + "/health", method="HEAD")) as r:
        assert r.status == 200  # load balancers probe with HEAD
    status, _, err = raw(capped, "GET", "/v2/nothing")
    assert status == 404 and err["error"]["message"]
    with socket.create_connection(("127.0.0.1", capped.port)) as sock:  # framing the server cannot parse
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n{}")
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and json.loads(body)["error"]["type"] == "invalid_request_error"


def test_token_caps(capped):
    status, err = post(capped, "/v1/completions", {"prompt": "x", "max_tokens": 33})
    assert status == 400 and "max_tokens_limit (32)" in err["error"]["message"]
    status, err = post(capped, "/v1/completions", {"prompt": "x", "stop_token_ids": [10 ** 9]})
    assert status == 400 and err["error"]["param"] == "stop_token_ids"
    chat = {"messages": [{"role": "user", "content": "x"}], "ignore_eos": True}  # no max_tokens: the cap applies
    status, body = post(capped, "/v1/chat/completions", chat)
    assert status == 200 and body["usage"]["completion_tokens"] == 32
    long_prompt = [3 + i % 250 for i in range(280)]  # 280 tokens: 2 x (280 + 32) = 624 > 600
    status, err = post(capped, "/v1/completions", {"prompt": long_prompt, "max_tokens": 32, "n": 2})
    assert status == 400 and "max_request_tokens is 600" in err["error"]["message"]
    assert post(capped, "/v1/completions", {"prompt": long_prompt, "max_tokens": 32})[0] == 200


def test_openapi_documents_every_route(capped):
    with urllib.request.urlopen(capped.url + "/openapi.json") as r:
        doc = json.loads(r.read())
    paths = doc["paths"]
    routes = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/admin/drafts"}
    assert routes <= set(paths)
    for path, ops in paths.items():
        for method, op in ops.items():
            codes = set(op["responses"])
            assert "422" not in codes, (path, method)
            assert "200" in codes, (path, method)
            if method == "post":
                assert {"400", "413"} <= codes and "requestBody" in op, (path, method)
    chat = paths["/v1/chat/completions"]["post"]["responses"]
    assert {"400", "401", "404", "429", "503"} <= set(chat) and "text/event-stream" in chat["200"]["content"]
    assert chat["404"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    with urllib.request.urlopen(capped.url + "/docs") as r:
        assert r.headers["content-type"].startswith("text/html")
    from specdec.server.app import build_app
    from specdec.server.async_engine import AsyncEngine
    quiet = build_app(AsyncEngine(lambda: None), ServerConfig(openapi=False), "m")
    assert not {"/openapi.json", "/docs"} & {getattr(r, "path", "") for r in quiet.routes}


class _SlowEngine:
    """An LLMEngine whose steps take at least `delay` seconds (clients can act mid-request)."""

    def __new__(cls, model, delay: float, **overrides):
        from specdec.engine import LLMEngine

        class Slow(LLMEngine):
            def step(self):
                time.sleep(delay)
                return super().step()
        return Slow(engine_config(str(model), **overrides), progress=False)


def _send(port: int, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


def _count(sample: dict, status: str) -> float:
    return sample.get(f'specdec_requests_total{{status="{status}"}}', 0)


def test_dropped_clients_log_no_error_and_leave_no_task(tiny_qwen, caplog):
    caplog.set_level(logging.INFO)
    with in_process_server(lambda: _SlowEngine(tiny_qwen, 0.002)) as (engine, local):
        while not engine.ready:
            time.sleep(0.05)
        metrics = lambda: ServerProcess.metrics(local)  # noqa: E731
        assert post(local, "/v1/completions", {"prompt": "warm", "max_tokens": 2}, key=None)[0] == 200
        tasks = lambda: asyncio.run_coroutine_threadsafe(_num_tasks(), local.loop).result(10)  # noqa: E731
        before, baseline = metrics(), tasks()
        for i in range(60):
            sock = _send(local.port, {"prompt": f"drop {i}", "max_tokens": 300, "ignore_eos": True, "stream": i < 50})
            if i < 50:
                got = b""
                while b"data:" not in got:  # the stream has started
                    got += sock.recv(4096)
            else:
                time.sleep(0.05)  # the request is running
            sock.close()
        deadline = time.time() + 60
        while (metrics()["specdec_num_requests_running"] or engine.num_client_requests) and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        m = metrics()
        assert tasks() == baseline
        assert m['specdec_kv_blocks_used{pool="target"}'] == 0 and engine.num_client_requests == 0
        ended = _count(m, "abort") + _count(m, "length") - _count(before, "abort") - _count(before, "length")
        assert ended == 60 and _count(m, "abort") - _count(before, "abort") >= 50
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    assert sum("aborted: the client went away" in r.getMessage() for r in caplog.records) >= 50


async def _num_tasks() -> int:
    return len(asyncio.all_tasks()) - 1  # not this one


def test_a_burst_beyond_the_queue_is_answered_promptly(tiny_qwen):
    config = ServerConfig(queue_timeout=2.0, retry_after=3)
    build = lambda: _SlowEngine(tiny_qwen, 0.01, max_batch_size=2, max_queued_requests=64,  # noqa: E731
                                target_cache_blocks=16)  # 256 tokens: room for the burst's requests, not for 300
    with in_process_server(build, config) as (engine, local):
        while not engine.ready:
            time.sleep(0.05)
        results: list[tuple[int, float, dict, dict]] = []

        def one(i: int) -> None:
            t0 = time.time()
            body = {"prompt": f"burst {i}", "max_tokens": 20, "ignore_eos": True}
            status, headers, body = raw(local, "POST", "/v1/completions", json.dumps(body).encode())
            results.append((status, time.time() - t0, headers, body))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(200)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        statuses = [r[0] for r in results]
        assert len(results) == 200 and set(statuses) <= {200, 429, 503}, statuses
        assert statuses.count(200) >= 2 and statuses.count(429) >= 1 and statuses.count(503) >= 1
        for status, seconds, headers, body in results:
            if status != 200:
                assert headers["retry-after"] == "3" and seconds < config.queue_timeout + 3, (status, seconds)
            if status == 503:
                assert body["error"]["code"] == "queue_timeout"
        assert max(r[1] for r in results) < config.queue_timeout + 10
        status, err = post(local, "/v1/completions", {"prompt": "too big", "max_tokens": 300}, key=None)
        assert status == 400 and "the pool has 16" in err["error"]["message"]  # could never fit: refused, not queued
        assert post(local, "/v1/completions", {"prompt": "after", "max_tokens": 2}, key=None)[0] == 200


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory):
    """The tiny model with an 8k context: a request long enough to be in flight at a signal."""
    return write_tiny_gguf(tmp_path_factory.mktemp("long") / "tiny-long.gguf", arch="qwen2", context=8192)


def _drain_server(model, tmp_path, seconds: float) -> ServerProcess:
    return yaml_server(tmp_path, f"execution_config:\n  target_model: {model}\n  precision: float32\n"
                                 f"server:\n  drain_seconds: {seconds}\n  retry_after: 7\n")


def _open_stream(server: ServerProcess, max_tokens: int):
    body = {"prompt": "count", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    r = urllib.request.urlopen(req, timeout=120)
    assert r.readline().startswith(b"data: ")
    return r


def _events(stream) -> list[str]:
    return [line.decode().removeprefix("data: ").strip() for line in stream if line.strip()]


@pytest.mark.parametrize("drain_seconds, sig", [(60, signal.SIGTERM), (0.3, signal.SIGINT)])
def test_a_signal_drains_streams_in_flight(tiny_long, tmp_path, drain_seconds, sig):
    """60 s: the stream in flight finishes whole; 0.3 s: it ends with an error event. Either way the
    stream ends with [DONE], new work gets 503 with Retry-After, and the process exits cleanly."""
    server = _drain_server(tiny_long, tmp_path, drain_seconds)
    try:
        side: dict = {}
        waiter = threading.Thread(target=lambda: side.update(plain=post(
            server, "/v1/completions", {"prompt": "hi", "max_tokens": 3000, "ignore_eos": True}, key=None)))
        waiter.start()
        stream = _open_stream(server, 3000)
        server.proc.send_signal(sig)
        deadline = time.time() + 10
        while "draining" not in server.log_path.read_text() and time.time() < deadline:
            time.sleep(0.02)
        status, headers, err = raw(server, "POST", "/v1/completions", b'{"prompt": "late", "max_tokens": 2}')
        assert status == 503 and headers["retry-after"] == "7" and err["error"]["code"] == "shutting_down"
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(server.url + "/health")
        assert health.value.code == 503 and json.loads(health.value.read()) == {"status": "draining"}
        events = _events(stream)
        waiter.join(60)
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        if drain_seconds == 60:
            assert last["choices"][0]["finish_reason"] == "length"
            assert side["plain"][0] == 200 and side["plain"][1]["usage"]["completion_tokens"] == 3000
        else:
            assert last["error"]["code"] == "shutting_down"
            assert side["plain"][0] == 503 and side["plain"][1]["error"]["code"] == "shutting_down"
        assert server.proc.wait(30) == 0
        log = server.log_path.read_text()
        assert "draining: 2 request(s) in flight" in log and " ERROR " not in log and "Traceback" not in log
    finally:
        server.stop()


def test_soak_bench_reports_outcomes_memory_and_errors(tiny_long, tmp_path):
    out, png = tmp_path / "soak.json", tmp_path / "soak.png"
    run = subprocess.run([sys.executable, "-m", "specdec.cli", "bench", "soak", "--model", str(tiny_long),
                          "--precision", "float32", "--threads", "1", "--clients", "4", "--minutes", "2",
                          "--max-requests", "48", "--warmup-minutes", "0.05", "--max-tokens", "8",
                          "--sets", "chat,prose", "--out", str(out),
                          "--plot", str(png)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["requests"] == 48 and sum(r["by_outcome"].values()) == 48
    assert r["by_outcome"]["failed"] == 0, r["failures"]
    assert r["by_outcome"]["ok"] > 0 and r["by_outcome"]["dropped"] + r["by_outcome"]["rejected"] > 0
    assert r["error_log_lines"] == 0 and r["server_exit_code"] == 0
    assert r["kv_blocks_used_after"] == {'specdec_kv_blocks_used{pool="target"}': 0.0}
    assert r["rss_mb_before"] > 0 and r["latency_p50"] <= r["latency_p99"]
    assert png.stat().st_size > 1000
