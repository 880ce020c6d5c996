"""The specdec side of a peer that lives in its own virtual environment: install steps, and the pipe.

A peer engine (llama.cpp, OpenVINO GenAI) is never imported by specdec. Its venv's python runs a
worker script that imports nothing of specdec; `PeerWorker` starts it and exchanges JSON Lines
with it, one reply per request, `{"error": ...}` for a failure (each worker's docstring holds its
protocol). `run_step` runs one install command, streaming its output.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import TextIO

from specdec.bench.peers import PeerError


def run_step(cmd: list[str], what: str, log: TextIO, env: dict | None = None) -> None:
    """Run `cmd`, streaming its stdout and stderr to `log`; PeerError naming `what` (with the last 20
    lines) when it fails."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    tail: list[str] = []
    for line in proc.stdout:  # stream, so a minutes-long build shows it is alive
        log.write(line)
        log.flush()
        tail = (tail + [line])[-20:]
    if proc.wait() != 0:
        raise PeerError(f"{what} failed (exit {proc.returncode}):\n{''.join(tail)}")


class PeerWorker:
    """One worker process: `python -P script`, requests on its stdin, replies on its stdout; its
    stderr is ours (the engine's own logging shows there)."""

    def __init__(self, name: str, python: Path, script: Path) -> None:
        self.name = name
        # -P: the script's folder (specdec/bench) must not shadow modules the peer engine imports
        self.proc = subprocess.Popen([str(python), "-P", str(script)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.pid = self.proc.pid  # spec_bench counts its CPU as the bench's own, not competition

    def call(self, request: dict) -> dict:
        """Send one request, return its reply; PeerError for an error reply or a worker that died."""
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):  # ValueError: stdin already closed
            pass  # the worker is gone: readline below says so
        line = self.proc.stdout.readline()
        if not line:
            raise PeerError(f"{self.name} worker exited (code {self.proc.wait()}); see its stderr above")
        reply = json.loads(line)
        if "error" in reply:
            raise PeerError(f"{self.name} worker: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # EOF: the worker exits its loop
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
