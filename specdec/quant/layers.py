"""Batch-invariant building blocks: row alignment and the linear layer (paged attention: `attention.py`).

A token's result must not depend on what else shares its forward. Measured on these CPUs, float32
GEMM computes a row differently depending on the row count (regimes at 1, 2-3, 4-11 and >= 12 rows,
plus a tail kernel for rows past a multiple of 4), and masked multi-query SDPA changes a row once
there is more than one query row. So:
  * float32 `linear` on an AVX2 CPU runs specdec's own kernel (`kernel.dense_linear`), which
    reduces every output in a fixed order whatever the row count: rows are not padded. It is also
    1.3-2x faster than MKL here (a 4-row x 3-feature register tile). Without the kernel,
    `W @ x.T` runs on blocks of exactly 4 or 8 rows (the 4-11 regime, no tail), rows padded to 4.
  * int4 (`packed.QuantLinear`) reduces every output in a fixed order as well, so its rows are not padded.
  * attention runs one query token at a time, unmasked, over exactly its own context (`attention.py`).
bfloat16 GEMM on the CPU is row-invariant on some CPUs (Zen 4) but not where oneDNN picks AMX
tiles by the row count (Sapphire Rapids), so it runs on blocks of exactly CPU_BF16_ROW_BLOCK rows
everywhere. On a GPU the GEMM
library (and PyTorch's row reductions) pick a kernel, tiling and split by the row count, so every
linear layer and RMSNorm runs on blocks of exactly CUDA_ROW_BLOCK rows (rows padded to it): one
shape, one kernel, one summation order for every row. tests/test_batch_invariance.py checks all of
this bitwise (`pytest --device cuda` on a GPU machine).

These live beside the kernels, below `models/`, because the packed linear layer runs its dense parts
through the same `linear` as the model does.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from specdec.quant import kernel
from specdec.quant.options import KernelOptions, dense_kernel

if TYPE_CHECKING:
    from specdec.quant.packed import QuantLinear

ROW_ALIGN = 4
_ROW_BLOCK = 8
# On an H200 a 64-row GEMM cost what one row does in bfloat16, up to 4x in float32: small beside a step.
CUDA_ROW_BLOCK = 64
# bfloat16 on the CPU: one GEMM shape for every call (AMX tiles are 16 rows; 32 keeps prefill to few passes)
CPU_BF16_ROW_BLOCK = 32


def row_align(precision: str, device: str | torch.device = "cpu", options: KernelOptions = KernelOptions()) -> int:
    """Rows of a forward are padded to a multiple of this (see the module docstring)."""
    if torch.device(device).type == "cuda":
        return CUDA_ROW_BLOCK
    if precision.startswith("int4") or (precision == "float32" and dense_kernel(torch.device(device), options)):
        return 1
    return ROW_ALIGN


def pad_rows(n: int, align: int = ROW_ALIGN) -> int:
    return -(-n // align) * align


def in_row_blocks(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                  block: int = CUDA_ROW_BLOCK) -> torch.Tensor:
    """fn over each `block`-row slice of x ([num_rows, ...]; zero rows pad the last slice), so that
    every call has one shape whatever the batch."""
    n = x.shape[0]
    if n % block:
        x = torch.cat([x, x.new_zeros(pad_rows(n, block) - n, *x.shape[1:])])
    out = fn(x) if x.shape[0] == block else torch.cat([fn(x[i:i + block]) for i in range(0, x.shape[0], block)])
    return out[:n]


def linear(x: torch.Tensor, weight: torch.Tensor | QuantLinear, bias: torch.Tensor | None = None,
           options: KernelOptions = KernelOptions()) -> torch.Tensor:
    """x: [num_rows, in], weight: [out, in] (dense, or packed: `QuantLinear`) -> [num_rows, out]."""
    if not isinstance(weight, torch.Tensor):  # packed
        out = weight(x, options)
        return out if bias is None else out.add_(bias)
    if x.device.type == "cuda":
        return in_row_blocks(lambda rows: F.linear(rows, weight, bias), x)
    if x.dtype == torch.bfloat16 and x.device.type == "cpu":
        return in_row_blocks(lambda rows: F.linear(rows, weight, bias), x, CPU_BF16_ROW_BLOCK)
    if x.dtype != torch.float32 or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    num_rows = x.shape[0]
    if dense_kernel(x.device, options) and x.shape[1] % 8 == 0 and weight.is_contiguous():
        out = torch.empty(num_rows, weight.shape[0], dtype=x.dtype)
        kernel.dense_linear(x.contiguous(), weight, out)
        return out if bias is None else out.add_(bias)
    if num_rows % ROW_ALIGN:  # a dense part of a packed model: pad here so every row takes the 4-11 regime
        pad = torch.zeros(pad_rows(num_rows) - num_rows, x.shape[1], dtype=x.dtype)
        return linear(torch.cat([x, pad]), weight, bias, options)[:num_rows]
    out = torch.empty(num_rows, weight.shape[0], dtype=x.dtype, device=x.device)
    for start in range(0, num_rows, _ROW_BLOCK):
        block = x[start:start + _ROW_BLOCK]
        out[start:start + block.shape[0]] = torch.mm(weight, block.t()).t()
    if bias is not None:
        out += bias
    return out
