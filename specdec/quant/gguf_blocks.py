"""GGUF quantized blocks -> integer codes with per-group float32 scales and offsets.

Each supported block type decodes exactly as w = scale * q + offset per group of 16 or 32 values (the
same arithmetic as `gguf.quants`), so packing keeps every weight llama.cpp's file holds: the only
difference from the float32 oracle is the order of the sums. Q6_K's codes are 6-bit (-32..31), the
other codes wider than 4 bits are int8.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as Q


@dataclass
class Codes:
    bits: int                 # 4: codes 0..15; 6: codes -32..31 (Q6_K); 8: codes -128..127
    group: int                # values sharing one scale/offset
    q: np.ndarray             # [rows, cols] uint8 (bits 4) or int8 (bits 6, 8), in element order
    scale: np.ndarray         # [rows, cols // group] float32
    offset: np.ndarray | None  # [rows, cols // group] float32, or None (offset 0)
    # K-quants: scale == super_scale * an integer per group, one float32 per 256 values ([rows, cols // 256])
    super_scale: np.ndarray | None = None
    # Q4_K: offset == -super_min * an integer per group (its 6-bit minimum), [rows, cols // 256]
    super_min: np.ndarray | None = None


def _f16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16).astype(np.float32)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: low nibbles then high nibbles (GGUF's 32-value layout)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins per super-block."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q8_0(b):
    return 8, 32, b[:, 2:].view(np.int8), _f16(b[:, :2]), None


def _q4_0(b):
    d = _f16(b[:, :2])
    return 4, 32, _nibbles(b[:, 2:]), d, d * np.float32(-8)


def _q4_1(b):
    return 4, 32, _nibbles(b[:, 4:]), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q5_0(b):
    qh = b[:, 2:6].copy().view(np.uint32)
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    q = (_nibbles(b[:, 6:]) | (high << 4)).astype(np.int16) - 16
    return 8, 32, q.astype(np.int8), _f16(b[:, :2]), None


def _q4_k(b):
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    q = b[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (q & 0x0F).reshape(n * 8, 32)
    return 4, 32, q, (d[:, None] * sc).reshape(-1), -(dmin[:, None] * mn).reshape(-1), d, dmin


def _q5_k(b):
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    qh = b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    ql = b[:, 48:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = ((ql & 0x0F).reshape(n, 8, 32) | ((qh & 1) << 4)).reshape(n * 8, 32).astype(np.int8)
    return 8, 32, q, (d[:, None] * sc).reshape(-1), -(dmin[:, None] * mn).reshape(-1), d


def _q6_k(b):
    n = b.shape[0]
    ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
    low = (ql.reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    q = (low.reshape(n, 2, 4, 32) | (high << 4)).astype(np.int16) - 32
    return 6, 16, q.reshape(n * 16, 16).astype(np.int8), (d[:, None] * scales.view(np.int8)).reshape(-1), None, d


_DECODERS = {Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0,
             Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k}
PACKABLE = frozenset(_DECODERS)
_BLOCK = {Q.Q8_0: (32, 34), Q.Q4_0: (32, 18), Q.Q4_1: (32, 20), Q.Q5_0: (32, 22),
          Q.Q4_K: (256, 144), Q.Q5_K: (256, 176), Q.Q6_K: (256, 210)}


def decode(raw: np.ndarray, qtype: Q, rows: int, cols: int) -> Codes:
    """raw: the tensor's bytes (any shape, rows * cols values); -> codes of shape [rows, cols]."""
    per_block, nbytes = _BLOCK[qtype]
    if cols % per_block:
        raise ValueError(f"{qtype.name}: a row of {cols} values is not a whole number of blocks")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, nbytes)
    bits, group, q, scale, offset, *supers = _DECODERS[qtype](blocks)
    groups = cols // group
    per_256 = [s.astype(np.float32).reshape(rows, cols // 256) for s in supers] + [None, None]
    return Codes(bits, group, q.reshape(rows, cols), scale.astype(np.float32).reshape(rows, groups),
                 None if offset is None else offset.astype(np.float32).reshape(rows, groups), *per_256[:2])
