"""Which kernel paths a model's forward takes: an options object handed to the model at construction
and passed down to every layer helper, never a module global. Each path applies only where the C++
kernels are available (`kernel.available()`); the defaults take every kernel path that is. Tests
turn paths off to check the fallbacks (MKL in row blocks, PyTorch ops, the Python layer loop)
against the kernels, bitwise."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.quant import kernel


@dataclass(frozen=True)
class KernelOptions:
    dense: bool = True          # float32 linear layers on specdec's dense kernel (off: MKL in row blocks)
    layer_ops: bool = True      # RMSNorm, RoPE, SwiGLU's activation (layer_ops.cpp) and attention (attention.cpp)
    fused_decoder: bool = True  # with the layer ops, the whole layer loop in one C++ call (decoder.py)
    draft_chain: bool = True    # with the fused decoder, a draft's positions and picks in one C++ call (decoder.py)


def dense_kernel(device: torch.device, options: KernelOptions) -> bool:
    """Whether float32 linear layers on this device run specdec's dense kernel."""
    return device.type == "cpu" and options.dense and kernel.available()


def layer_kernels(dtype: torch.dtype, device: torch.device, options: KernelOptions) -> bool:
    """Whether RMSNorm, RoPE, SwiGLU's activation and attention run in `layer_ops.cpp` / `attention.cpp` for these
    activations."""
    return options.layer_ops and dtype == torch.float32 and device.type == "cpu" and kernel.available()
