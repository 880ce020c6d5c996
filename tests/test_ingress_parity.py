"""What one process refuses, `specdec serve --replicas` refuses alike. Hypothesis generates hostile
requests: JSON of any shape mixing the API's field names with random values and types, nesting far
past the parsers' limits, huge numbers and NaN, bodies over the limit, invalid UTF-8, truncated JSON,
other content types, odd methods and paths. Each goes to one process and to two replicas behind
Ray's ingress (SmolLM2-135M both, the same config); every one the process answers with a 4xx must
get the same status, content type, Allow header and body through the ingress (error bodies carry
nothing per process, so they are compared whole). Bounded and derandomized: a failure reproduces.

Not generated: what Ray's proxy answers before any specdec code runs (docs/scale-out.md), HTTP it
cannot parse and its own /-/routes and /-/healthz. Without Ray: the ingress's ASGI app in front of
an app run as a replica runs it, for /metrics behind the key and odd methods and paths."""
from __future__ import annotations

import asyncio
import http.client
import json
import socket

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import engine_config
from ray_server import SMOLLM, RayServer, config_yaml
from server_process import started_client, yaml_server
from starlette.testclient import TestClient

from specdec.config import ServerConfig
from specdec.engine import LLMEngine
from specdec.serve_ray.forward import call_app
from specdec.serve_ray.ingress import Ingress
from specdec.server.middleware import nests_deeper

pytestmark = pytest.mark.real_model
LIMIT = 65536
# generation stays short: a request that passes every check makes at most 4 tokens
LIMITS = "  max_tokens_limit: 4\n  max_n: 2\n  max_request_tokens: 512\n"


@pytest.fixture(scope="session")
def single(tmp_path_factory):
    server = yaml_server(tmp_path_factory.mktemp("parity-single"), config_yaml("", LIMIT, LIMITS), args=())
    yield server
    server.stop()


@pytest.fixture(scope="session")
def replicated(tmp_path_factory):
    d = tmp_path_factory.mktemp("parity-ray")
    server = RayServer(d, config_yaml("  replicas: 2\n  routing: affinity\n", LIMIT, LIMITS), 2)
    yield server
    assert server.stop() == [], "processes of the Ray instance outlived the server"


GENERATION = ["/v1/chat/completions", "/v1/completions", "/v1/responses"]
# request targets as sent: %09 and %0A arrive as a tab and a newline in the path
OTHER_PATHS = ["/tokenize", "/detokenize", "/v1/models", "/v1/models/x", "/health", "/metrics", "/admin/drafts",
               "/version", "/v1/embeddings", "/", "/v2/nothing", "/v1/completions/", "/v1/mod%09els",
               "/v1/chat%0Acompletions", "/v1/chat/completions?stream=true"]
# methods Ray's proxy parses (it refuses one it does not know, as HTTP it cannot parse)
METHODS = ["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE", "PROPFIND", "PURGE"]
CONTENT_TYPES = ["application/json; charset=utf-8", "text/plain", "application/x-www-form-urlencoded",
                 "multipart/form-data; boundary=x", "application/vnd.api+json", "", None]
FIELDS = ["model", "messages", "prompt", "input", "instructions", "max_tokens", "max_completion_tokens",
          "max_output_tokens", "n", "stream", "stream_options", "tools", "tool_choice", "response_format",
          "temperature", "top_p", "top_k", "seed", "stop", "logprobs", "top_logprobs", "echo", "speculative",
          "cache_salt", "role", "content", "type", "name", "function", "parameters", "json_schema", "schema",
          "text", "tokens", "user"]
WORDS = [SMOLLM, "user", "assistant", "system", "developer", "tool", "function", "auto", "required", "none",
         "json_object", "json_schema", "text", ""]
BAD_BYTES = [b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80", b"\x00", b"\xef\xbb\xbf"]
NUMBERS = ["1e999", "-1e999", "NaN", "Infinity", "-Infinity", "-0", "1E-400", "0x10", "01", "1.", ".5"]

KEYS = st.sampled_from(FIELDS) | st.text(max_size=8)
SCALARS = (st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70) | st.floats() | st.text(max_size=12)
           | st.sampled_from(WORDS))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4),
                      max_leaves=16)


