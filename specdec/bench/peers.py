"""Peer arms of `specdec bench`: other engines decoding the same prompts from the same GGUF file.

A peer gets the chat-templated prompt ids our arms get, greedily decodes `max_tokens` tokens (EOS
ignored) and returns them with the wall time of the whole generate call. Its tokens/s is generated
tokens / that time, prefill included: what specdec's `RequestStats.tokens_per_second` is
(generated / submission-to-last-token, specdec/request.py). Peers never become engine dependencies:
transformers is a test dependency imported here lazily; llama.cpp and OpenVINO GenAI live in their
own venvs, installed only on request (llama_cpp_peer.py, openvino_peer.py). A peer that fails to
install, load or run becomes a `FailedPeer` holding a one-line reason: the bench records it, goes on.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

PEERS = ("transformers", "transformers_assisted", "llama.cpp", "llama.cpp_lookup",
         "openvino", "openvino_spec", "openvino_lookup")
DRAFTED_PEERS = ("transformers_assisted", "openvino_spec")  # peers that run the draft model too
TRANSFORMERS_INSTALL = "pip install -e '.[test]'  (or: pip install transformers==5.24.0 accelerate)"


class PeerError(ValueError):
    """A peer could not be built, loaded or run (a ValueError: the CLI prints it without a traceback)."""


@dataclass
class PeerResult:
    token_ids: list[int]
    seconds: float              # the whole generate call, prefill included
    generated_tokens: int
    tokens_per_second: float    # generated_tokens / seconds, as specdec's stats
    ttft_seconds: float         # call to first token (the prefill)
    decode_tokens_per_second: float  # (generated - 1) / (seconds - ttft), as specdec's stats

    @classmethod
    def of(cls, token_ids: list[int], seconds: float, ttft_seconds: float) -> PeerResult:
        n = len(token_ids)
        decode = seconds - ttft_seconds
        return cls(list(token_ids), seconds, n, n / max(seconds, 1e-9), ttft_seconds,
                   (n - 1) / decode if n > 1 and decode > 0 else 0.0)

    def stats(self) -> dict:
        return {"generated_tokens": self.generated_tokens, "seconds": self.seconds,
                "ttft_seconds": self.ttft_seconds, "tokens_per_second": self.tokens_per_second,
                "decode_tokens_per_second": self.decode_tokens_per_second}


class Peer(Protocol):
    name: str
    load_seconds: float

    def generate(self, prompt_ids: list[int], max_tokens: int) -> PeerResult: ...

    def close(self) -> None: ...


def _families() -> dict[str, object]:
    """Peer name prefix -> the module that installs that engine's venv (is_installed, install,
    install_hint)."""
    from specdec.bench import llama_cpp_peer, openvino_peer
    return {"llama.cpp": llama_cpp_peer, "openvino": openvino_peer}


def check_peers(names: list[str], install: bool) -> None:
    """Refuse, before any model loads, peers that are unknown or cannot run: transformers missing,
    or llama.cpp / OpenVINO not installed and `install` (the --install-peers flag) not given."""
    unknown = sorted(set(names) - set(PEERS))
    if unknown:
        raise ValueError(f"unknown peers {unknown}; choose from {', '.join(PEERS)}")
    if any(n.startswith("transformers") for n in names):
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise ValueError(f"peer transformers needs the transformers package: {TRANSFORMERS_INSTALL}") from None
    for family, module in _families().items():
        if any(n.startswith(family) for n in names) and not install and not module.is_installed():
            raise ValueError(f"peer {family} is not installed {module.install_hint()}")


def failure_reason(error: BaseException) -> str:
    """One line for the JSON and the table: the first line of the message and, for a longer one
    (an install step's output tail), its last line."""
    lines = [ln.strip() for ln in str(error).strip().splitlines() if ln.strip()] or [type(error).__name__]
    reason = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return reason if len(reason) <= 300 else reason[:297] + "..."


@dataclass
class FailedPeer:
    """A peer that failed to install, load or run: every generate raises its reason, so the bench
    records it per prompt without retrying a broken engine."""
    name: str
    failed: str
    load_seconds: float | None = None
    version: str | None = None

    def generate(self, prompt_ids: list[int], max_tokens: int) -> PeerResult:
        raise PeerError(self.failed)

    def close(self) -> None:
        pass


def make_peers(names: list[str], target_path: Path, draft_path: Path | None, num_threads: int, n_ctx: int,
               k: int, install: bool = False) -> dict[str, Peer]:
    """Load the named peers (check_peers first). `k`: drafts per step for llama.cpp_lookup and the
    speculative OpenVINO peers, as our arms' -k. Installs llama.cpp / OpenVINO first when missing and
    `install` is set. A peer whose install or load fails comes back as a FailedPeer."""
    check_peers(names, install)
    drafted = [n for n in names if n in DRAFTED_PEERS]
    if drafted and draft_path is None:
        raise ValueError(f"peers {', '.join(drafted)} need a draft model: pass --draft")
    failed = _install_missing(names)
    peers: dict[str, Peer] = {}
    for name in names:
        family = next((f for f in failed if name.startswith(f)), None)
        if family is not None:
            peers[name] = FailedPeer(name, failed[family])
            continue
        try:
            peers[name] = _make_peer(name, target_path, draft_path, num_threads, n_ctx, k)
        except Exception as e:  # noqa: BLE001 - an engine's failure is a result, not the end of the run
            peers[name] = FailedPeer(name, failure_reason(e))
            print(f"peer {name} failed to load: {e}", file=sys.stderr)
    return peers


def _install_missing(names: list[str]) -> dict[str, str]:
    """Install each engine asked for and missing; family -> reason for those that failed."""
    failed = {}
    for family, module in _families().items():
        if any(n.startswith(family) for n in names) and not module.is_installed():
            try:
                module.install()
            except Exception as e:  # noqa: BLE001 - recorded per peer, the bench goes on
                failed[family] = failure_reason(e)
                print(f"peer {family} failed to install: {e}", file=sys.stderr)
    return failed


def _make_peer(name: str, target_path: Path, draft_path: Path | None, num_threads: int, n_ctx: int, k: int) -> Peer:
    from specdec.bench import llama_cpp_peer, openvino_peer
    from specdec.config import NgramConfig
    if name == "transformers":
        return TransformersPeer(name, target_path, num_threads)
    if name == "transformers_assisted":
        return TransformersPeer(name, target_path, num_threads, draft_path)
    if name.startswith("openvino"):
        # prompt lookup's longest n-gram: our ngram arm's default
        return openvino_peer.OpenVinoPeer(name, target_path, num_threads, draft_path, num_assistant_tokens=k,
                                          max_ngram_size=NgramConfig.max_n)
    return llama_cpp_peer.LlamaCppPeer(name, target_path, num_threads, n_ctx, lookup=name == "llama.cpp_lookup",
                                       num_pred_tokens=k)


def peer_entry(peer: Peer) -> dict:
    """A peer's entry in the bench JSON: load time, version, and `failed` for a FailedPeer."""
    entry = {"load_seconds": peer.load_seconds, "version": getattr(peer, "version", None)}
    return {**entry, "failed": peer.failed} if isinstance(peer, FailedPeer) else entry


def run_peer(peers: dict[str, Peer], name: str, ids: list[int], max_tokens: int) -> PeerResult | str:
    """One peer run, or its failure's reason. A failed peer is closed and replaced by a FailedPeer
    for the rest of the run: a broken engine is not retried (nor waited on) prompt after prompt."""
    try:
        return peers[name].generate(ids, max_tokens)
    except Exception as e:  # noqa: BLE001 - an engine's failure is a result, not the end of the run
        reason = failure_reason(e)
        peer = peers[name]
        if not isinstance(peer, FailedPeer):
            print(f"peer {name} failed: {e}", file=sys.stderr)
            try:
                peer.close()
            except Exception:  # noqa: BLE001 - already failed; the reason above is the one that counts
                pass
            peers[name] = FailedPeer(name, reason, peer.load_seconds, getattr(peer, "version", None))
        return reason


def _load_transformers(path: Path):  # pragma: no cover - needs a real GGUF that transformers reads
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, torch_dtype=torch.float32)
    return model.eval()


