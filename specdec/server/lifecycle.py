"""The server process around the app: graceful shutdown, and the answer to unparsable HTTP.

On SIGTERM or SIGINT the server stops admitting work (503 with Retry-After; /health says
`draining`), gives the requests in flight `drain_seconds` to finish, then ends the rest with an error
(a final event on each open stream, an error body for the others) and lets uvicorn close the
connections. A second signal quits at once. With `server.suffix_cache_path` the suffix cache is
saved at the end of the drain, and loaded when the engine is built."""
from __future__ import annotations

import asyncio
import json
import logging
import os

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from specdec.engine import LLMEngine
from specdec.server.async_engine import RequestFailed
from specdec.server.context import ServerContext
from specdec.server.errors import error_body

log = logging.getLogger("specdec.server")
_SETTLE_SECONDS = 5.0  # after the failures are delivered: time for handlers to write them out


async def _wait_idle(ctx: ServerContext, seconds: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while ctx.engine.num_client_requests and loop.time() < deadline:
        await asyncio.sleep(0.05)


async def drain(ctx: ServerContext) -> None:
    """Stop admitting, wait for the requests in flight, end those left after drain_seconds."""
    ctx.draining = True
    seconds = ctx.config.drain_seconds
    log.info("draining: %d request(s) in flight get up to %g s", ctx.engine.num_client_requests, seconds)
    await _wait_idle(ctx, seconds)
    left = ctx.engine.num_client_requests
    if left:
        log.info("drain time is over: ending %d request(s)", left)
        ctx.engine.fail_all(RequestFailed(503, "the server is shutting down", "shutting_down", retry=True))
        await _wait_idle(ctx, _SETTLE_SECONDS)
    if ctx.config.suffix_cache_path is not None and ctx.engine.ready:
        await _save_suffix_cache(ctx, ctx.config.suffix_cache_path)


async def _save_suffix_cache(ctx: ServerContext, path: str) -> None:
    try:
        tokens = await ctx.engine.call(lambda engine: engine.save_suffix_cache(path))
        log.info("suffix cache: saved %d tokens to %s", tokens, path)
    except OSError as e:
        log.error("suffix cache: could not save to %s: %s", path, e)


def restore_suffix_cache(engine: LLMEngine, path: str) -> None:
    """Load the suffix cache saved at `path` (on the engine thread, before serving). No file: a first
    start. A file it cannot trust is refused, said once on the log, and the server starts empty (the
    next drain replaces it)."""
    if not os.path.exists(path):
        log.info("suffix cache: %s does not exist yet; starting empty", path)
        return
    try:
        log.info("suffix cache: loaded %d tokens from %s", engine.load_suffix_cache(path), path)
    except ValueError as e:
        log.error("suffix cache refused, starting empty: %s", e)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first exit signal drains `ctx` before shutting down."""

    def __init__(self, config: uvicorn.Config, ctx: ServerContext) -> None:
        super().__init__(config)
        self.ctx = ctx
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig, frame) -> None:
        if self._loop is None or self.ctx.draining:  # before startup, or a second signal
            return super().handle_exit(sig, frame)
        self.ctx.draining = True
        self._loop.call_soon_threadsafe(self._start)

    def _start(self) -> None:
        task = asyncio.ensure_future(drain(self.ctx))
        task.add_done_callback(self._drained)

    def _drained(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("drain failed: %s", task.exception())
        self.should_exit = True


class JSONErrorsH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, whose answer to a request it cannot parse (broken framing, a bad
    Content-Length, oversized headers) is an OpenAI-style error body like every other error."""

    def send_400_response(self, msg: str) -> None:
        body = json.dumps(error_body(400, f"malformed HTTP request: {msg}")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()
