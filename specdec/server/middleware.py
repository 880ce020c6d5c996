"""Request gates: the body-size limit (ASGI middleware) and the API-key checks (FastAPI
dependencies for the routes that need them)."""
from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import JSONResponse

from specdec.server.context import context
from specdec.server.errors import APIError, error_body

_DRAIN_FACTOR = 16  # an oversized body is drained up to this many times the limit


class BodyLimit:
    """ASGI middleware: 413 for a body over `limit` bytes (declared or actually sent). The body is
    read here (bounded) and replayed to the app."""

    def __init__(self, app, limit: int, on_reject: Callable[[int], None] | None = None) -> None:
        self.app, self.limit, self.on_reject = app, limit, on_reject

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        too_large = declared is not None and (not declared.isdigit() or int(declared) > self.limit)
        chunks, size, more = [], 0, True
        while more and not too_large:
            msg = await receive()
            if msg["type"] != "http.request":
                return  # the client went away before sending its body
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            more = msg.get("more_body", False)
            too_large = size > self.limit
        if too_large:
            await self._drain(receive, more)
            if self.on_reject is not None:
                self.on_reject(413)
            response = JSONResponse(error_body(413, f"request body larger than {self.limit} bytes"), status_code=413)
            return await response(scope, receive, send)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _drain(self, receive, more: bool) -> None:
        """Read and discard the rest of an oversized body (up to a cap), so that a client still
        writing it reads the 413 instead of a broken pipe; past the cap the connection just closes."""
        left = _DRAIN_FACTOR * self.limit
        while more and left > 0:
            msg = await receive()
            if msg["type"] != "http.request":
                return
            left -= len(msg.get("body", b""))
            more = msg.get("more_body", False)


async def check_auth(request: Request) -> None:
    """With an API key configured, require `Authorization: Bearer KEY` (401 otherwise)."""
    ctx = context(request)
    if ctx.config.api_key is None:
        return
    given = hashlib.sha256(request.headers.get("authorization", "").encode()).digest()
    if not hmac.compare_digest(given, ctx.expected_auth):  # digests: equal length, so no length leak
        raise APIError(401, "invalid or missing API key (Authorization: Bearer ...)", code="invalid_api_key")


async def check_admin(request: Request) -> None:
    """Admin routes change what the server runs: without an API key they are off (403)."""
    if context(request).config.api_key is None:
        raise APIError(403, "admin endpoints are disabled: start the server with an API key")
    await check_auth(request)
