"""Perplexity of a finished output under an engine's target model (teacher forcing).

`score_tokens` feeds prompt + output through the engine's own ModelRunner, in prefill-sized
chunks, and reads the raw log-probabilities (temperature 1, no filters; never-sample ids stay at
-inf as in sampling) of each output token given everything before it. It borrows KV blocks from
the engine's pool under a temporary request id, reusing the prompt's cached prefix blocks when
present, and frees them afterwards without hashing anything. Batch invariance makes these
log-probs equal, bitwise, to the ones step-by-step decoding sees. Run it only on an idle engine.
"""
from __future__ import annotations

import math

import torch

from specdec.engine import LLMEngine



def score_tokens(engine: LLMEngine, prompt_token_ids: list[int], output_token_ids: list[int]) -> list[float]:
    """Natural-log probability of each output token under the engine's target.

    Args:
        engine: an engine with no unfinished requests (its pool and runner are borrowed).
        prompt_token_ids: the context, at least one token.
        output_token_ids: the tokens to score.
    Returns:
        one log-prob per output token (empty for an empty output)."""
    if not output_token_ids:
        return []
    logprobs = torch.log_softmax(teacher_logits(engine, prompt_token_ids, output_token_ids), dim=-1)
    picked = logprobs.gather(1, torch.tensor(output_token_ids, dtype=torch.long, device=logprobs.device)[:, None])
    return picked.squeeze(1).tolist()


def teacher_logits(engine: LLMEngine, prompt_token_ids: list[int], output_token_ids: list[int]) -> torch.Tensor:
    """The raw float32 logits that predict each output token: [len(output_token_ids), vocab]."""
    return engine.teacher_logits(prompt_token_ids, output_token_ids)


def perplexity(token_logprobs: list[float]) -> float | None:
    """exp(mean negative log-prob); None for no tokens (inf if a token had probability 0)."""
    if not token_logprobs:
        return None
    return math.exp(-sum(token_logprobs) / len(token_logprobs))
