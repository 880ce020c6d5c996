"""The K/V caches' formats: how a float32 K or V row is held, and read back.

A cache is [num_kv_heads, slots, width] per layer (head-major: one KV head's context is one stream).
float32 and float16 rows are the values (float16 rounded to nearest even). An int8 row is its head_dim
codes followed by one float32 scale per group of 32 values (16 or 8 where head_dim is not a multiple of
32), as bytes: scale = max|x| / 127 over the group, code = round-half-even(x / scale), read back as
code * scale. Groups, as llama.cpp's q8_0, because a few channels of a head's keys are far larger than
the rest. The C++ kernels (decoder.cpp's store, attention.cpp's reads) do exactly the same arithmetic,
so the fused layer loop and this Python path write and read the same bits.
"""
from __future__ import annotations

import torch

DTYPES = (torch.float32, torch.float16, torch.int8)
CODES = {torch.float32: 0, torch.float16: 1, torch.int8: 2}  # kernels.h's KV_FORMAT_*
SCALE_BYTES = 4


def group_size(head_dim: int) -> int:
    """Values per int8 scale: 32, else the largest of 16 and 8 dividing head_dim (the kernels need 8)."""
    return next(g for g in (32, 16, 8) if head_dim % g == 0)


def row_width(dtype: torch.dtype, head_dim: int) -> int:
    """A cache row's elements for one KV head of one token."""
    return head_dim + SCALE_BYTES * head_dim // group_size(head_dim) if dtype == torch.int8 else head_dim


def encode(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., head_dim] float32 -> cache rows [..., row_width] of `dtype`."""
    if dtype != torch.int8:
        return x.to(dtype)
    d = x.shape[-1]
    groups = x.float().reshape(*x.shape[:-1], d // group_size(d), group_size(d))
    scale = groups.abs().amax(-1, keepdim=True) / 127
    codes = torch.where(scale > 0, groups / scale, 0.0).round().clamp_(-127, 127).to(torch.int8)
    return torch.cat([codes.flatten(-2), scale.squeeze(-1).contiguous().view(torch.int8)], dim=-1)


def decode(rows: torch.Tensor, dtype: torch.dtype, head_dim: int) -> torch.Tensor:
    """Cache rows of `head_dim` values -> those values as `dtype` (float16 widened exactly; int8 as
    code * scale in float32)."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    g = group_size(head_dim)
    codes = rows[..., :head_dim].float().reshape(*rows.shape[:-1], head_dim // g, g)
    scale = rows[..., head_dim:].contiguous().view(torch.float32).unsqueeze(-1)
    return (codes * scale).flatten(-2).to(dtype)
