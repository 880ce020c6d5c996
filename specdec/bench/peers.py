"""Peer arms of `specdec bench`: other engines decoding the same prompts from the same GGUF file.

A peer gets the chat-templated prompt ids our arms get, greedily decodes `max_tokens` tokens (EOS
ignored) and returns them with the wall time of the whole generate call. Its tokens/s is generated
tokens / that time, prefill included: what specdec's `RequestStats.tokens_per_second` is
(generated / submission-to-last-token, specdec/request.py). Peers never become engine dependencies:
transformers is a test dependency imported here lazily; llama.cpp lives in its own venv, built only
on request (llama_cpp_peer.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

PEERS = ("transformers", "transformers_assisted", "llama.cpp", "llama.cpp_lookup")
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


def check_peers(names: list[str], install: bool) -> None:
    """Refuse, before any model loads, peers that are unknown or cannot run: transformers missing,
    or llama.cpp not built and `install` (the --install-peers flag) not given."""
    from specdec.bench import llama_cpp_peer
    unknown = sorted(set(names) - set(PEERS))
    if unknown:
        raise ValueError(f"unknown peers {unknown}; choose from {', '.join(PEERS)}")
    if any(n.startswith("transformers") for n in names):
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise ValueError(f"peer transformers needs the transformers package: {TRANSFORMERS_INSTALL}") from None
    if any(n.startswith("llama.cpp") for n in names) and not install and not llama_cpp_peer.is_installed():
        raise ValueError(f"peer llama.cpp is not installed (llama-cpp-python=={llama_cpp_peer.VERSION} in "
                         f"{llama_cpp_peer.venv_dir()}); add --install-peers to build it there from source "
                         "(about 9 minutes, once)")


def make_peers(names: list[str], target_path: Path, draft_path: Path | None, num_threads: int, n_ctx: int,
               k: int, install: bool = False) -> dict[str, Peer]:
    """Load the named peers (check_peers first). `k`: drafts per step for llama.cpp_lookup, as our
    arms' -k. Builds llama.cpp first when it is missing and `install` is set."""
    from specdec.bench import llama_cpp_peer
    check_peers(names, install)
    if any(n.startswith("llama.cpp") for n in names) and not llama_cpp_peer.is_installed():
        llama_cpp_peer.install()
    peers: dict[str, Peer] = {}
    for name in names:
        if name == "transformers":
            peers[name] = TransformersPeer(name, target_path, num_threads)
        elif name == "transformers_assisted":
            if draft_path is None:
                raise ValueError("peer transformers_assisted needs a draft model: pass --draft")
            peers[name] = TransformersPeer(name, target_path, num_threads, draft_path)
        else:
            peers[name] = llama_cpp_peer.LlamaCppPeer(name, target_path, num_threads, n_ctx,
                                                      lookup=name == "llama.cpp_lookup", num_pred_tokens=k)
    return peers


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
