"""llama.cpp as a benchmark peer: its own virtual environment, built on demand, driven over a pipe.

llama-cpp-python is never a dependency of specdec: `install()` builds it from source (CPU only, for
this machine's instruction set; about 9 minutes on 2 cores) into `$SPECDEC_HOME/peers/llama-cpp/`,
and only when the user asks (`specdec bench --peers llama.cpp --install-peers`). `LlamaCppPeer`
starts that venv's python on `llama_cpp_worker.py` and talks JSON Lines to it (protocol there;
the pipe is peer_worker.py's).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import TextIO

import numpy as np

from specdec.bench.peer_worker import PeerWorker, run_step
from specdec.bench.peers import PeerResult
from specdec.config import specdec_home
from specdec.fileio import atomic_write_text

VERSION = "0.3.36"
WORKER = Path(__file__).with_name("llama_cpp_worker.py")
# CPU only: no GPU backends, no system BLAS
BASE_CMAKE_ARGS = "-DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_BLAS=OFF"
# /proc/cpuinfo flag -> ggml's switch for it, for a build without AMX (below)
ISA_SWITCHES = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C", "bmi2": "GGML_BMI2",
                "avx_vnni": "GGML_AVX_VNNI", "avx512f": "GGML_AVX512", "avx512vbmi": "GGML_AVX512_VBMI",
                "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16"}


def cmake_args(cpu_flags: set[str] | None = None) -> str:
    """Tuned to this machine (GGML_NATIVE: -march=native), except on CPUs with AMX: llama.cpp's AMX
    path (which -march=native turns on) segfaults on multi-token batches of this Q4_K_M file
    (ggml-org/llama.cpp#20824; seen on a Sapphire Rapids VM), so there each instruction set the CPU has
    is named instead and AMX left out."""
    flags = _cpu_flags() if cpu_flags is None else cpu_flags
    if "amx_int8" not in flags:
        return f"-DGGML_NATIVE=ON {BASE_CMAKE_ARGS}"
    isa = " ".join(f"-D{switch}={'ON' if flag in flags else 'OFF'}" for flag, switch in ISA_SWITCHES.items())
    return f"-DGGML_NATIVE=OFF {isa} -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF {BASE_CMAKE_ARGS}"


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def venv_dir() -> Path:
    return specdec_home() / "peers" / "llama-cpp"


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def _marker() -> Path:
    return venv_dir() / "installed.json"


def install_hint() -> str:
    """What is missing and how to get it, for check_peers' message."""
    return (f"(llama-cpp-python=={VERSION} in {venv_dir()}); add --install-peers to build it there from source "
            "(about 9 minutes, once)")


def is_installed() -> bool:
    """True once `install()` finished and its import check passed (a marker file: no subprocess)."""
    try:
        marker = json.loads(_marker().read_text())
        return marker.get("version") == VERSION and marker.get("cmake_args") == cmake_args() and venv_python().exists()
    except (OSError, ValueError):
        return False


def install(log: TextIO = sys.stderr) -> None:
    """Create the venv and build llama-cpp-python==VERSION in it, streaming pip's verbose output
    (the compiler lines are the progress) to `log`. Raises PeerError naming the failing step."""
    d = venv_dir()
    if d.exists():  # another version or build flags: start from an empty venv (pip would keep the old build)
        shutil.rmtree(d)
    t0 = time.perf_counter()
    print(f"llama.cpp peer: building llama-cpp-python=={VERSION} from source into {d} "
          "(about 9 minutes on 2 cores)", file=log, flush=True)
    if not venv_python().exists():
        _step([sys.executable, "-m", "venv", str(d)], "creating the virtual environment", log)
    args = cmake_args()
    env = {**os.environ, "CMAKE_ARGS": args, "FORCE_CMAKE": "1",
           "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)}
    _step([str(venv_python()), "-m", "pip", "install", "-v", "--no-cache-dir", "--no-binary", "llama-cpp-python",
           f"llama-cpp-python=={VERSION}"], "pip install", log, env)
    _step([str(venv_python()), "-c", "import llama_cpp, llama_cpp.llama_speculative; print(llama_cpp.__version__)"],
          "the import check", log)
    atomic_write_text(_marker(), json.dumps({"version": VERSION, "cmake_args": args,
                                             "build_seconds": time.perf_counter() - t0}))
    print(f"llama.cpp peer: installed in {time.perf_counter() - t0:.0f}s", file=log, flush=True)


def _step(cmd: list[str], what: str, log: TextIO, env: dict | None = None) -> None:
    run_step(cmd, f"llama.cpp peer: {what}", log, env)


class LlamaCppPeer:
    """Greedy decoding in llama.cpp on the same GGUF file (its own quantized kernels), optionally with
    prompt-lookup speculation (`LlamaPromptLookupDecoding`). One worker process per peer."""

    def __init__(self, name: str, model_path: Path, num_threads: int, n_ctx: int, lookup: bool = False,
                 num_pred_tokens: int = 4, python: Path | None = None, worker: Path = WORKER,
                 logits_all: bool = False) -> None:
        """`logits_all`: keep every position's logits, for `score` (costs memory: n_ctx x vocab floats)."""
        self.name = name
        self.worker = PeerWorker(name, python or venv_python(), worker)
        self.proc, self.pid = self.worker.proc, self.worker.pid
        reply = self.worker.call({"model_path": str(model_path), "n_ctx": n_ctx, "n_threads": num_threads,
                                  "lookup": lookup, "num_pred_tokens": num_pred_tokens, "logits_all": logits_all})
        self.load_seconds = reply["load_seconds"]
        self.version = reply.get("version")

    def generate(self, prompt_ids: list[int], max_tokens: int) -> PeerResult:
        r = self.worker.call({"prompt_ids": prompt_ids, "max_tokens": max_tokens})
        return PeerResult.of(r["token_ids"], r["seconds"], r["ttft_seconds"])

    def score(self, ids: list[int], scratch: Path) -> tuple[np.ndarray, float]:
        """The logits of every position of `ids` in one evaluation ([len(ids), vocab] float32, handed
        over through a .npy file in `scratch`) and its seconds."""
        path = scratch / f"llama-logits-{self.pid}.npy"
        try:
            r = self.worker.call({"score_ids": ids, "logits_path": str(path)})
            return np.load(path), r["seconds"]
        finally:
            path.unlink(missing_ok=True)

    def step(self, ids: list[int], context: int) -> float:
        """Seconds of one forward of ids[context:] after the context, logits at every new row."""
        return self.worker.call({"step_ids": ids, "context": context})["seconds"]

    def close(self) -> None:
        self.worker.close()
