"""AsyncEngine: the LLMEngine on its own thread, fed by asyncio handlers.

The engine thread loops `step()` while there is work and sleeps on a condition otherwise. Handlers
add requests through `add()` (run in a worker thread: it takes the engine lock, which a step holds)
and receive each request's outputs on an asyncio.Queue. `abort()` never blocks the event loop: it
queues the id, and the engine thread applies aborts between steps (and polls for them when idle).
Engine construction (model loading) happens on the thread too, so the server answers /health with
503 until the models are ready. Readers (metrics, /v1/models) take `stats()`, a snapshot between two
steps; nothing outside this class touches the engine while it steps.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue as queue_mod
import threading
from collections.abc import AsyncIterator, Callable

from specdec.engine import LLMEngine
from specdec.metrics import EngineStats
from specdec.request import RequestOutput, SpecOptions
from specdec.sampling_params import SamplingParams

log = logging.getLogger("specdec.server")


class AsyncEngine:
    def __init__(self, build: Callable[[], LLMEngine]) -> None:
        self._build = build
        self.engine: LLMEngine | None = None
        self.error: BaseException | None = None
        self.lock = threading.Lock()              # held by a step, an add, a metrics snapshot
        self._wake = threading.Condition(self.lock)
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._aborts: queue_mod.SimpleQueue[str] = queue_mod.SimpleQueue()
        self._ids = itertools.count()
        self._stop = False
        self.on_finished: Callable[[RequestOutput], None] | None = None  # metrics hooks (engine thread)
        self.on_aborted: Callable[[str], None] | None = None
        self.on_added: Callable[[str, list[int], SamplingParams, SpecOptions | None], None] | None = None
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self.engine is not None

    def shutdown(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=30)

    # ---- handler side (event loop) --------------------------------------------------------------
    async def submit(self, prompt: str | list[int], params: SamplingParams,
                     spec: SpecOptions | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a request; returns its stream of outputs. Raises ValueError / QueueFull (and queues
        nothing) on a bad request. The caller must exhaust or `aclose()` the stream: closing it
        early aborts the request (a client that went away) and frees its blocks."""
        rid = f"req-{next(self._ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = (asyncio.get_running_loop(), queue)
        try:
            await asyncio.to_thread(self._add, rid, prompt, params, spec)
        except BaseException:
            self._queues.pop(rid, None)
            self.abort(rid)  # cancelled after the add went through: don't leave it running
            raise
        return self._stream(rid, queue)

    async def _stream(self, rid: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    finished = True
                    raise out
                finished = out.finished
                yield out
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self.abort(rid)

    def _add(self, rid: str, prompt: str | list[int], params: SamplingParams, spec: SpecOptions | None,
             background: bool = False) -> None:
        with self._wake:
            assert self.engine is not None, "engine not ready"
            req = self.engine.add_request(prompt, params, request_id=rid, speculative=spec, background=background)
            if self.on_added is not None and not background:
                self.on_added(rid, req.prompt_token_ids, params, spec)
            self._wake.notify()

    def abort(self, request_id: str) -> None:
        self._aborts.put(request_id)

    def submit_background(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          spec: SpecOptions | None = None) -> None:
        """Queue a low-priority request (admitted only when no other request waits, preempted first)
        whose outputs go to `on_finished` only, never to a client (shadow A/B copies). Blocks for a
        step; call it from the engine thread's hooks or a worker thread, never with the lock held.
        Raises ValueError / QueueFull (and queues nothing) on a bad request."""
        self._add(request_id, prompt, params, spec, background=True)

    def stats(self) -> EngineStats | None:
        """The engine's stats snapshot, taken between two steps; None while the models load."""
        if self.engine is None:
            return None
        with self.lock:
            return self.engine.stats()

    async def snapshot(self) -> EngineStats:
        """stats() without blocking the event loop (the engine must be ready)."""
        stats = await asyncio.to_thread(self.stats)
        assert stats is not None, "engine not ready"
        return stats

    async def call(self, fn: Callable[[LLMEngine], object]) -> object:
        """Run fn(engine) between two steps (admin actions); its exceptions propagate."""
        def locked():
            with self._wake:
                assert self.engine is not None, "engine not ready"
                result = fn(self.engine)
                self._wake.notify()
                return result
        return await asyncio.to_thread(locked)

    # ---- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            engine = self._build()
        except BaseException as e:  # noqa: BLE001 - reported through /health and the log
            log.exception("engine failed to start")
            self.error = e
            return
        with self._wake:
            self.engine = engine
        while True:
            with self._wake:
                self._apply_aborts(engine)
                while not self._stop and not engine.has_unfinished():
                    self._wake.wait(timeout=0.1)
                    self._apply_aborts(engine)
                    engine.poll_drafts()  # finished loads, idle unloads
                if self._stop:
                    return
                try:
                    outputs = engine.step()
                except Exception as e:  # noqa: BLE001 - fail the running requests, keep serving
                    log.exception("engine step failed")
                    self._fail_all(engine, e)
                    continue
            for out in outputs:
                self._deliver(out.request_id, out)
                if out.finished and self.on_finished is not None:
                    self.on_finished(out)

    def _apply_aborts(self, engine: LLMEngine) -> None:
        while not self._aborts.empty():
            rid = self._aborts.get()
            if engine.has_request(rid):
                engine.abort(rid)
                if self.on_aborted is not None:
                    self.on_aborted(rid)

    def _fail_all(self, engine: LLMEngine, error: Exception) -> None:
        for rid in engine.request_ids():
            engine.abort(rid)
            self._deliver(rid, RuntimeError("internal error while generating"))

    def _deliver(self, rid: str, item: object) -> None:
        target = self._queues.get(rid)
        if target is not None:
            loop, queue = target
            loop.call_soon_threadsafe(queue.put_nowait, item)
