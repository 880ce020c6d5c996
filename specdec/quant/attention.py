"""Paged attention, batch-invariant: each query token attends, unmasked, over exactly its own context.

Masked multi-query SDPA changes a row once there is more than one query row (`layers.py` has the
whole story), so attention runs one query token at a time; its G query heads per KV head ride along
as G query rows, so repeated K/V heads are never materialized. With float32 caches on an AVX2 CPU
this is specdec's own kernel (`attention.cpp`), which reads K/V through the slots in place; otherwise
one SDPA call per query row. `AttentionMetadata` is the seam: the runner builds it from the
schedule (`runner/batch.py`), the model's layers read it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specdec.quant import kernel, kv_format
from specdec.quant.options import KernelOptions, layer_kernels


@dataclass
class SeqAttention:
    """One request's rows in the flat batch."""
    row_start: int            # first row of the request's new tokens
    num_new: int              # new tokens (queries) this step
    start_position: int       # context length before the new tokens
    context_slots: torch.Tensor  # [start_position + num_new] cache slot of every context token, in order


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_real_rows] where each new token's K/V goes
    seqs: list[SeqAttention]
    num_rows: int               # padded row count
    _row_contexts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def row_contexts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(every sequence's context slots, concatenated; each row's start in them; each row's context
        length, 0 for padding rows), for the attention kernel; built once per forward."""
        if self._row_contexts is None:
            start, length = [0] * self.num_rows, [0] * self.num_rows
            offset = 0
            for seq in self.seqs:
                for i in range(seq.num_new):
                    start[seq.row_start + i] = offset
                    length[seq.row_start + i] = seq.start_position + i + 1
                offset += seq.context_slots.shape[0]
            slots = torch.cat([seq.context_slots for seq in self.seqs]) if self.seqs else self.slot_mapping
            self._row_contexts = (slots.to(torch.int64).contiguous(), torch.tensor(start), torch.tensor(length))
        return self._row_contexts


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
                    meta: AttentionMetadata, options: KernelOptions = KernelOptions()) -> torch.Tensor:
    """q: [num_rows, num_heads, head_dim]; k, v: [num_rows, num_kv_heads, head_dim];
    cache: (k_cache, v_cache), each [num_kv_heads, num_slots, row width] (head-major, as the kernel reads
    it; rows in one of kv_format's formats).
    Writes the new K/V into their slots, then attends causally. Returns [num_rows, num_heads * head_dim]
    (padding rows are zero)."""
    k_cache, v_cache = cache
    num_real = meta.slot_mapping.shape[0]
    k_cache.index_copy_(1, meta.slot_mapping, kv_format.encode(k[:num_real].transpose(0, 1), k_cache.dtype))
    v_cache.index_copy_(1, meta.slot_mapping, kv_format.encode(v[:num_real].transpose(0, 1), v_cache.dtype))
    num_heads, head_dim = q.shape[1], q.shape[2]
    if (layer_kernels(q.dtype, q.device, options) and k_cache.dtype in kv_format.DTYPES and head_dim % 8 == 0
            and q.stride(1) == head_dim and q.stride(2) == 1 and q.shape[0] == meta.num_rows):
        out = torch.empty(q.shape[0], num_heads * head_dim, dtype=q.dtype)
        kernel.attention(q, k_cache, v_cache, *meta.row_contexts(), head_dim ** -0.5, out)
        return out
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros(q.shape[0], num_heads * head_dim, dtype=q.dtype, device=q.device)
    for seq in meta.seqs:
        # [num_kv_heads, context, head_dim]: a prefix of it is exactly one token's context
        keys = kv_format.decode(k_cache.index_select(1, seq.context_slots), q.dtype, head_dim)
        values = kv_format.decode(v_cache.index_select(1, seq.context_slots), q.dtype, head_dim)
        for i in range(seq.num_new):
            row = seq.row_start + i
            ctx = seq.start_position + i + 1
            query = q[row].view(num_kv_heads, group, head_dim)
            o = F.scaled_dot_product_attention(query, keys[:, :ctx], values[:, :ctx])
            out[row] = o.reshape(-1)
    return out
