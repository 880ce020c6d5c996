"""A `specdec serve` process on a free loopback port, for the server tests."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from specdec.server.metrics import read_samples


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], log_path: Path, api_key: str | None = None, timeout: float = 300,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        cmd = [sys.executable, "-m", "specdec.cli", "serve", *args, "--port", str(self.port)]
        if api_key:
            cmd += ["--api-key", api_key]
        env = {**{k: v for k, v in os.environ.items() if k != "SPECDEC_API_KEY"}, **(env or {})}
        self.log_path = log_path
        self._log = open(log_path, "wb")
        # its own process group: whatever it starts (Ray's daemons and workers) can be stopped with it
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._wait_ready(timeout)
        self.model = http_json(self, "/v1/models", key=api_key)[1]["data"][0]["id"]  # the served model id

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log_path.read_text()[-3000:]}")

    def client(self, **kw):
        from openai import OpenAI
        kw.setdefault("api_key", self.api_key or "unused")
        return OpenAI(base_url=self.url + "/v1", max_retries=0, **kw)

    def metrics(self) -> dict[str, float]:
        """Prometheus samples as {'name{labels}': value}, without the model_name label every
        specdec series carries (test_server_vllm checks it)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        return read_samples(text)

    def wait_idle(self, timeout: float = 60) -> dict[str, float]:
        """Metrics once no request is running or waiting."""
        deadline = time.time() + timeout
        while True:
            m = self.metrics()
            if m.get("specdec_num_requests_running") == 0 and m.get("specdec_num_requests_waiting") == 0:
                return m
            if time.time() > deadline:
                raise TimeoutError(f"server still busy: {m}")
            time.sleep(0.2)

    def stop(self, timeout: float = 20) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything of its group left behind
        self._log.close()


def yaml_server(directory: Path, yaml: str, args: tuple[str, ...] = ("--threads", "1"),
                api_key: str | None = None) -> ServerProcess:
    """A server started from `yaml` (written to directory/config.yaml), logging to directory/server.log."""
    cfg = directory / "config.yaml"
    cfg.write_text(yaml)
    return ServerProcess(["--config", str(cfg), *args], directory / "server.log", api_key=api_key)


def http_json(server: ServerProcess, path: str, body: bytes | dict | list | str | Iterator[bytes] | None = None,
              key: str | None = None, headers: dict | None = None) -> tuple[int, dict]:
    """(status, JSON body) of a GET (body None) or POST, HTTP errors included. An iterator body is sent
    chunked, without a Content-Length."""
    data = body if body is None or isinstance(body, (bytes, Iterator)) else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, method="GET" if data is None else "POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@contextlib.contextmanager
def in_process_server(build, config=None, log_config: dict | None = None):
    """An AsyncEngine made by `build` behind a uvicorn server on a free port, in this process (so a
    test can gate or slow the engine, count the event loop's tasks); yields (engine, a handle with
    .url, .port, .model and .loop) once listening. log_config None: uvicorn's loggers reach the root."""
    import uvicorn

    from specdec.config import ServerConfig
    from specdec.server.app import build_app
    from specdec.server.async_engine import AsyncEngine

    config = config or ServerConfig()
    engine = AsyncEngine(build, queue_timeout=config.queue_timeout)
    port = free_port()
    handle = type("S", (), {"url": f"http://127.0.0.1:{port}", "port": port, "model": "tiny", "loop": None})()

    class Server(uvicorn.Server):
        async def serve(self, sockets=None):
            handle.loop = asyncio.get_running_loop()
            await super().serve(sockets)

    server = Server(uvicorn.Config(build_app(engine, config, "tiny"), host="127.0.0.1", port=port,
                                   log_level="warning", log_config=log_config, access_log=False))
    thread = threading.Thread(target=server.run)
    engine.start()
    thread.start()
    try:
        deadline = time.time() + 60
        while not server.started and time.time() < deadline:
            time.sleep(0.05)
        yield engine, handle
    finally:
        server.should_exit = True
        thread.join(30)
        engine.shutdown()


@contextlib.contextmanager
def slow_server(model_path: str, seconds_per_step: float = 0.02):
    """in_process_server on a tiny model whose every engine step sleeps first (so a client can leave
    while its request runs, whatever the machine's speed), once its model is loaded; yields
    (engine, handle, metrics) with metrics() reading /metrics."""
    from conftest import engine_config
    from specdec.engine import LLMEngine

    class SlowEngine(LLMEngine):
        def step(self):
            time.sleep(seconds_per_step)
            return super().step()

    with in_process_server(lambda: SlowEngine(engine_config(model_path), progress=False)) as (engine, handle):
        deadline = time.time() + 60
        while not engine.ready and time.time() < deadline:
            time.sleep(0.05)
        yield engine, handle, lambda: ServerProcess.metrics(handle)


def started_client(build, config):
    """Starlette's TestClient on an app around an AsyncEngine made by `build`, once its models are
    loaded; returns (client, engine): the caller enters the client and shuts the engine down."""
    from fastapi.testclient import TestClient

    from specdec.server.app import build_app
    from specdec.server.async_engine import AsyncEngine

    engine = AsyncEngine(build)
    engine.start()
    deadline = time.time() + 120
    while engine.engine is None and engine.error is None and time.time() < deadline:
        time.sleep(0.05)
    return TestClient(build_app(engine, config, "tiny")), engine
