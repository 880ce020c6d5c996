"""One forward's inputs from the schedule: the chunks as flat token rows (padded to the model's row
alignment), each new token's cache slot, and each request's context for attention
(`AttentionMetadata`, the seam to the model's layers in `specdec.quant.attention`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from specdec.core.outputs import ScheduledChunk
from specdec.quant.attention import AttentionMetadata, SeqAttention
from specdec.quant.layers import pad_rows


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor   # [num_rows] token ids (padding rows: 0)
    positions: torch.Tensor   # [num_rows] each token's position (padding rows: 0)
    meta: AttentionMetadata   # meta.num_rows: the padded row count
    logit_rows: list[int]     # the rows whose logits the chunks ask for, in order
    cu_num_logits: list[int]  # [len(chunks) + 1] offsets of each chunk's logits among them


@functools.lru_cache(maxsize=None)
def _offsets(block_size: int) -> np.ndarray:
    return np.arange(block_size, dtype=np.int64)


def context_slots(block_ids: list[int], block_size: int, length: int) -> np.ndarray:
    """The cache slots of a context's first `length` tokens: every slot of its blocks, in order."""
    table = np.asarray(block_ids, dtype=np.int64)
    return (table[:, None] * block_size + _offsets(block_size)).reshape(-1)[:length]


def build_batch(chunks: list[ScheduledChunk], block_size: int, align: int, device: torch.device) -> ForwardBatch:
    """The flat rows of `chunks` (one after another), padded to a multiple of `align` rows; each
    token's cache slot comes from its request's block table (`block_size` slots a block). The index
    arithmetic is numpy's: a decode step builds this between forwards that flush the caches, and each
    small torch operation costs several times its numpy twin there."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[np.ndarray] = []
    seqs: list[SeqAttention] = []
    logit_rows: list[int] = []
    cu = [0]
    for chunk in chunks:
        n = len(chunk.token_ids)
        start = chunk.start_position
        ctx_slots = context_slots(chunk.block_ids, block_size, start + n)
        seqs.append(SeqAttention(len(ids), n, start, torch.from_numpy(ctx_slots).to(device)))
        slots.append(ctx_slots[start:])
        logit_rows.extend(range(len(ids) + n - chunk.num_logits, len(ids) + n))
        ids.extend(chunk.token_ids)
        positions.extend(range(start, start + n))
        cu.append(cu[-1] + chunk.num_logits)
    num_rows = pad_rows(len(ids), align)
    pad = num_rows - len(ids)
    input_ids = torch.tensor(ids + [0] * pad, dtype=torch.long, device=device)
    pos_t = torch.tensor(positions + [0] * pad, dtype=torch.long, device=device)
    slot_mapping = torch.from_numpy(np.concatenate(slots) if slots else np.zeros(0, dtype=np.int64)).to(device)
    meta = AttentionMetadata(slot_mapping, seqs, num_rows)
    return ForwardBatch(input_ids, pos_t, meta, logit_rows, cu)
