"""The clients of `specdec bench soak`: a weighted mix of request kinds, each answer checked.

A request ends as `ok` (whole choices with a finish reason; a stream ending in [DONE] after one),
`rejected` (an invalid request answered with a 4xx error body), `dropped` (the client left on
purpose), `wrong` (whole, but not its reference's output: --check-outputs, soak_checked.py) or
`failed` (anything else, with what was wrong). Each outcome records the replica that
answered (the `x-specdec-replica` header; empty from one process), so that a soak which kills a
replica can tell the requests in flight on it from losses.
"""
from __future__ import annotations

import http.client
import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specdec.bench.soak_checked import CheckedPool

# kind -> weight in the mix
MIX = {"chat": 3, "stream": 3, "drop_stream": 2, "drop_wait": 1, "invalid": 2, "n2_logprobs": 1, "stop": 1,
       "no_spec": 1}
EXPECTED = {"invalid": "rejected", "drop_stream": "dropped", "drop_wait": "dropped"}  # other kinds: "ok"
INVALID = [b"{not json", b'{"prompt": "x", "temperature": 9}', b'{"prompt": "a\\ud800"}',
           b'{"prompt": "x", "model": "no-such-model"}', b'{"messages": []}', b'{"prompt": "x", "max_tokens": 0}',
           b'{"prompt": "x", "n": 99}', b'{"prompt": [999999999]}']


@dataclass
class Outcome:
    kind: str
    outcome: str          # ok | rejected (an invalid request's 4xx) | dropped (the client left) | wrong | failed
    seconds: float
    at: float             # seconds since the start of the soak
    detail: str = ""
    replica: str = ""     # the replica that answered (x-specdec-replica), if any


@dataclass
class Soak:
    url: str
    host: str
    port: int
    max_tokens: int
    prompts: list[str]
    outcomes: list[Outcome] = field(default_factory=list)
    api_key: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    checked: CheckedPool | None = None   # --check-outputs: the bodies sent and their references


def mix_of(s: Soak) -> dict[str, int]:
    return s.checked.mix if s.checked is not None else MIX


def request(s: Soak, path: str, body: bytes, method: str = "POST") -> tuple[http.client.HTTPConnection,
                                                                            http.client.HTTPResponse]:
    conn = http.client.HTTPConnection(s.host, s.port, timeout=900)
    conn.request(method, path, body=body, headers=headers(s))
    return conn, conn.getresponse()


def headers(s: Soak) -> dict[str, str]:
    return {"Content-Type": "application/json", **({"Authorization": f"Bearer {s.api_key}"} if s.api_key else {})}


def _body(s: Soak, kind: str, rng: random.Random) -> tuple[str, dict]:
    prompt = rng.choice(s.prompts)
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": s.max_tokens, "temperature": 0}
    if kind == "stop":
        return "/v1/chat/completions", {**chat, "stop": ["\n\n", "```"]}
    if kind == "no_spec":
        return "/v1/chat/completions", {**chat, "speculative": {"enabled": False}}
    if kind == "n2_logprobs":
        return "/v1/completions", {"prompt": prompt, "max_tokens": s.max_tokens, "n": 2, "logprobs": 2,
                                   "temperature": 0.8, "seed": rng.randrange(1 << 30)}
    if kind in ("stream", "drop_stream"):
        return "/v1/completions", {"prompt": prompt, "max_tokens": s.max_tokens, "temperature": 0, "stream": True,
                                   "stream_options": {"include_usage": True}}
    return "/v1/chat/completions", chat


def _check_json(kind: str, status: int, data: bytes) -> str:
    """'' when the answer is whole, else what is wrong."""
    if status != 200:
        return f"HTTP {status}: {data[:200]!r}"
    body = json.loads(data)
    choices = body.get("choices") or []
    if len(choices) != (2 if kind == "n2_logprobs" else 1):
        return f"{len(choices)} choices"
    if any(c.get("finish_reason") not in ("stop", "length") for c in choices):
        return "a choice without a finish reason"
    if kind == "n2_logprobs" and any(not c.get("logprobs") for c in choices):
        return "no logprobs"
    return ""


def _check_stream(resp: http.client.HTTPResponse, drop_after: int | None,
                  on_chunk: Callable[[dict], None] | None = None) -> str:
    """Read a stream to its end ('' when whole) or drop it after `drop_after` events ('dropped');
    each chunk goes to `on_chunk` (the checked mode reassembles the output)."""
    if resp.status != 200:
        return f"HTTP {resp.status}"
    events, finished = 0, False
    while True:
        line = resp.readline()
        if not line:
            return "the stream ended without [DONE]"
        if not line.startswith(b"data: "):
            continue
        events += 1
        if drop_after is not None and events >= drop_after:
            return "dropped"
        payload = line[6:].strip()
        if payload == b"[DONE]":
            return "" if finished else "[DONE] before a finish reason"
        chunk = json.loads(payload)
        if "error" in chunk:
            return f"error event: {chunk['error'].get('message')}"
        finished = finished or any(c.get("finish_reason") for c in chunk.get("choices", []))
        if on_chunk is not None:
            on_chunk(chunk)


def one(s: Soak, kind: str, rng: random.Random, replica: list[str]) -> tuple[str, str]:
    """(outcome, detail) of one request of `kind`; `replica[0]` is set to the replica that answered."""
    if kind == "invalid":
        conn, resp = request(s, rng.choice(["/v1/completions", "/v1/chat/completions"]), rng.choice(INVALID))
        data = resp.read()
        conn.close()
        ok = 400 <= resp.status < 500 and "error" in json.loads(data)
        return ("rejected", "") if ok else ("failed", f"invalid request answered {resp.status}")
    path, body = _body(s, kind, rng)
    conn, resp = None, None
    try:
        if kind == "drop_wait":
            conn = http.client.HTTPConnection(s.host, s.port, timeout=900)
            conn.request("POST", path, body=json.dumps(body).encode(), headers=headers(s))
            time.sleep(rng.uniform(0.2, 1.5))
            return "dropped", ""
        conn, resp = request(s, path, json.dumps(body).encode())
        replica[0] = resp.getheader("x-specdec-replica") or ""
        if body.get("stream"):
            problem = _check_stream(resp, rng.randint(1, 4) if kind == "drop_stream" else None)
            return ("dropped", "") if problem == "dropped" else ("failed" if problem else "ok", problem)
        problem = _check_json(kind, resp.status, resp.read())
        return ("failed" if problem else "ok", problem)
    finally:
        if conn is not None:
            conn.close()


def client(s: Soak, seed: int, deadline: float, start: float, budget: list[int], bar) -> None:
    rng = random.Random(seed)
    mix = mix_of(s)
    kinds, weights = list(mix), list(mix.values())
    send = s.checked.one if s.checked is not None else one
    while time.time() < deadline:
        with s.lock:
            if budget[0] == 0:
                return
            budget[0] -= 1
        kind = rng.choices(kinds, weights)[0]
        t0, replica = time.time(), [""]
        try:
            outcome, detail = send(s, kind, rng, replica)
        except Exception as e:  # noqa: BLE001 - a broken connection is a failed request, recorded
            outcome, detail = "failed", f"{type(e).__name__}: {e}"
        with s.lock:
            s.outcomes.append(Outcome(kind, outcome, time.time() - t0, t0 - start, detail, replica[0]))
        bar.update(1)
