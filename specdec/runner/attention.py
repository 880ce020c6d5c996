"""Batch-invariant building blocks: the linear layer and paged attention.

A token's result must not depend on what else shares its forward. Measured on these CPUs, float32
GEMM computes a row differently depending on the row count (regimes at 1, 2-3, 4-11 and >= 12 rows,
plus a tail kernel for rows past a multiple of 4), and masked multi-query SDPA changes a row once
there is more than one query row. So:
  * float32 `linear` on an AVX2 CPU runs specdec's own kernel (specdec.quant, `dense_linear`), which
    reduces every output in a fixed order whatever the row count: rows are not padded. It is also
    1.3-2x faster than MKL here (a 4-row x 3-feature register tile). Without the kernel,
    `W @ x.T` runs on blocks of exactly 4 or 8 rows (the 4-11 regime, no tail), rows padded to 4.
  * int4 (specdec.quant) reduces every output in a fixed order as well, so its rows are not padded.
  * attention runs one query token at a time, unmasked, over exactly its own context; its G query
    heads per KV head ride along as G query rows, so repeated K/V heads are never materialized.
    With float32 caches on an AVX2 CPU this is specdec's own kernel (`layer_ops.cpp`), which reads
    K/V through the slots in place; otherwise one SDPA call per query row.
bfloat16 GEMM was row-invariant as it is on the CPU, so it uses F.linear there. On a GPU the GEMM
library (and PyTorch's row reductions) pick a kernel, tiling and split by the row count, so every
linear layer and RMSNorm runs on blocks of exactly CUDA_ROW_BLOCK rows (rows padded to it): one
shape, one kernel, one summation order for every row. tests/test_batch_invariance.py checks all of
this bitwise (`pytest --device cuda` on a GPU machine).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specdec.quant import kernel
from specdec.quant.packed import QuantLinear

ROW_ALIGN = 4
_ROW_BLOCK = 8
# On an H200 a 64-row GEMM cost what one row does in bfloat16, up to 4x in float32: small beside a step.
CUDA_ROW_BLOCK = 64


def row_align(precision: str, device: str | torch.device = "cpu") -> int:
    """Rows of a forward are padded to a multiple of this (see the module docstring)."""
    if torch.device(device).type == "cuda":
        return CUDA_ROW_BLOCK
    if precision.startswith("int4") or (precision == "float32" and dense_kernel(torch.device(device))):
        return 1
    return ROW_ALIGN


def in_row_blocks(fn, x: torch.Tensor, block: int = CUDA_ROW_BLOCK) -> torch.Tensor:
    """fn over each `block`-row slice of x ([num_rows, ...]; zero rows pad the last slice), so that
    every call has one shape whatever the batch."""
    n = x.shape[0]
    if n % block:
        x = torch.cat([x, x.new_zeros(pad_rows(n, block) - n, *x.shape[1:])])
    out = fn(x) if x.shape[0] == block else torch.cat([fn(x[i:i + block]) for i in range(0, x.shape[0], block)])
    return out[:n]


def dense_kernel(device: torch.device) -> bool:
    return device.type == "cpu" and USE_DENSE_KERNEL and kernel.available()


USE_DENSE_KERNEL = True  # tests switch it off to check the MKL fallback
USE_LAYER_KERNELS = True  # the decoder's glue in C++ (tests switch it off to check PyTorch's path)
USE_FUSED_DECODER = True  # with the layer kernels, the whole layer loop in one C++ call (quant/decoder.py)


def layer_kernels(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether RMSNorm, RoPE, SwiGLU's activation and attention run in `layer_ops.cpp` for these
    activations."""
    return USE_LAYER_KERNELS and dtype == torch.float32 and device.type == "cpu" and kernel.available()


def pad_rows(n: int, align: int = ROW_ALIGN) -> int:
    return -(-n // align) * align


def linear(x: torch.Tensor, weight: torch.Tensor | QuantLinear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [num_rows, in], weight: [out, in] (dense or packed) -> [num_rows, out]."""
    if isinstance(weight, QuantLinear):
        out = weight(x)
        return out if bias is None else out.add_(bias)
    if x.device.type == "cuda":
        return in_row_blocks(lambda rows: F.linear(rows, weight, bias), x)
    if x.dtype != torch.float32 or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    num_rows = x.shape[0]
    if dense_kernel(x.device) and x.shape[1] % 8 == 0 and weight.is_contiguous():
        out = torch.empty(num_rows, weight.shape[0], dtype=x.dtype)
        kernel.dense_linear(x.contiguous(), weight, out)
        return out if bias is None else out.add_(bias)
    if num_rows % ROW_ALIGN:  # a dense part of a packed model: pad here so every row takes the 4-11 regime
        pad = torch.zeros(pad_rows(num_rows) - num_rows, x.shape[1], dtype=x.dtype)
        return linear(torch.cat([x, pad]), weight, bias)[:num_rows]
    out = torch.empty(num_rows, weight.shape[0], dtype=x.dtype, device=x.device)
    for start in range(0, num_rows, _ROW_BLOCK):
        block = x[start:start + _ROW_BLOCK]
        out[start:start + block.shape[0]] = torch.mm(weight, block.t()).t()
    if bias is not None:
        out += bias
    return out


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


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
    """q: [num_rows, num_heads, head_dim]; k, v: [num_rows, num_kv_heads, head_dim];
    cache: (k_cache, v_cache), each [num_slots, num_kv_heads, head_dim].
    Writes the new K/V into their slots, then attends causally. Returns [num_rows, num_heads * head_dim]
    (padding rows are zero)."""
    k_cache, v_cache = cache
    num_real = meta.slot_mapping.shape[0]
    k_cache.index_copy_(0, meta.slot_mapping, k[:num_real].to(k_cache.dtype))
    v_cache.index_copy_(0, meta.slot_mapping, v[:num_real].to(v_cache.dtype))
    num_heads, head_dim = q.shape[1], q.shape[2]
    if (layer_kernels(q.dtype, q.device) and k_cache.dtype == torch.float32 and head_dim % 8 == 0
            and q.stride(1) == head_dim and q.stride(2) == 1 and q.shape[0] == meta.num_rows):
        out = torch.empty(q.shape[0], num_heads * head_dim, dtype=q.dtype)
        kernel.attention(q, k_cache, v_cache, *meta.row_contexts(), head_dim ** -0.5, out)
        return out
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros(q.shape[0], num_heads * head_dim, dtype=q.dtype, device=q.device)
    for seq in meta.seqs:
        # [context, num_kv_heads, head_dim]: a prefix of it is exactly one token's context
        keys = k_cache.index_select(0, seq.context_slots)
        values = v_cache.index_select(0, seq.context_slots)
        for i in range(seq.num_new):
            row = seq.row_start + i
            ctx = seq.start_position + i + 1
            query = q[row].view(num_kv_heads, group, head_dim)
            o = F.scaled_dot_product_attention(query, keys[:ctx].transpose(0, 1), values[:ctx].transpose(0, 1))
            out[row] = o.reshape(-1)
    return out
