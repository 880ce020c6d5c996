"""A draft's matrices quantized again at pack time, to fewer bits than its file holds.

A draft's numbers never reach the output, only its acceptance does, so its weights may be coarser
than the target's: each group of `group` values becomes `bits`-bit unsigned codes q with a scale and
offset, w ~= scale * q + offset. Per group the fit tries a few scales around the range's and keeps the
codes and least-squares scale and offset with the smallest squared error (llama.cpp's
make_qkx2_quants does the same search for Q4_K). Scale and offset are float16 values (held as
float32), so the kernels' tiles carry them in two bytes each; the codes are fitted to the rounded pair.
"""
from __future__ import annotations

import numpy as np

from specdec.quant.gguf_blocks import Codes

_ROWS = 2048   # rows fitted at once: bounds the working set of the search
_STEPS = 4     # candidate scales each side of the range's
_HALF_LEAST = np.float16(2.0 ** -24)  # the least positive float16


def requantize(values: np.ndarray, bits: int, group: int) -> Codes:
    """values [rows, cols] float32 (cols a multiple of group) -> codes 0 .. 2^bits - 1 per group."""
    rows, cols = values.shape
    if cols % group:
        raise ValueError(f"a row of {cols} values is not a whole number of {group}-value groups")
    parts = [_fit(np.asarray(values[r:r + _ROWS], dtype=np.float32), bits, group) for r in range(0, rows, _ROWS)]
    q, scale, offset = (np.concatenate(p) for p in zip(*parts))
    return Codes(bits, group, q.reshape(rows, cols), scale.reshape(rows, -1), offset.reshape(rows, -1))


def _fit(x: np.ndarray, bits: int, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    g = x.reshape(-1, group)
    top = float((1 << bits) - 1)
    lo = g.min(1, keepdims=True)
    span = np.maximum(g.max(1, keepdims=True) - lo, np.float32(1e-30))
    best = (np.full_like(lo, np.inf), np.zeros_like(g), *_half(span / top, lo))
    for step in range(-_STEPS, _STEPS + 1):
        q = np.clip(np.rint((g - lo) * ((top + 0.25 * step) / span)), 0, top)
        scale, offset = _half(*_least_squares(g, q, lo, span / top))
        q = np.clip(np.rint((g - offset) / scale), 0, top)
        err = np.square(g - (scale * q + offset)).sum(1, keepdims=True)
        better = err < best[0]
        best = tuple(np.where(better, new, old) for new, old in zip((err, q, scale, offset), best))
    _, q, scale, offset = best
    return q.astype(np.uint8), scale[:, 0].astype(np.float32), offset[:, 0].astype(np.float32)


def _half(scale: np.ndarray, offset: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """scale and offset rounded to float16 values (a scale below float16's least stays its least)."""
    with np.errstate(over="ignore"):
        scale, offset = np.maximum(scale.astype(np.float16), _HALF_LEAST), offset.astype(np.float16)
    if not (np.isfinite(scale).all() and np.isfinite(offset).all()):
        raise ValueError("weights beyond float16's range cannot be requantized (float16 scales and offsets)")
    return scale.astype(np.float32), offset.astype(np.float32)


def _least_squares(g: np.ndarray, q: np.ndarray, lo: np.ndarray, fallback: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The scale and offset minimising |g - (scale * q + offset)|^2 for fixed codes q (the range's own
    where the codes are all equal, or the fit's scale is not positive)."""
    n = g.shape[1]
    sq, sqq = q.sum(1, keepdims=True), np.square(q).sum(1, keepdims=True)
    sx, sqx = g.sum(1, keepdims=True), (q * g).sum(1, keepdims=True)
    det = n * sqq - sq * sq
    scale = (n * sqx - sq * sx) / np.where(det > 0, det, 1)
    ok = (det > 0) & (scale > 0)
    scale = np.where(ok, scale, fallback)
    return scale, np.where(ok, (sx - scale * sq) / n, lo)
