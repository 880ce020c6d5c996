"""Teacher forcing: the raw logits a runner gives each position of a known text, for scoring."""
from __future__ import annotations

import torch

from specdec.core.kv_cache_manager import KVCacheManager
from specdec.core.outputs import ScheduledChunk, SchedulerOutput
from specdec.runner.model_runner import ModelRunner


def teacher_forcing(runner: ModelRunner, kv: KVCacheManager, budget: int, max_model_len: int, rid: str,
                    prompt_token_ids: list[int], output_token_ids: list[int]) -> torch.Tensor:
    """The raw float32 logits that predict each output token, [len(output_token_ids), vocab], in
    chunks of at most `budget` tokens through `kv` under the temporary request id `rid` (prompt
    blocks the prefix cache holds are reused). Quality tools score text with it."""
    if not prompt_token_ids:
        raise ValueError("score_tokens needs at least one prompt token")
    all_ids = prompt_token_ids + output_token_ids
    if len(all_ids) > max_model_len:
        raise ValueError(f"{len(all_ids)} tokens exceed the engine's max_model_len {max_model_len}")
    inputs = all_ids[:-1]             # the last token predicts nothing we score
    first_scored = len(prompt_token_ids) - 1  # this position's logits predict the first output token
    cached = kv.find_cached_prefix(prompt_token_ids)  # only ever ends before first_scored
    start = len(cached) * kv.block_size
    rows: list[torch.Tensor] = []
    try:
        kv.allocate(rid, len(inputs) - start, cached)
        for pos in range(start, len(inputs), budget):
            chunk_ids = inputs[pos:pos + budget]
            end = pos + len(chunk_ids)
            num_logits = max(0, end - max(pos, first_scored))  # the scored rows are a suffix of inputs
            chunk = ScheduledChunk(rid, chunk_ids, pos, list(kv.block_tables[rid]), num_logits)
            out = runner.execute(SchedulerOutput([chunk], len(chunk_ids), kv.take_pending_copies()))
            rows.append(out.logits[:num_logits].float())
    finally:
        kv.free(rid)
    logits = torch.cat(rows)
    assert logits.shape[0] == len(output_token_ids)
    return logits
