"""An HTTP request as plain data (what the ingress sends a replica) and the replica side of the
relay: run the app on it over ASGI and yield the response head, then its body chunks as the app
sends them (an SSE stream arrives event by event). No Ray here: the tests drive it directly."""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from specdec.serve_ray.affinity import SEPARATOR

Headers = list[tuple[bytes, bytes]]
_HOP_BY_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade", b"content-length"}
_ABORT_SECONDS = 5.0  # after the relay stops: time the app gets to see the disconnect and abort


@dataclass
class Forwarded:
    """One HTTP request, whole. `affinity` is the text whose prefix the router matches (the
    prompt or the conversation; empty for requests that generate nothing)."""
    method: str
    path: str
    query: bytes = b""
    headers: Headers = field(default_factory=list)
    body: bytes = b""
    client: str = "127.0.0.1"
    affinity: str = ""


@dataclass
class Head:
    status: int
    headers: Headers


def forwarded_headers(raw: Headers, body: bytes) -> Headers:
    """The client's headers without hop-by-hop ones, with the buffered body's own length."""
    kept = [(k, v) for k, v in raw if k.lower() not in _HOP_BY_HOP]
    return kept + [(b"content-length", str(len(body)).encode())]


def affinity_text(path: str, body: bytes, key_scope: str = "") -> str:
    """The text a generation request starts with: the completion prompt, or the chat messages in
    order (role and content), as the chat template lays them out (a Responses request's
    instructions and input items as the chat messages they become); after its cache scope (the API
    key's, `key_scope`, and the request's cache_salt), so that requests follow each other to a
    replica only where they could share its caches. Empty for anything else, and for a body it
    cannot read: the text only steers the routing, and the replica's app answers that body."""
    if path not in ("/v1/completions", "/v1/chat/completions", "/v1/responses") or not body:
        return ""
    try:
        doc = json.loads(body)
        if not isinstance(doc, dict):
            return ""
        salt = doc.get("cache_salt")
        scope = key_scope + (f"\x00{salt}" if isinstance(salt, str) else "")
        return (f"{scope}{SEPARATOR}" if scope else "") + _prompt_text(path, doc)
    except Exception:  # noqa: BLE001 - not JSON, nested past Python's recursion limit, ...: no hint
        return ""


def _prompt_text(path: str, doc: dict) -> str:
    if path == "/v1/completions":
        prompt = doc.get("prompt")
        prompt = prompt[0] if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else prompt
        return prompt if isinstance(prompt, str) else json.dumps(prompt)
    messages = doc.get("messages") if path != "/v1/responses" else _response_messages(doc)
    if not isinstance(messages, list):
        return ""
    return "".join(f"<{m.get('role')}>{_content_text(m.get('content'))}{SEPARATOR}" for m in messages
                   if isinstance(m, dict))


def _response_messages(doc: dict) -> list[dict] | None:
    """A Responses request's instructions and message items as chat messages (calls and their
    outputs carry no text the prefix needs)."""
    items = doc.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list):
        return None
    instructions = doc.get("instructions")
    head = [{"role": "system", "content": instructions}] if isinstance(instructions, str) else []
    return head + [i for i in items if isinstance(i, dict) and "role" in i]


def _content_text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _with_queued(out: asyncio.Queue, chunk: bytes) -> tuple[bytes, bool]:
    """`chunk` joined with the body chunks already queued behind it (each hop through Ray costs CPU:
    under load, one message carries several events), and whether the body ended among them."""
    parts = [chunk]
    while not out.empty():
        nxt = out.get_nowait()
        if nxt is None:
            return b"".join(parts), True
        parts.append(nxt)
    return b"".join(parts), False


async def call_app(app, request: Forwarded, extra_headers: Headers = ()) -> AsyncIterator[Head | bytes]:
    """Run the ASGI `app` on `request`; yield its Head (with `extra_headers` added), then each body
    chunk. Closing this generator early is a client that went away: the app sees http.disconnect."""
    out: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": request.method, "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
             "query_string": request.query, "root_path": "", "headers": request.headers,
             "client": (request.client, 0), "server": ("127.0.0.1", 80)}
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            await out.put(Head(message["status"], [*message.get("headers", []), *extra_headers]))
        elif message["type"] == "http.response.body":
            if message.get("body"):
                await out.put(bytes(message["body"]))
            if not message.get("more_body", False):
                await out.put(None)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await out.put(None)

    task = asyncio.create_task(run())
    done = False
    try:
        while not done and (item := await out.get()) is not None:
            if isinstance(item, bytes):
                item, done = _with_queued(out, item)
            yield item
    finally:
        gone.set()  # the answer is complete, or its reader went away: either way the connection ends
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), _ABORT_SECONDS)
    if task.done() and not task.cancelled() and task.exception() is not None:
        raise task.exception()
