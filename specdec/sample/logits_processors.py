"""Logits processors: penalties, temperature, top-k, top-p, min-p.

Applied row by row with each request's own parameters, in the order penalties -> temperature ->
top-k -> top-p -> min-p. The speculative path applies exactly the same functions to draft and
target rows, so both sides sample from the same processed distribution.
"""
from __future__ import annotations

import torch

from specdec.sampling_params import SamplingParams


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                    output_ids: list[int]) -> torch.Tensor:
    """logits: [vocab]. Repetition penalty over prompt + output (divide positive logits, multiply
    negative ones); presence and frequency penalties over the output only (OpenAI semantics)."""
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long, device=logits.device),
                                minlength=logits.shape[-1])[: logits.shape[-1]].to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [vocab], already divided by the temperature. Filtered entries become -inf."""
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # keep the smallest set reaching top_p: drop a token once the mass before it already does
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if params.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


def process_logits(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                   output_ids: list[int]) -> torch.Tensor:
    """One row [vocab] of raw float32 logits -> processed logits (a copy) for sampling.
    Greedy requests get penalties only: temperature and filters cannot change the argmax."""
    out = logits.clone()
    if params.needs_penalties:
        out = apply_penalties(out, params, prompt_ids, output_ids)
    if params.greedy:
        return out
    out = out / params.temperature
    return apply_top_k_top_p_min_p(out, params)
