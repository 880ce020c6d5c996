"""Per-request randomness and logprobs.

Every token, speculative or not, is chosen by `rejection_sample` (k = 0 is plain decoding); this
module draws the random tensors it needs from each request's own generator, so a seed fixes a
request's draws whatever else is in the batch.
"""
from __future__ import annotations

import torch


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()  # nondeterministic, from the OS
    else:
        g.manual_seed(seed)
    return g


def fill_random_inputs(generator: torch.Generator | None, num_drafts: int, uniforms: torch.Tensor,
                       noise: torch.Tensor) -> None:
    """Draw one request's randomness in place: uniforms [max_k] for the first num_drafts positions
    and Exp(1) noise [max_k + 1, vocab] for the first num_drafts + 1. Greedy requests pass None and
    keep the constants they were given (they draw nothing, so their generator is untouched)."""
    if generator is not None:
        uniforms[:num_drafts] = torch.rand(num_drafts, generator=generator)
        noise[: num_drafts + 1].exponential_(generator=generator)


def top_logprobs(raw_logits: torch.Tensor, token_id: int, n: int) -> dict[int, float]:
    """Log-probabilities of the target's raw distribution: the chosen token plus the top n."""
    logprobs = torch.log_softmax(raw_logits, dim=-1)
    out = {token_id: float(logprobs[token_id])}
    if n:
        vals, idx = torch.topk(logprobs, n)
        for v, i in zip(vals.tolist(), idx.tolist()):
            out.setdefault(i, v)
    return out
