"""llama.cpp as a benchmark peer: its own virtual environment, built on demand, driven over a pipe.

llama-cpp-python is never a dependency of specdec: `install()` builds it from source (CPU only, for
this machine's instruction set; about 9 minutes on 2 cores) into `$SPECDEC_HOME/peers/llama-cpp/`,
and only when the user asks (`specdec bench --peers llama.cpp --install-peers`). `LlamaCppPeer`
starts that venv's python on `llama_cpp_worker.py` and talks JSON Lines to it (protocol there).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TextIO

from specdec.bench.peers import PeerError, PeerResult
from specdec.config import specdec_home
from specdec.fileio import atomic_write_text

VERSION = "0.3.36"
WORKER = Path(__file__).with_name("llama_cpp_worker.py")
# CPU build tuned to this machine (GGML_NATIVE: -march=native); no GPU backends, no system BLAS
CMAKE_ARGS = "-DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_BLAS=OFF"


def venv_dir() -> Path:
    return specdec_home() / "peers" / "llama-cpp"


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def _marker() -> Path:
    return venv_dir() / "installed.json"


def is_installed() -> bool:
    """True once `install()` finished and its import check passed (a marker file: no subprocess)."""
    try:
        return json.loads(_marker().read_text()).get("version") == VERSION and venv_python().exists()
    except (OSError, ValueError):
        return False


def install(log: TextIO = sys.stderr) -> None:
    """Create the venv and build llama-cpp-python==VERSION in it, streaming pip's verbose output
    (the compiler lines are the progress) to `log`. Raises PeerError naming the failing step."""
    d = venv_dir()
    t0 = time.perf_counter()
    print(f"llama.cpp peer: building llama-cpp-python=={VERSION} from source into {d} "
          "(about 9 minutes on 2 cores)", file=log, flush=True)
    if not venv_python().exists():
        _step([sys.executable, "-m", "venv", str(d)], "creating the virtual environment", log)
    env = {**os.environ, "CMAKE_ARGS": CMAKE_ARGS, "FORCE_CMAKE": "1",
           "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)}
    _step([str(venv_python()), "-m", "pip", "install", "-v", "--no-binary", "llama-cpp-python",
           f"llama-cpp-python=={VERSION}"], "pip install", log, env)
    _step([str(venv_python()), "-c", "import llama_cpp, llama_cpp.llama_speculative; print(llama_cpp.__version__)"],
          "the import check", log)
    atomic_write_text(_marker(), json.dumps({"version": VERSION, "cmake_args": CMAKE_ARGS,
                                             "build_seconds": time.perf_counter() - t0}))
    print(f"llama.cpp peer: installed in {time.perf_counter() - t0:.0f}s", file=log, flush=True)


def _step(cmd: list[str], what: str, log: TextIO, env: dict | None = None) -> None:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    tail: list[str] = []
    for line in proc.stdout:  # stream, so a 9-minute build shows it is alive
        log.write(line)
        log.flush()
        tail = (tail + [line])[-20:]
    if proc.wait() != 0:
        raise PeerError(f"llama.cpp peer: {what} failed (exit {proc.returncode}):\n{''.join(tail)}")


class LlamaCppPeer:
    """Greedy decoding in llama.cpp on the same GGUF file (its own quantized kernels), optionally with
    prompt-lookup speculation (`LlamaPromptLookupDecoding`). One worker process per peer."""

    def __init__(self, name: str, model_path: Path, num_threads: int, n_ctx: int, lookup: bool = False,
                 num_pred_tokens: int = 4, python: Path | None = None, worker: Path = WORKER) -> None:
        self.name = name
        # -P: the worker's folder (specdec/bench) must not shadow modules llama_cpp imports
        self.proc = subprocess.Popen([str(python or venv_python()), "-P", str(worker)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.pid = self.proc.pid  # spec_bench counts its CPU as the bench's own, not competition
        reply = self._call({"model_path": str(model_path), "n_ctx": n_ctx, "n_threads": num_threads,
                            "lookup": lookup, "num_pred_tokens": num_pred_tokens})
        self.load_seconds = reply["load_seconds"]
        self.version = reply.get("version")

    def _call(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise PeerError(f"{self.name} worker exited (code {self.proc.wait()}); see its stderr above")
        reply = json.loads(line)
        if "error" in reply:
            raise PeerError(f"{self.name} worker: {reply['error']}")
        return reply

    def generate(self, prompt_ids: list[int], max_tokens: int) -> PeerResult:
        r = self._call({"prompt_ids": prompt_ids, "max_tokens": max_tokens})
        return PeerResult.of(r["token_ids"], r["seconds"], r["ttft_seconds"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # EOF: the worker exits its loop
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