class _FirstToken:  # pragma: no cover - used with a real model
    """A transformers streamer that only notes when the first generated token arrives (its first
    `put` is the prompt)."""

    def __init__(self) -> None:
        self.puts, self.at = 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


class TransformersPeer:
    """transformers float32 from the GGUF file (dequantized on load), greedy; with a draft model,
    its assisted generation (speculative decoding with its own candidate-length heuristic)."""

    def __init__(self, name: str, model_path: Path, num_threads: int, draft_path: Path | None = None) -> None:
        self.name = name
        self.num_threads = num_threads
        t0 = time.perf_counter()
        self.model = _load_transformers(model_path)
        self.draft = _load_transformers(draft_path) if draft_path is not None else None
        self.load_seconds = time.perf_counter() - t0

    def generate(self, prompt_ids: list[int], max_tokens: int) -> PeerResult:  # pragma: no cover - real model
        import torch
        ids = torch.tensor([prompt_ids])
        extra = {"assistant_model": self.draft} if self.draft is not None else {}
        eos = self.model.generation_config.eos_token_id
        pad = eos[0] if isinstance(eos, list) else eos  # silences the "setting pad_token_id" warning
        threads = torch.get_num_threads()
        torch.set_num_threads(self.num_threads)  # transformers runs on torch's process-wide count
        first = _FirstToken()
        try:
            t = time.perf_counter()
            with torch.inference_mode():
                # min_new_tokens masks EOS until max_tokens, like our ignore_eos
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                          min_new_tokens=max_tokens, do_sample=False,
                                          pad_token_id=pad, streamer=first, **extra)
            secs = time.perf_counter() - t
        finally:
            torch.set_num_threads(threads)
        return PeerResult.of(out[0, ids.shape[1]:].tolist(), secs, (first.at or t + secs) - t)

    def close(self) -> None:
        self.model = self.draft = None
