"""Perplexity of a finished output under an engine's target model (teacher forcing).

`score_tokens` feeds prompt + output through the engine's own ModelRunner, in prefill-sized
chunks, and reads the raw log-probabilities (temperature 1, no filters; never-sample ids stay at
-inf as in sampling) of each output token given everything before it. It borrows KV blocks from
the engine's pool under a temporary request id, reusing the prompt's cached prefix blocks when
present, and frees them afterwards without hashing anything. Batch invariance makes these
log-probs equal, bitwise, to the ones step-by-step decoding sees. Run it only on an idle engine.
"""
from __future__ import annotations

import itertools
import math

import torch

from specdec.core.outputs import ScheduledChunk, SchedulerOutput
from specdec.engine import LLMEngine

_ids = itertools.count()


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
    if not prompt_token_ids:
        raise ValueError("score_tokens needs at least one prompt token")
    if engine.has_unfinished():
        raise RuntimeError("score_tokens borrows the engine's runner: wait until its requests finish")
    all_ids = prompt_token_ids + output_token_ids
    if len(all_ids) > engine.max_model_len:
        raise ValueError(f"{len(all_ids)} tokens exceed the engine's max_model_len {engine.max_model_len}")
    inputs = all_ids[:-1]             # the last token predicts nothing we score
    first_scored = len(prompt_token_ids) - 1  # this position's logits predict the first output token
    kv = engine.kv
    rid = f"__score-{next(_ids)}"
    cached = kv.find_cached_prefix(prompt_token_ids)  # only ever ends before first_scored
    start = len(cached) * kv.block_size
    budget = engine.config.scheduler.max_num_batched_tokens
    rows: list[torch.Tensor] = []
    try:
        kv.allocate(rid, len(inputs) - start, cached)
        for pos in range(start, len(inputs), budget):
            chunk_ids = inputs[pos:pos + budget]
            end = pos + len(chunk_ids)
            num_logits = max(0, end - max(pos, first_scored))  # the scored rows are a suffix of inputs
            chunk = ScheduledChunk(rid, chunk_ids, pos, list(kv.block_tables[rid]), num_logits)
            out = engine.runner.execute(SchedulerOutput([chunk], len(chunk_ids), kv.take_pending_copies()))
            rows.append(out.logits[:num_logits].float())
    finally:
        kv.free(rid)
    logits = torch.cat(rows)
    assert logits.shape[0] == len(output_token_ids)
    return logits


def perplexity(token_logprobs: list[float]) -> float | None:
    """exp(mean negative log-prob); None for no tokens (inf if a token had probability 0)."""
    if not token_logprobs:
        return None
    return math.exp(-sum(token_logprobs) / len(token_logprobs))
