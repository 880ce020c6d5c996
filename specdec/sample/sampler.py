"""Sampler: processed logits -> token ids, one seeded generator per request; top-N logprobs."""
from __future__ import annotations

import torch

from specdec.sampling_params import SamplingParams


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()  # nondeterministic, from the OS
    else:
        g.manual_seed(seed)
    return g


def sample_token(processed: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """processed: [vocab] logits after `process_logits`. Greedy takes the argmax (lowest id on ties)."""
    if params.greedy:
        return int(torch.argmax(processed))
    probs = torch.softmax(processed, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def top_logprobs(raw_logits: torch.Tensor, token_id: int, n: int) -> dict[int, float]:
    """Log-probabilities of the model's raw distribution: the chosen token plus the top n."""
    logprobs = torch.log_softmax(raw_logits, dim=-1)
    out = {token_id: float(logprobs[token_id])}
    if n:
        vals, idx = torch.topk(logprobs, n)
        for v, i in zip(vals.tolist(), idx.tolist()):
            out.setdefault(i, v)
    return out
