"""The ingress deployment: the one HTTP entry of a replicated deployment. It reads each request
(bounded by the server's body limit), sends it whole to a replica through the request router, and
relays the answer as it comes. GET /metrics is its own: every replica's page, labelled, and the
sums (behind server.metrics_require_key, a replica's app checks the key first). Every other request,
whatever its method, path or body, is the replica's app's to answer: what one process refuses, the
ingress refuses alike.

A replica that dies before it answered: the request goes to another (twice at most), so a request
that had not started is not lost. One that dies while its answer streams: an error event and
`data: [DONE]` end the stream cleanly (503, code `replica_failed`, which a client may retry)."""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging

from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import request_response

from specdec.config import ServerConfig
from specdec.server.errors import error_body
from specdec.server.middleware import BodyLimit
from specdec.serve_ray.exposition import merge
from specdec.serve_ray.forward import Forwarded, Head, affinity_text, forwarded_headers

log = logging.getLogger("specdec.serve_ray")
REPLICA_GONE = (RayActorError, ActorUnavailableError)
ATTEMPTS = 3


class Relay:
    """An ASGI response: the replica's Head, then its chunks as they arrive."""

    def __init__(self, head: Head, chunks, ingress: "Ingress") -> None:
        self.head, self.chunks, self.ingress = head, chunks, ingress

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.head.status, "headers": self.head.headers})
        sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in self.head.headers)
        done = False
        try:
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            done = True
        except REPLICA_GONE as e:
            self.ingress.failures += 1
            log.warning("a replica died while answering: %s", e)
            if sse:
                event = error_body(503, "the replica serving this request failed; retry it", code="replica_failed")
                tail = f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()
                await send({"type": "http.response.body", "body": tail, "more_body": True})
        finally:
            if not done:
                self.chunks.cancel()  # the client went away (or the replica did): stop the work there
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class Ingress:
    """The ingress deployment class (wrapped by `serve.ingress()` below; options set in launch.py)."""

    def __init__(self, replicas, board, server_config: ServerConfig) -> None:
        self.replicas, self.board, self.config = replicas, board, server_config
        self.retries = self.failures = 0

    def __serve_build_asgi_app__(self):
        middleware = [Middleware(BodyLimit, limit=self.config.max_body_bytes)]
        app = Starlette(middleware=middleware, exception_handlers={Exception: _internal_error})
        # no routes: Starlette's router would answer an odd method, or a path its patterns miss (one
        # with a newline), itself in plain text; `dispatch` takes every request
        app.router.default = request_response(self.dispatch)
        return app

    async def dispatch(self, request: Request):
        if request.method == "GET" and request.scope["path"] == "/metrics":
            return await self.metrics(request)
        return await self.forward(request)

    async def forward(self, request: Request):
        # a replica learns of a drain at its next metrics push (up to PUSH_SECONDS later): new work (the
        # POST routes) is refused here from the moment the deployment drains; reads still reach replicas
        if request.method == "POST" and await self.board.is_draining.remote():
            return JSONResponse(error_body(503, "the server is shutting down", code="shutting_down"),
                                status_code=503, headers={"Retry-After": str(self.config.retry_after)})
        body = await request.body()
        # the path as the client sent it (request.url.path is re-parsed: it drops a tab or a newline)
        fwd = Forwarded(request.method, request.scope["path"], request.scope.get("query_string", b""),
                        forwarded_headers(request.scope["headers"], body), body,
                        request.client.host if request.client else "127.0.0.1",
                        affinity_text(request.scope["path"], body, self._key_scope(request)))
        for attempt in range(ATTEMPTS):
            chunks = self.replicas.forward.options(stream=True).remote(fwd)
            try:
                return Relay(await chunks.__anext__(), chunks, self)
            except REPLICA_GONE as e:
                chunks.cancel()
                self.failures += 1
                self.retries += attempt + 1 < ATTEMPTS
                log.warning("a replica died before answering (attempt %d): %s", attempt + 1, e)
            except StopAsyncIteration:
                return JSONResponse(error_body(500, "internal server error"), status_code=500)
        return JSONResponse(error_body(503, "no replica could take the request; retry it", code="replica_failed"),
                            status_code=503, headers={"Retry-After": str(self.config.retry_after)})

    def _key_scope(self, request: Request) -> str:
        """Under `cache_scope: api_key`, a name for the request's key (a digest of its header)."""
        if self.config.cache_scope != "api_key":
            return ""
        return hashlib.sha256(request.headers.get("authorization", "").encode()).hexdigest()[:12]

    async def metrics(self, request: Request):
        if self.config.metrics_require_key:  # the replicas hold the keys (a keys file is theirs to read)
            gate = await self.forward(request)
            if not isinstance(gate, Relay) or gate.head.status != 200:
                return gate
            gate.chunks.cancel()
        pages = await self.board.snapshot.remote()
        page = await asyncio.to_thread(merge, {r: p for r, (p, _) in pages.items()},
                                       self._own_families({r: info for r, (_, info) in pages.items()}))
        return Response(page, media_type=CONTENT_TYPE_LATEST)

    def _own_families(self, replicas: dict[str, dict]) -> str:
        info = "".join(f'specdec_replica_info{{replica="{r}",pid="{i.get("pid")}"}} 1\n'
                       for r, i in sorted(replicas.items()))
        return (f"# HELP specdec_replicas Engine replicas reporting metrics\n# TYPE specdec_replicas gauge\n"
                f"specdec_replicas {len(replicas)}\n"
                f"# HELP specdec_replica_info Each live replica and its process id\n"
                f"# TYPE specdec_replica_info gauge\n{info}"
                f"# HELP specdec_ingress_replica_failures Requests whose replica died under them\n"
                f"# TYPE specdec_ingress_replica_failures counter\n"
                f"specdec_ingress_replica_failures_total {self.failures}\n"
                f"# HELP specdec_ingress_retries Requests sent to another replica after one died first\n"
                f"# TYPE specdec_ingress_retries counter\nspecdec_ingress_retries_total {self.retries}\n")


async def _internal_error(request: Request, e: Exception) -> JSONResponse:
    """The app's answer to anything unexpected (Starlette's own is plain text); logged by Ray."""
    return JSONResponse(error_body(500, "internal server error"), status_code=500)


IngressDeployment = serve.ingress()(Ingress)
