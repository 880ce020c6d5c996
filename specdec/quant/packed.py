"""Packed weight-only quantized matrices and the linear layer that runs them.

A `QuantTensor` is one GGUF matrix as integer codes (int4: two per byte; Q6_K's 6-bit codes at the
file's width, see `pack6`; a requantized draft's 3-bit codes, see `pack3`; int8) with float32 scale and
offset per group. A `QuantLinear` stacks
parts along the output dimension, because a fused projection (q|k|v, gate|up) can mix block types
(the 1.5B's attn_v is Q6_K, its attn_q Q4_K); each part writes its own columns of one output.
Activations stay float32 (`act` 0, precision int4: weight-only), or are rounded for integer dot
products:
- `act` 8 (precision int4-a8, llama.cpp's scheme: the fastest on CPUs, and a further approximation of
  the float32 oracle): to int8 per 256 values for Q4_K and Q6_K matrices, whose group scales are
  integers times one float per 256 values (one exact integer sum per super-block), per group (32 or
  64 values) for the rest;
- `act` 16 (precision int4-a16): to int16 per 256 values, 256 times finer, on Q4_K and Q6_K matrices;
  the other block types keep float32 activations.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from specdec.quant import kernel
from specdec.quant.gguf_blocks import Codes
from specdec.quant.layers import linear
from specdec.quant.options import KernelOptions


@dataclass
class QuantTensor:
    bits: int
    group: int
    codes: torch.Tensor          # [rows, cols * bits // 8]: uint8 (bits 3, 4, 6; see from_codes), int8 (bits 8)
    scale: torch.Tensor          # [rows, cols // group] float32
    offset: torch.Tensor | None  # same shape as scale, or None
    cols: int
    super_scale: torch.Tensor | None = None  # [rows, cols // 256] float32: K-quants' scale per 256 values
    super_min: torch.Tensor | None = None    # [rows, cols // 256] float32: Q4_K's dmin (offset == -dmin * m)

    @property
    def rows(self) -> int:
        return self.codes.shape[0]

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor], codes: bool = True) -> QuantTensor:
        """This tensor with each of its arrays replaced by fn(array) (QuantLinear.map_tensors); the codes
        kept as they are unless `codes`."""
        keep = lambda t: None if t is None else fn(t)  # noqa: E731
        return dataclasses.replace(self, codes=fn(self.codes) if codes else self.codes, scale=fn(self.scale),
                                   offset=keep(self.offset),
                                   super_scale=keep(self.super_scale), super_min=keep(self.super_min))

    @classmethod
    def from_codes(cls, c: Codes) -> QuantTensor:
        rows, cols = c.q.shape
        if c.bits == 4:  # per 32-value group: byte i = element i (low nibble) | element 16 + i (high nibble)
            g = c.q.reshape(rows, cols // 32, 32).astype(np.uint8)
            packed = (g[:, :, :16] | (g[:, :, 16:] << 4)).reshape(rows, cols // 2)
        elif c.bits == 3:
            packed = pack3(c.q)
        elif c.bits == 6:
            packed = pack6(c.q)
        else:
            packed = c.q.astype(np.int8)
        arr = lambda a: None if a is None else torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
        return cls(c.bits, c.group, arr(packed), arr(c.scale), arr(c.offset), cols, arr(c.super_scale),
                   arr(c.super_min))

    @property
    def act8_block(self) -> int:
        """Values per int8 activation scale under int4-a8: 256 where the kernel sums whole K-quant
        super-blocks in integers (Q4_K: int4 codes in groups of 32; Q6_K: 6-bit codes in groups of 16),
        else the group's (one exact integer sum per group)."""
        return 256 if self.super_blocks else self.group

    @property
    def super_blocks(self) -> bool:
        """Whether the group scales are integers times one float per 256 values in a layout the integer
        kernels sum by super-block (Q4_K: int4 codes in groups of 32; Q6_K: 6-bit codes in groups of 16)."""
        return self.super_scale is not None and (self.bits, self.group) in ((4, 32), (6, 16))

    def act_of(self, act: int) -> int:
        """The activation rounding this part runs under a layer's `act`: int4-a16 rounds only on
        super-blocks (elsewhere float32 activations), int4-a8 everywhere."""
        return 0 if act == 16 and not self.super_blocks else act

    def sub_scales(self) -> torch.Tensor:
        """[rows, cols // group] int8 s with scale == super_scale * s exactly (the block's integer scales:
        Q4_K's 6-bit, Q6_K's int8)."""
        d = self.super_scale.repeat_interleave(256 // self.group, dim=1)
        s = torch.where(d != 0, self.scale / torch.where(d != 0, d, 1), 0).round()
        if not torch.equal(s * d, self.scale) or s.min() < -128 or s.max() > 127:
            raise ValueError("group scales are not int8 multiples of the super-block scale")
        return s.to(torch.int8).contiguous()

    def min_codes(self) -> torch.Tensor:
        """[rows, cols // group] uint8 m with offset == -(super_min * m) exactly (Q4_K's 6-bit minimums)."""
        dm = self.super_min.repeat_interleave(256 // self.group, dim=1)
        m = torch.where(dm != 0, -self.offset / torch.where(dm != 0, dm, 1), 0).round()
        if not torch.equal(-(dm * m), self.offset) or m.min() < 0 or m.max() > 255:
            raise ValueError("offsets are not integer multiples of the super-block minimum")
        return m.to(torch.uint8).contiguous()

    def int_codes(self, rows: torch.Tensor | slice = slice(None)) -> torch.Tensor:
        """[n, cols] codes as int32 (for the fallback path and embedding lookups)."""
        c = self.codes[rows]
        if self.bits == 8:
            return c.to(torch.int32)
        if self.bits == 6:
            return unpack6(c, self.cols)
        if self.bits == 3:
            return unpack3(c, self.cols)
        g = c.view(-1, self.cols // 32, 16).to(torch.int32)
        return torch.cat([g & 0x0F, g >> 4], dim=-1).view(-1, self.cols)

    def dequantize(self, rows: torch.Tensor | slice = slice(None)) -> torch.Tensor:
        """Float32 weights of the given rows, bitwise what gguf's dequantization gives."""
        q = self.int_codes(rows).float().view(-1, self.cols // self.group, self.group)
        w = q * self.scale[rows][..., None]
        if self.offset is not None:
            w = w + self.offset[rows][..., None]
        return w.view(-1, self.cols)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"codes": self.codes, "scale": self.scale}
        if self.offset is not None:
            out["offset"] = self.offset
        for name in ("super_scale", "super_min"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


class QuantLinear:
    """y = x @ W.T with W the row-wise stack of `parts` (QuantTensor, or a dense float32 tensor for a
    block type with no packed form). Each output element is reduced in an order fixed by the kernel,
    whatever the number of rows: batch-invariant."""

    def __init__(self, parts: list[QuantTensor | torch.Tensor], act: int = 0, tiled: bool = True) -> None:
        """act: activation bits of the integer dot products, 0 (float32 activations), 8 or 16. tiled: build
        the row-interleaved tiles the int8 kernels read (False for an embedding table that is only looked up)."""
        assert act in ACT_BITS, act
        self.parts = parts
        self.act = act
        # integer activations on K-quant super-blocks: each part's integer group scales, or None
        self.subs = [_sub_scales(p, act) if act and isinstance(p, QuantTensor) and p.super_blocks else None
                     for p in parts]
        # int8 activations on Q4_K: its offsets as the file's integer minimums (a byte per 32 weights read)
        self.mins = [p.min_codes() if act == 8 and sub is not None and p.offset is not None and p.super_min is not None
                     else None for p, sub in zip(parts, self.subs)]
        # int8 activations on Q4_K and Q6_K: the same weights row-interleaved, 16 features a tile
        self.tiles = [tiles16(p, sub, m, act) if tiled and isinstance(p, QuantTensor) else None
                      for p, sub, m in zip(parts, self.subs, self.mins)]
        cols = {p.cols if isinstance(p, QuantTensor) else p.shape[1] for p in parts}
        assert len(cols) == 1, f"parts disagree on the input size: {cols}"
        self.in_features = cols.pop()
        self.out_features = sum(p.rows if isinstance(p, QuantTensor) else p.shape[0] for p in parts)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantLinear:
        """This layer with each tensor its products read (codes, scales, offsets, dense parts, integer scales
        and minimums, tiles) replaced by fn(tensor), which must hold the same values (weights moved in
        memory). A tiled part's codes, which only lookups and the fallback read, stay where they are."""
        new = copy.copy(self)
        new.parts = [p.map_tensors(fn, codes=t is None) if isinstance(p, QuantTensor) else fn(p)
                     for p, t in zip(self.parts, self.tiles)]
        new.subs = [None if s is None else fn(s) for s in self.subs]
        new.mins = [None if m is None else fn(m) for m in self.mins]
        new.tiles = [None if t is None else fn(t) for t in self.tiles]
        return new

    def __call__(self, x: torch.Tensor, options: KernelOptions = KernelOptions()) -> torch.Tensor:
        """x: [rows, in] float32 -> [rows, out] float32. `options`: the path of the dense parts (`layers.linear`)."""
        x = x.contiguous()
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        col = 0
        use_kernel = kernel.available()
        if not use_kernel:
            _warn_fallback()
        for p, sub, mins, tiles in zip(self.parts, self.subs, self.mins, self.tiles):
            n = p.rows if isinstance(p, QuantTensor) else p.shape[0]
            if not isinstance(p, QuantTensor):
                out[:, col:col + n] = linear(x, p, options=options)
            elif use_kernel:
                kernel.qlinear(x, p.bits, p.group, p.codes, p.scale, p.offset, out[:, col:col + n],
                               p.act_of(self.act), sub, p.super_scale if sub is not None else None,
                               mins, p.super_min if mins is not None else None, tiles)
            else:
                out[:, col:col + n] = _reference(x, p, p.act_of(self.act))
            col += n
        return out

    def select_rows(self, ids: torch.Tensor) -> QuantLinear:
        """The layer restricted to the given output rows (a draft's sub-vocabulary output layer)."""
        if len(self.parts) != 1:
            raise ValueError("row selection needs a single-part layer")
        p = self.parts[0]
        if not isinstance(p, QuantTensor):
            return QuantLinear([p[ids].contiguous()], self.act)
        rows = lambda t: None if t is None else t[ids].contiguous()  # noqa: E731
        sub = QuantTensor(p.bits, p.group, rows(p.codes), rows(p.scale), rows(p.offset), p.cols, rows(p.super_scale),
                          rows(p.super_min))
        return QuantLinear([sub], self.act)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of W for the given ids (the embedding table as a lookup): [len(ids), in] float32."""
        if len(self.parts) != 1:
            raise ValueError("an embedding table is a single part")
        p = self.parts[0]
        return p.dequantize(ids) if isinstance(p, QuantTensor) else p[ids].float()


def tiles16(p: QuantTensor, sub: torch.Tensor | None, mins: torch.Tensor | None, act: int) -> torch.Tensor | None:
    """A part's row-interleaved tiles for the int8 kernels (16 features side by side: Q4_K and Q6_K one
    super-block at a time, tiles_rows16.h; 4- or 3-bit codes per 64 values one group at a time,
    tiles_rows16_g64.h), or None where none are read (not int8 activations, no kernel, another layout).
    Raises ValueError on scales the tiles cannot hold as given: K-quants' 6-bit Q4_K group scales and
    float16 d and dmin (a GGUF file's always fit), float16 scales and offsets per 64 values (requantize.py's)."""
    if act != 8 or not kernel.available():
        return None
    half = lambda t: t is None or torch.equal(t.half().float(), t)  # noqa: E731
    if p.group == 64 and p.bits in TILE64_BYTES and p.super_scale is None and p.cols % 64 == 0:
        if not half(p.scale) or not half(p.offset):
            raise ValueError("int4-a8 reads codes per 64 values as tiles that hold float16 scales and offsets "
                             "(as requantize.py fits them); these do not fit")
        out = torch.empty(-(-p.rows // 16) * (p.cols // 64) * TILE64_BYTES[p.bits], dtype=torch.uint8)
        kernel.pack_tiles64(p.bits, p.codes, p.scale, p.offset, out)
        return out
    if sub is None or (p.bits, mins is not None) not in ((4, True), (6, False)):
        return None
    if (p.bits == 4 and sub.numel() and sub.min() < 0) or not half(p.super_scale) or not half(p.super_min):
        raise ValueError("int4-a8 reads Q4_K and Q6_K as tiles that hold the file's float16 super-block "
                         "scales and unsigned 6-bit Q4_K group scales; these scales do not fit")
    out = torch.empty(-(-p.rows // 16) * (p.cols // 256) * TILE16_BYTES[p.bits], dtype=torch.uint8)
    kernel.pack_tiles16(p.bits, p.codes, sub, mins, p.super_scale.contiguous(),
                        p.super_min.contiguous() if mins is not None else None, out)
    return out


TILE16_BYTES = {4: 2368, 6: 3360}  # one super-block of 16 features (kRows16Bytes, kRows16Bytes6)
TILE64_BYTES = {4: 576, 3: 448}  # one group of 64 values of 16 features (kRows64Bytes)


def pack3(q: np.ndarray) -> np.ndarray:
    """[rows, cols] codes 0..7 (cols a multiple of 64) -> [rows, cols * 3 // 8] uint8, per 64 values: 16
    bytes of bit pairs (byte i: values i, 16 + i, 32 + i, 48 + i from bit 0 up), then a little-endian
    64-bit word of the third bits (bit j: value j). Shifts of one broadcast load give the pairs in
    element order and the word is a byte mask as it stands (`codes3` in tiles_group_x.h)."""
    rows, cols = q.shape
    u = q.astype(np.uint8).reshape(rows, cols // 64, 4, 16)
    pairs = (u[:, :, 0] & 3) | ((u[:, :, 1] & 3) << 2) | ((u[:, :, 2] & 3) << 4) | ((u[:, :, 3] & 3) << 6)
    third = np.packbits((u.reshape(rows, cols // 64, 64) >> 2) & 1, axis=-1, bitorder="little")
    return np.concatenate([pairs, third], axis=-1).reshape(rows, cols * 3 // 8)


def unpack3(codes: torch.Tensor, cols: int) -> torch.Tensor:
    """`pack3`'s inverse: [n, cols * 3 // 8] uint8 -> [n, cols] int32 codes 0..7."""
    b = codes.view(-1, cols // 64, 24).to(torch.int32)
    low = torch.cat([(b[..., :16] >> s) & 3 for s in (0, 2, 4, 6)], dim=-1)
    third = torch.cat([(b[..., 16 + i, None] >> torch.arange(8)) & 1 for i in range(8)], dim=-1)
    return (low | third << 2).view(-1, cols)


def pack6(q: np.ndarray) -> np.ndarray:
    """[rows, cols] codes -32..31 -> [rows, cols * 3 // 4] uint8, llama.cpp's Q6_K bit layout per 128
    values: 64 bytes of low nibbles (byte i: value i, high nibble value 64 + i), then 32 bytes of high
    bit pairs (byte i: values i, 32 + i, 64 + i, 96 + i from bit 0 up). One 32-byte load of each gives 32
    consecutive codes with two or three vector instructions (`codes6` in qlinear.h)."""
    rows, cols = q.shape
    u = (q.astype(np.int16) + 32).astype(np.uint8).reshape(rows, cols // 128, 128)
    low = (u[..., :64] & 0x0F) | ((u[..., 64:] & 0x0F) << 4)
    h = (u >> 4).reshape(rows, cols // 128, 4, 32)
    high = h[:, :, 0] | (h[:, :, 1] << 2) | (h[:, :, 2] << 4) | (h[:, :, 3] << 6)
    return np.concatenate([low, high], axis=-1).reshape(rows, cols * 3 // 4)


def unpack6(codes: torch.Tensor, cols: int) -> torch.Tensor:
    """`pack6`'s inverse: [n, cols * 3 // 4] uint8 -> [n, cols] int32 codes -32..31."""
    b = codes.view(-1, cols // 128, 96).to(torch.int32)
    low, high = b[..., :64], b[..., 64:]
    u = torch.cat([low & 0x0F, low >> 4], dim=-1)
    u = u | torch.cat([(high >> s) & 0x03 for s in (0, 2, 4, 6)], dim=-1) << 4
    return (u - 32).view(-1, cols)


ACT_BITS = (0, 8, 16)
# int4-a16 multiplies int16 activations by code * integer scale as int16, and an int32 lane sums 32
# (Q4_K) or 16 (Q6_K) such products before it goes to float (`tile_a16` in qlinear.cpp): these bound
# the integer scales so that neither overflows (a real file's are 6-bit for Q4_K and int8 for Q6_K).
_A16_MAX_SUB = {4: 63, 6: 128}


def _sub_scales(p: QuantTensor, act: int) -> torch.Tensor:
    sub = p.sub_scales()
    largest = int(sub.to(torch.int16).abs().max()) if sub.numel() else 0  # int8's abs(-128) would wrap
    if act == 16 and largest > _A16_MAX_SUB[p.bits]:
        raise ValueError(f"int4-a16: integer group scales up to {largest} would overflow the "
                         f"kernel's int16 products (at most {_A16_MAX_SUB[p.bits]} for {p.bits}-bit codes)")
    return sub


@functools.cache
def _warn_fallback() -> None:
    print(f"warning: the int4 kernel is unavailable ({kernel.unavailable_reason()}); running the PyTorch "
          "fallback, which is many times slower", file=sys.stderr)


def quantize_act(x: torch.Tensor, block: int = 32, bits: int = 8) -> torch.Tensor:
    """x rounded the way the integer kernels round it: per `block` values, scale = max|x| / 127
    (int8) or / 32767 (int16)."""
    q, d = quantize_act_codes(x, block, bits)
    return (q * d).view_as(x)


def quantize_act_codes(x: torch.Tensor, block: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x's integer codes [rows, k // block, block] (as float32) and scales [rows, k // block, 1]."""
    xb = x.view(x.shape[0], -1, block)
    d = xb.abs().amax(-1, keepdim=True) / (2 ** (bits - 1) - 1)
    return torch.round(xb * torch.where(d > 0, 1 / d, torch.zeros_like(d))), d


def offset_sums(x: torch.Tensor, group: int, act: int, block: int) -> torch.Tensor:
    """[rows, k // group] the sums of x the offsets multiply, as the kernel computes them: under int8
    activations the rounded x's (scale times an exact integer sum, so a product is exactly
    w . x_rounded), otherwise the unrounded x's."""
    if act != 8:
        return x.view(x.shape[0], -1, group).sum(-1)
    q, d = quantize_act_codes(x, block, 8)
    return (q.view(x.shape[0], -1, block // group, group).sum(-1) * d).view(x.shape[0], -1)


def _reference(x: torch.Tensor, p: QuantTensor, act: int = 0) -> torch.Tensor:
    """The pure-PyTorch fallback: same formula as the kernel, sum(q * x) * scale per group plus the
    offsets times per-group sums of x (`offset_sums`), one row at a time (so it is batch-invariant too)."""
    act_block = 256 if act == 16 else p.act8_block
    xsum = offset_sums(x, p.group, act, act_block) if p.offset is not None else None
    if act:
        x = quantize_act(x, act_block, act)
    groups = p.cols // p.group
    out = torch.empty(x.shape[0], p.rows, dtype=torch.float32)
    block = 4096  # output features per chunk: bounds the dequantized working set
    for start in range(0, p.rows, block):
        sl = slice(start, min(start + block, p.rows))
        q = p.int_codes(sl).float().view(-1, groups, p.group)
        for r in range(x.shape[0]):
            xg = x[r].view(groups, p.group)
            y = ((q * xg).sum(-1) * p.scale[sl]).sum(-1)
            if p.offset is not None:
                y = y + (p.offset[sl] * xsum[r]).sum(-1)
            out[r, sl] = y
    return out
