"""The memory-bandwidth ceiling of batch-1 decoding.

A plain decode step reads every weight its forward uses once, so no engine decodes faster than
read bandwidth / bytes read per token (speculation can pass it: one read scores k+1 tokens). The
bandwidth is measured, not looked up: the best of a few read passes over a large buffer, a pure read
stream with its lines asked for ahead as the kernels ask for theirs. KV-cache reads are left
out (a few MB at bench lengths, against a GB of weights).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from specdec.quant.packed import QuantLinear, QuantTensor

DEFAULT_BYTES = 512 * 2**20  # far above any last-level cache here, so the passes stream from DRAM


def measure_read_bandwidth(num_bytes: int = DEFAULT_BYTES, passes: int = 5, num_threads: int | None = None) -> float:
    """Read bandwidth in GB/s (1e9 bytes): the fastest of `passes` timed reads of `num_bytes` (one
    untimed pass first touches the pages), in huge pages where the weights are. `num_threads`: as the
    decode arms use. The reads are the kernels' own stream (`kernel.read_pass_seconds`: lines asked for
    ahead, as the weight tiles do), or `sum()` where the kernels do not build: a bound the kernels'
    streams can reach, not pass."""
    from specdec.models import huge_pages
    from specdec.quant import kernel
    # in huge pages where the weights are (models/huge_pages.py): their stream walks as few page tables
    x = (huge_pages.arena(num_bytes) if huge_pages.available() else torch.empty(num_bytes, dtype=torch.uint8))
    x = x.view(torch.float32).fill_(1.0)
    threads = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    read = ((lambda: kernel.read_pass_seconds(x, torch.get_num_threads())) if kernel.available()
            else (lambda: _timed(x.sum)))
    try:
        read()
        best = min(read() for _ in range(passes))
    finally:
        torch.set_num_threads(threads)
    return x.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _nbytes(w) -> int:
    if isinstance(w, QuantLinear):
        return sum(t.numel() if t is not None else _part_bytes(p, sub, mins)
                   for p, sub, mins, t in zip(w.parts, w.subs, w.mins, w.tiles))
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    raise TypeError(f"unknown weight type {type(w).__name__}")


def _part_bytes(p, sub, mins) -> int:
    """What the kernel reads of one part: codes, offsets and either the float32 group scales or, on
    K-quant super-blocks under integer activations, the integer group scales and one float per 256
    (with int8 activations on Q4_K, its integer minimums and a float per 256 in place of the offsets;
    a tiled part reads its tiles alone)."""
    if not isinstance(p, QuantTensor):
        return p.numel() * p.element_size()
    scales = (sub, p.super_scale) if sub is not None else (p.scale,)
    offsets = (mins, p.super_min) if mins is not None else (p.offset,)
    return sum(t.numel() * t.element_size() for t in (p.codes, *scales, *offsets) if t is not None)


def weight_bytes_per_token(weights: dict, tie_embeddings: bool) -> int:
    """Bytes one decode step reads: every weight as the engine holds it for its precision (int4:
    packed codes + scales + offsets, as `_part_bytes` counts them). A separate embedding table is left
    out (a lookup reads one row); a tied one is the output layer and read in full."""
    return sum(_nbytes(w) for name, w in weights.items() if tie_embeddings or name != "embed")


def ceiling(bandwidth_gb_s: float, weights: dict, tie_embeddings: bool, gguf_path: Path) -> dict:
    """The ceilings in tokens/s: on the weights as held, and on the GGUF file's size (what a
    reader of the file's own quantized blocks, llama.cpp, streams; it counts both embedding tables)."""
    held = weight_bytes_per_token(weights, tie_embeddings)
    gguf = gguf_path.stat().st_size
    return {"bandwidth_gb_s": bandwidth_gb_s, "weight_bytes_per_token": held,
            "ceiling_tokens_per_second": bandwidth_gb_s * 1e9 / held, "gguf_bytes": gguf,
            "gguf_ceiling_tokens_per_second": bandwidth_gb_s * 1e9 / gguf}
