"""Per-request randomness and logprobs.

Every token, speculative or not, is chosen by `rejection_sample` (k = 0 is plain decoding), with
random draws from each request's own generator (made here), so a seed fixes a request's draws
whatever else is in the batch.
"""
from __future__ import annotations

import hashlib

import numpy as np
import torch


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()  # nondeterministic, from the OS
    else:
        g.manual_seed(seed)
    return g


def request_seed(engine_seed: int, index: int) -> int:
    """The seed of the index-th request without one of its own, on an engine seeded with engine_seed
    (hashed, so that neighbouring requests' streams are unrelated)."""
    digest = hashlib.blake2b(f"{engine_seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # < 2**63: torch seeds and the draft's seed + 1 both fit


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1): the first maximum of each row, NaN counting as the largest, as torch takes it.
    A float32 CPU tensor goes through numpy's vectorised argmax: torch's is a scalar loop, about ten
    times slower over a 152k vocabulary, and greedy decoding takes several a step."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.requires_grad:
        return x.argmax(-1)
    return torch.from_numpy(np.asarray(x.numpy().argmax(-1)))


def top_logprobs(raw_logits: torch.Tensor, token_id: int, n: int) -> dict[int, float]:
    """Log-probabilities of the target's raw distribution: the chosen token plus the top n."""
    logprobs = torch.log_softmax(raw_logits, dim=-1)
    out = {token_id: float(logprobs[token_id])}
    if n:
        vals, idx = torch.topk(logprobs, n)
        for v, i in zip(vals.tolist(), idx.tolist()):
            out.setdefault(i, v)
    return out