def _base(path: str) -> dict:
    """A request the route would serve (a short one)."""
    if path == "/v1/completions":
        return {"model": SMOLLM, "prompt": "Hi", "max_tokens": 2}
    if path == "/v1/responses":
        return {"model": SMOLLM, "input": "Hi", "max_output_tokens": 2}
    return {"model": SMOLLM, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def _with(body: bytes, text: str) -> bytes:
    """`text` (JSON members) added at the end of the object `body`."""
    return body[:-1] + (b", " if len(body) > 2 else b"") + text.encode() + b"}"


@st.composite
def request_like(draw, path: str) -> bytes:
    """The route's request with fields dropped and others set to random values, serialised and
    perhaps mangled: truncated, a bad byte inserted, a key repeated, a number no float holds."""
    base = _base(path)
    dropped = draw(st.sets(st.sampled_from(sorted(base))))
    doc = {k: v for k, v in base.items() if k not in dropped} | draw(st.dictionaries(KEYS, VALUES, max_size=3))
    body = json.dumps(doc, ensure_ascii=draw(st.booleans())).encode()
    at = draw(st.integers(0, len(body)))
    return draw(st.sampled_from([
        body, body[:at], body[:at] + draw(st.sampled_from(BAD_BYTES)) + body[at:],
        _with(body, f'"{draw(st.sampled_from(FIELDS))}": {json.dumps(draw(VALUES))}'),
        _with(body, f'"{draw(st.sampled_from(FIELDS))}": {draw(st.sampled_from(NUMBERS))}'),
        _with(body, f'"max_tokens": {"9" * draw(st.integers(1, 6000))}'),
        b"[" + body + b"]", body.decode().encode("utf-16")]))


@st.composite
def deep(draw) -> bytes:
    """Nesting from shallow to far past Python's recursion limit and the body limit (around the
    server's bound, and where the parser's own limit falls); balanced or not, alone or as a field's
    value."""
    depth = draw(st.integers(1, 3000) | st.integers(250, 262) | st.integers(900, 1100)
                 | st.sampled_from([5000, 20_000, 60_000]))
    opener, closer = draw(st.sampled_from([("[", "]"), ('{"a": ', "}"), ('{"messages": [', "]}")]))
    nest = opener * depth + draw(st.sampled_from(["1", '"x"', ""])) + closer * draw(st.sampled_from([depth, 0]))
    field = draw(st.sampled_from(["", "prompt", "messages", "input", "tools", "response_format"]))
    return (nest if not field else f'{{"model": "{SMOLLM}", "{field}": {nest}}}').encode()


def bodies(path: str) -> st.SearchStrategy[bytes]:
    oversized = st.integers(LIMIT - 64, 3 * LIMIT).map(lambda n: b'{"prompt": "' + b"x" * n + b'"}')
    # the request-like and the deep bodies twice: they reach the most checks
    return st.one_of(request_like(path), request_like(path), deep(), deep(), oversized,
                     VALUES.map(lambda v: json.dumps(v).encode()), st.binary(max_size=64), st.just(b""))


def mostly(usual: list, others: list) -> st.SearchStrategy:
    """One of `usual` four times in five, else one of `others`."""
    return st.integers(0, 4).flatmap(lambda i: st.sampled_from(others if i == 4 else usual))


@st.composite
def hostile_requests(draw) -> tuple[str, str, str | None, bytes]:
    """(method, request target, content type or None for no header, body)."""
    path = draw(mostly(GENERATION, OTHER_PATHS))
    method = draw(mostly(["POST"], METHODS))
    content_type = draw(mostly(["application/json"], CONTENT_TYPES))
    return method, path, content_type, draw(bodies(path))


def send(port: int, method: str, target: str, content_type: str | None, body: bytes) -> tuple[int, dict, bytes]:
    """One request on its own connection, as raw bytes; (status, content type and Allow, body)."""
    head = f"{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {len(body)}\r\n"
    head += "" if content_type is None else f"Content-Type: {content_type}\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        sock.sendall(head.encode() + b"\r\n" + body)
        answer = http.client.HTTPResponse(sock, method=method)
        answer.begin()
        headers = {k: answer.getheader(k) for k in ("content-type", "allow") if answer.getheader(k) is not None}
        return answer.status, headers, answer.read()


def _readable(status: int, headers: dict, body: bytes):
    content = json.loads(body) if body and headers.get("content-type") == "application/json" else body
    return status, headers, content


@settings(max_examples=120, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
@given(req=hostile_requests())
@example(req=("POST", "/v1/chat/completions", "application/json", b"[" * 5000 + b"]" * 5000))
@example(req=("POST", "/v1/completions", "application/json", b'{"prompt": ' + b"[" * 1200 + b"]" * 1200 + b"}"))
@example(req=("POST", "/v1/chat/completions", "application/json",
              b'{"messages": [{"role": ' + b"[" * 995 + b"]" * 995 + b', "content": "x"}]}'))
# where json.loads gave up in one process but not in a replica (its stack is shallower there)
@example(req=("POST", "/v1/completions", "application/json", b'{"prompt": ' + b"[" * 965 + b"]" * 965 + b"}"))
@example(req=("POST", "/v1/chat/completions", "application/json", b"[" * 257 + b"]" * 257))
@example(req=("PROPFIND", "/v1/completions", "application/json", b"{}"))
@example(req=("HEAD", "/metrics", None, b""))
@example(req=("GET", "/v1/mod%09els", None, b""))
def test_the_ingress_refuses_what_one_process_refuses(single, replicated, req):
    expected = _readable(*send(single.port, *req))
    if not 400 <= expected[0] < 500:
        return  # served (or a 5xx): not this test's concern
    assert _readable(*send(replicated.port, *req)) == expected, req[:3] + (req[3][:200],)


def test_nesting_is_counted_outside_json_strings():
    assert nests_deeper(b"[" * 4 + b"]" * 4, 3) and not nests_deeper(b"[" * 3 + b"]" * 3, 3)
    assert not nests_deeper(b'{"a": "[[[[{{{{", "b": "\\"[[[["}', 1)   # brackets in strings, escaped quotes
    assert not nests_deeper(b"[]" * 100, 1) and nests_deeper(b'{"a": [[' + b'"x"' + b"]]}", 2)


class _Replicas:
    """The replicas' Ray handle, standing in: each call runs `app` as a replica runs it."""

    def __init__(self, app) -> None:
        self.app, self.forward = app, self

    def options(self, **_):
        return self

    def remote(self, request):
        return _Stream(call_app(self.app, request))


class _Stream:
    def __init__(self, items) -> None:
        self.items = items

    async def __anext__(self):
        return await self.items.__anext__()

    def __aiter__(self):
        return self

    def cancel(self) -> None:
        self.closed = asyncio.ensure_future(self.items.aclose())


class _Board:
    draining = False

    class snapshot:  # noqa: N801 - the actor method's name
        @staticmethod
        async def remote() -> dict:
            return {}

    class is_draining:  # noqa: N801
        @staticmethod
        async def remote() -> bool:
            return _Board.draining


def test_metrics_behind_the_key_and_odd_requests_without_ray(tiny_qwen):
    config = ServerConfig(api_keys=["sk-parity"], metrics_require_key=True)
    client, engine = started_client(lambda: LLMEngine(engine_config(str(tiny_qwen)), progress=False), config)
    ingress = TestClient(Ingress(_Replicas(client.app), _Board(), config).__serve_build_asgi_app__())
    key = {"authorization": "Bearer sk-parity"}
    try:
        with client, ingress:
            for method, path, headers, body in [
                    ("GET", "/metrics", {}, b""), ("GET", "/metrics", {"authorization": "Bearer wrong"}, b""),
                    ("HEAD", "/metrics", key, b""), ("POST", "/metrics", key, b"{}"),
                    ("PROPFIND", "/v1/models", key, b""), ("GET", "/v1/mod%09els", key, b""),
                    ("POST", "/v1/completions", key, b"[" * 5000 + b"]" * 5000)]:
                ours, theirs = (c.request(method, path, headers=headers, content=body) for c in (ingress, client))
                assert (ours.status_code, ours.content) == (theirs.status_code, theirs.content), (method, path)
                assert 400 <= ours.status_code < 500, (method, path, ours.status_code)
            page = ingress.get("/metrics", headers=key)
            assert page.status_code == 200 and "specdec_replicas 0" in page.text   # the ingress's own page
            _Board.draining = True   # the deployment drains: new work is refused here, reads still pass
            late = ingress.post("/v1/completions", headers=key, json={"prompt": "hi", "max_tokens": 2})
            assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
            assert late.headers["retry-after"] == str(config.retry_after)
            assert ingress.get("/v1/models", headers=key).status_code == 200
    finally:
        _Board.draining = False
        engine.shutdown()
