"""AsyncEngine: the LLMEngine on its own thread, fed by asyncio handlers.

The engine thread loops `step()` while there is work and sleeps on a condition otherwise. Handlers
add requests through `add()` (run in a worker thread: it takes the engine lock, which a step holds)
and receive each request's outputs on an asyncio.Queue. `abort()` never blocks the event loop: it
queues the id, and the engine thread applies aborts between steps (and polls for them when idle).
Engine construction (model loading) happens on the thread too, so the server answers /health with
503 until the models are ready. A request that waits longer than `queue_timeout` seconds without
starting fails with a 503 (a burst never leaves a client unanswered); `fail_all` ends every request
with an error (the end of a graceful drain). Readers (metrics, /v1/models) take `stats()`, a
snapshot between two steps; nothing outside this class touches the engine while it steps.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue as queue_mod
import threading
from collections.abc import Callable

from specdec.engine import LLMEngine
from specdec.metrics import EngineStats
from specdec.request import RequestOutput, SpecOptions
from specdec.sampling_params import SamplingParams

log = logging.getLogger("specdec.server")


class RequestFailed(Exception):
    """A request ended by the server rather than by its own stop condition; `status` is the HTTP
    status its client is answered with (503 with Retry-After when trying again later may succeed)."""

    def __init__(self, status: int, message: str, code: str | None = None, retry: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.retry = status, message, code, retry


class RequestStream:
    """One request's outputs, in order, as an async iterator; `close()` (idempotent, safe from any
    task, even while another awaits the next output) aborts the request if it has not finished."""

    def __init__(self, engine: AsyncEngine, rid: str, queue: asyncio.Queue) -> None:
        self.engine, self.request_id, self._queue = engine, rid, queue
        self.finished = self.closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self.closed:
            raise StopAsyncIteration
        out = await self._queue.get()
        if isinstance(out, BaseException):
            self.finished = True
            self.close()
            raise out
        self.finished = out.finished
        if self.finished:
            self.close()
        return out

    def close(self, reason: str = "the client went away") -> None:
        if self.closed:
            return
        self.closed = True
        self.engine._queues.pop(self.request_id, None)
        if not self.finished:
            log.info("request %s aborted: %s", self.request_id, reason)
            self.engine.abort(self.request_id)

    async def aclose(self) -> None:
        self.close()


class AsyncEngine:
    def __init__(self, build: Callable[[], LLMEngine], queue_timeout: float | None = None) -> None:
        self._build = build
        self.queue_timeout = queue_timeout
        self.engine: LLMEngine | None = None
        self.error: BaseException | None = None
        self.lock = threading.Lock()              # held by a step, an add, a metrics snapshot
        self._wake = threading.Condition(self.lock)
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._aborts: queue_mod.SimpleQueue[str | RequestFailed] = queue_mod.SimpleQueue()
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

    @property
    def alive(self) -> bool:
        """Started and not failed: the engine thread still runs (or builds the engine)."""
        return self.error is None and self._thread.is_alive()

    def shutdown(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=30)

    # ---- handler side (event loop) --------------------------------------------------------------
    async def submit(self, prompt: str | list[int], params: SamplingParams,
                     spec: SpecOptions | None = None) -> RequestStream:
        """Queue a request; returns its stream of outputs. Raises ValueError / QueueFull (and queues
        nothing) on a bad request. The caller must exhaust or close the stream: closing it early
        aborts the request (a client that went away) and frees its blocks. A stream whose request
        the server ends raises RequestFailed."""
        rid = f"req-{next(self._ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = (asyncio.get_running_loop(), queue)
        try:
            await asyncio.to_thread(self._add, rid, prompt, params, spec)
        except BaseException:
            self._queues.pop(rid, None)
            self.abort(rid)  # cancelled after the add went through: don't leave it running
            raise
        return RequestStream(self, rid, queue)

    @property
    def num_client_requests(self) -> int:
        """Requests whose client still waits for outputs (the drain waits for these)."""
        return len(self._queues)

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

    def fail_all(self, error: RequestFailed) -> None:
        """End every request, between two steps, with `error` delivered to its stream."""
        self._aborts.put(error)

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
                self._expire(engine)
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
                    self._fail_all(engine, RequestFailed(500, "internal error while generating"))
                    continue
            for out in outputs:
                # a grammar that hit a bound ended the request: its client gets the bound, not a cut-off text
                self._deliver(out.request_id, out if out.error is None else RequestFailed(
                    400, f"structured output: {out.error}", "structured_output_bound"))
                if out.finished and self.on_finished is not None:
                    self.on_finished(out)

    def _apply_aborts(self, engine: LLMEngine) -> None:
        while not self._aborts.empty():
            item = self._aborts.get()
            if isinstance(item, RequestFailed):
                self._fail_all(engine, item)
            elif engine.has_request(item):
                self._abort(engine, item)

    def _abort(self, engine: LLMEngine, rid: str, error: RequestFailed | None = None) -> None:
        engine.abort(rid)
        if self.on_aborted is not None:
            self.on_aborted(rid)
        if error is not None:
            self._deliver(rid, error)

    def _fail_all(self, engine: LLMEngine, error: RequestFailed) -> None:
        for rid in engine.request_ids():
            self._abort(engine, rid, error)

    def _expire(self, engine: LLMEngine) -> None:
        """Fail the requests that have waited longer than queue_timeout without starting."""
        if self.queue_timeout is None:
            return
        for rid in engine.waiting_longer_than(self.queue_timeout):
            self._abort(engine, rid, RequestFailed(
                503, f"the request waited {self.queue_timeout:g} s in the queue without starting; "
                     "the server is overloaded", "queue_timeout", retry=True))

    def _deliver(self, rid: str, item: object) -> None:
        target = self._queues.get(rid)
        if target is not None:
            loop, queue = target
            loop.call_soon_threadsafe(queue.put_nowait, item)
