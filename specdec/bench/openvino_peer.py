"""OpenVINO GenAI as a benchmark peer: its own virtual environment, installed on request, driven over a pipe.

openvino-genai is never a dependency of specdec: `install()` pip-installs the pinned wheels (and
`gguf`, for the draft's conversion) into `$SPECDEC_HOME/peers/openvino/`, and only when the user asks
(`specdec bench --peers openvino --install-peers`). `OpenVinoPeer` starts that venv's python on
`openvino_worker.py` and talks JSON Lines to it (protocol there). Three peers on the same GGUF files:
`openvino` (greedy), `openvino_spec` (its speculative decoding with the draft model) and
`openvino_lookup` (its prompt lookup), k drafts per step as our arms' -k. The draft GGUF is exported
once to an OpenVINO model folder cached under `models/` here (openvino_gguf.py), inside the worker.
"""
from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import TextIO

from specdec.bench.peer_worker import PeerWorker, run_step
from specdec.bench.peers import PeerError, PeerResult
from specdec.config import specdec_home
from specdec.fileio import atomic_write_text

VERSION = "2026.4.1.0"
GGUF_VERSION = "0.19.0"  # specdec's own pin: the requantization is tested with it
PACKAGES = (f"openvino-genai=={VERSION}", f"gguf=={GGUF_VERSION}")
WORKER = Path(__file__).with_name("openvino_worker.py")
MODES = {"openvino": "plain", "openvino_spec": "draft", "openvino_lookup": "lookup"}


def venv_dir() -> Path:
    return specdec_home() / "peers" / "openvino"


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def models_dir() -> Path:
    """Where the worker caches OpenVINO model folders exported from GGUF files."""
    return venv_dir() / "models"


def _marker() -> Path:
    return venv_dir() / "installed.json"


def install_hint() -> str:
    """What is missing and how to get it, for check_peers' message."""
    return f"({' '.join(PACKAGES)} in {venv_dir()}); add --install-peers to pip-install them there (once, seconds)"


def is_installed() -> bool:
    """True once `install()` finished and its import check passed (a marker file: no subprocess)."""
    try:
        marker = json.loads(_marker().read_text())
        return marker.get("packages") == list(PACKAGES) and venv_python().exists()
    except (OSError, ValueError):
        return False


def install(log: TextIO = sys.stderr) -> None:
    """Create the venv and pip-install PACKAGES (binary wheels) in it, streaming pip's output to
    `log`. Raises PeerError naming the failing step."""
    d = venv_dir()
    if d.exists():  # other versions: start from an empty venv (exported models go too: OpenVINO's IR)
        shutil.rmtree(d)
    t0 = time.perf_counter()
    print(f"openvino peer: installing {' '.join(PACKAGES)} into {d}", file=log, flush=True)
    _step([sys.executable, "-m", "venv", str(d)], "creating the virtual environment", log)
    _step([str(venv_python()), "-m", "pip", "install", "--disable-pip-version-check", "--only-binary", ":all:",
           *PACKAGES], "pip install", log)
    _step([str(venv_python()), "-c", "import gguf, openvino, openvino_genai; print(openvino_genai.__version__)"],
          "the import check", log)
    atomic_write_text(_marker(), json.dumps({"packages": list(PACKAGES),
                                             "install_seconds": time.perf_counter() - t0}))
    print(f"openvino peer: installed in {time.perf_counter() - t0:.0f}s", file=log, flush=True)


def _step(cmd: list[str], what: str, log: TextIO) -> None:
    run_step(cmd, f"openvino peer: {what}", log)


class OpenVinoPeer:
    """OpenVINO GenAI on the same GGUF file (its own quantized kernels, on the CPU), greedy; per
    `name` (MODES) plain, with the draft model, or with prompt lookup. One worker process per peer."""

    def __init__(self, name: str, model_path: Path, num_threads: int, draft_path: Path | None = None,
                 num_assistant_tokens: int = 4, max_ngram_size: int = 4, python: Path | None = None,
                 worker: Path = WORKER, models: Path | None = None) -> None:
        """`num_assistant_tokens`: drafts per step (openvino_spec, openvino_lookup); `max_ngram_size`:
        the longest n-gram prompt lookup matches; `models`: the exported-folder cache (models_dir())."""
        if MODES[name] == "draft" and draft_path is None:
            raise PeerError(f"peer {name} needs a draft model")
        self.name = name
        self.worker = PeerWorker(name, python or venv_python(), worker)
        self.pid = self.worker.pid
        try:
            reply = self.worker.call({"model_path": str(model_path), "mode": MODES[name],
                                      "draft_path": str(draft_path) if draft_path else None,
                                      "models_dir": str(models or models_dir()), "num_threads": num_threads,
                                      "num_assistant_tokens": num_assistant_tokens, "max_ngram_size": max_ngram_size})
        except PeerError:
            self.worker.close()
            raise
        self.load_seconds = reply["load_seconds"]
        self.version = reply.get("version")
        self.draft_folder = reply.get("draft_folder")

    def generate(self, prompt_ids: list[int], max_tokens: int) -> PeerResult:
        r = self.worker.call({"prompt_ids": prompt_ids, "max_tokens": max_tokens})
        return PeerResult.of(r["token_ids"], r["seconds"], r["ttft_seconds"])

    def close(self) -> None:
        self.worker.close()
