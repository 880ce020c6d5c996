"""One engine replica: the single-process server's app (server/app.py) around its own engine,
driven over ASGI by the ingress (`forward`), plus the replica's /metrics page pushed to the
deployment's `MetricsBoard` every second so that the ingress can serve one page for all. The board
also carries the shutdown: once `specdec serve` asks it to drain, each replica's app drains as the
single process does on SIGTERM (server/lifecycle.py), and reports when it is done.

A replica whose configured draft model fails to load serves plain decoding (logged, and reported as
`specdec_replica_degraded` 1) rather than failing: one bad draft file does not take down the
deployment. Ray starts replicas afresh when one dies; `check_health` fails one whose engine died."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time

from prometheus_client import generate_latest

from specdec.config import EngineConfig, ServerConfig
from specdec.engine import LLMEngine
from specdec.serve_ray.forward import Forwarded, Head, call_app

log = logging.getLogger("specdec.serve_ray")
REPLICA_HEADER = b"x-specdec-replica"
PUSH_SECONDS = 1.0
_DEGRADED = ("# HELP specdec_replica_degraded 1: the configured draft failed to load here (plain decoding)\n"
             "# TYPE specdec_replica_degraded gauge\nspecdec_replica_degraded {}\n")


class MetricsBoard:
    """A small Ray actor: the latest /metrics page of each live replica (a page not refreshed for
    `ttl` seconds is a replica gone, and is dropped), and whether the deployment is shutting down."""

    def __init__(self, ttl: float = 5.0) -> None:
        self.ttl, self.pages, self.draining = ttl, {}, False

    def put(self, replica: str, page: str, info: dict) -> bool:
        """Store a replica's page; returns whether the replicas are to drain."""
        self.pages[replica] = (time.monotonic(), page, info)
        return self.draining

    def drain(self) -> None:
        self.draining = True

    def is_draining(self) -> bool:
        return self.draining

    def drained(self) -> bool:
        """Every live replica has drained (its requests finished or ended)."""
        return all(info.get("drained") for _, info in self.snapshot().values())

    def drop(self, replica: str) -> None:
        self.pages.pop(replica, None)

    def snapshot(self) -> dict[str, tuple[str, dict]]:
        now = time.monotonic()
        self.pages = {r: v for r, v in self.pages.items() if now - v[0] <= self.ttl}
        return {r: (page, info) for r, (_, page, info) in self.pages.items()}


def build_engine(config: EngineConfig) -> tuple[LLMEngine, str | None]:
    """The engine, and why it runs without its draft model (None when it has it)."""
    try:
        return LLMEngine(config, progress=False), None
    except Exception as e:  # noqa: BLE001 - any failure to build with the draft: try without it
        if config.speculative is None or config.speculative.draft_model is None:
            raise
        reason = f"the draft model {config.speculative.draft_model!r} failed to load: {e}"
        log.warning("%s; this replica serves plain decoding", reason)
        return LLMEngine(dataclasses.replace(config, speculative=None), progress=False), reason


class EngineReplica:
    """The Ray Serve deployment class of the engine replicas (options set in launch.py)."""

    async def __init__(self, engine_config: EngineConfig, server_config: ServerConfig, model_name: str,
                       board) -> None:
        from ray import serve

        from specdec.server.app import build_app
        from specdec.server.async_engine import AsyncEngine
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.board, self.degraded, self._drain = board, None, None

        def build() -> LLMEngine:
            engine, self.degraded = build_engine(engine_config)
            return engine

        self.engine = AsyncEngine(build, queue_timeout=server_config.queue_timeout)
        self.app = build_app(self.engine, server_config, model_name)
        self.engine.start()
        while self.engine.engine is None and self.engine.error is None:
            await asyncio.sleep(0.05)  # Ray routes nothing here until __init__ returns
        if self.engine.error is not None:
            raise RuntimeError(f"replica {self.replica_id}: the engine failed to start: {self.engine.error}")
        self._pusher = asyncio.create_task(self._push())
        log.info("replica %s ready (pid %d)", self.replica_id, os.getpid())

    async def forward(self, request: Forwarded):
        """The app's answer to `request`: a Head, then body chunks (a streaming call)."""
        async for item in call_app(self.app, request, [(REPLICA_HEADER, self.replica_id.encode())]):
            yield item

    async def check_health(self) -> None:
        if not self.engine.alive:
            raise RuntimeError(f"replica {self.replica_id}: the engine thread is gone")

    def info(self) -> dict:
        return {"pid": os.getpid(), "degraded": self.degraded,
                "drained": self._drain is not None and self._drain.done()}

    async def _push(self) -> None:
        from specdec.server.lifecycle import drain
        ctx = self.app.state.specdec
        while True:
            try:
                page = await asyncio.to_thread(generate_latest, ctx.metrics.registry)
                page += _DEGRADED.format(int(self.degraded is not None)).encode()
                if await self.board.put.remote(self.replica_id, page.decode(), self.info()) and self._drain is None:
                    self._drain = asyncio.create_task(drain(ctx))  # the SIGTERM drain of `specdec serve`
            except Exception as e:  # noqa: BLE001 - the next push may work; metrics never stop serving
                log.warning("replica %s: metrics push failed: %s", self.replica_id, e)
            await asyncio.sleep(PUSH_SECONDS)

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


__all__ = ["EngineReplica", "Forwarded", "Head", "MetricsBoard", "build_engine"]
