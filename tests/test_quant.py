"""Packed quantized weights (precisions int4, int4-a16, int4-a8): GGUF blocks decode to exactly the
file's values, the packed form round-trips, the AVX2 kernel and the PyTorch fallback agree with a
float64 reference and are batch-invariant, and speculative == plain greedy in each packed mode."""
from __future__ import annotations

import ctypes
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from conftest import engine_config
from specdec.config import SpeculativeConfig
from specdec.llm import LLM
from specdec.quant import kernel, kv_format, packed
from specdec.quant.gguf_blocks import PACKABLE, decode
from specdec.quant.packed import QuantLinear, QuantTensor
from specdec.quant.requantize import requantize
from specdec.sampling_params import SamplingParams

ROWS, COLS = 24, 512


def _random_blocks(qtype: Q, rng: np.random.Generator, rows: int = ROWS, cols: int = COLS) -> np.ndarray:
    """A tensor of `qtype` with random codes and small finite f16 scales, as the file stores it."""
    if qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0):  # gguf-py can quantize these itself
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    per_block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // per_block, nbytes), dtype=np.uint8)
    f16 = lambda n: rng.uniform(-0.05, 0.05, (raw.shape[0], n)).astype(np.float16).view(np.uint8)  # noqa: E731
    if qtype == Q.Q6_K:
        raw[:, 208:210] = f16(1)
    else:  # Q4_K, Q5_K: d and dmin lead the block
        raw[:, 0:4] = f16(2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", sorted(PACKABLE, key=lambda q: q.name), ids=lambda q: q.name)
def test_blocks_decode_to_the_files_values_and_pack_round_trips(qtype):
    raw = _random_blocks(qtype, np.random.default_rng(int(qtype)))
    ref = dequantize(raw, qtype).reshape(ROWS, COLS)
    c = decode(raw, qtype, ROWS, COLS)
    w = c.q.reshape(ROWS, -1, c.group).astype(np.float32) * c.scale[..., None]
    if c.offset is not None:
        w = w + c.offset[..., None]
    assert np.array_equal(w.reshape(ROWS, COLS), ref)
    qt = QuantTensor.from_codes(c)
    assert torch.equal(qt.dequantize(), torch.from_numpy(ref))          # packing loses nothing
    assert torch.equal(qt.dequantize(torch.tensor([3, 0, 3])), torch.from_numpy(ref[[3, 0, 3]]))
    assert qt.bits == (4 if qtype in (Q.Q4_0, Q.Q4_1, Q.Q4_K) else 6 if qtype == Q.Q6_K else 8)
    assert qt.codes.shape == (ROWS, COLS * qt.bits // 8)  # Q6_K at the file's width


def _layers():
    rng = np.random.default_rng(7)
    out = {}
    for qtype in (Q.Q4_K, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q6_K, Q.Q5_K):
        out[qtype.name] = QuantTensor.from_codes(decode(_random_blocks(qtype, rng), qtype, ROWS, COLS))
    for bits in (4, 3):  # a draft's matrices requantized per 64 values (models/gguf_packed.py)
        out[f"R{bits}_64"] = QuantTensor.from_codes(requantize(rng.standard_normal((ROWS, COLS)).astype(np.float32),
                                                               bits, 64))
    return out


LAYERS = _layers()
REQUANTIZED = [n for n in LAYERS if n.startswith("R")]  # read by int4-a8's integer paths only


def _with_acts(acts: tuple[int, ...]):
    """(name, act) pairs: every layer under each act its kernels take."""
    ids = {0: "int4", 8: "int4-a8", 16: "int4-a16"}
    pairs = [(n, a) for a in acts for n in LAYERS if a == 8 or n not in REQUANTIZED]
    return pytest.mark.parametrize("name,act", pairs, ids=[f"{n}-{ids[a]}" for n, a in pairs])


@pytest.fixture(params=["kernel", "fallback"])
def path(request, monkeypatch):
    if request.param == "kernel":
        if not kernel.available():
            pytest.skip(f"kernel unavailable: {kernel.unavailable_reason()}")
    else:
        monkeypatch.setattr(packed.kernel, "available", lambda: False)
    return request.param


@_with_acts((0, 8, 16))
def test_quantized_linear_matches_float64_and_is_batch_invariant(name, path, act):
    """Each product is dequant(W) . x_used in float64 up to float32 accumulation, where x_used is x
    (int4), or x rounded as the kernel rounds it: under int4-a8 the offsets too see the rounded x
    (llama.cpp's arithmetic); under int4-a16 they see the unrounded sums. 1 to 70 rows."""
    qt = LAYERS[name]
    lin = QuantLinear([qt], act)
    x = torch.randn(70, COLS, generator=torch.Generator().manual_seed(1))
    x[5, 3] = 40.0  # an outlier that takes its whole activation block's int8 range
    act = qt.act_of(act)
    xr = packed.quantize_act(x, 256 if act == 16 else qt.act8_block, act) if act else x
    ref = xr.double() @ qt.dequantize().double().t()
    if act == 16 and qt.offset is not None:
        xs = lambda v: v.double().view(70, -1, qt.group).sum(-1)  # noqa: E731
        ref += (xs(x) - xs(xr)) @ qt.offset.double().t()
    y = lin(x)
    # float32 rounding of sums of 512 terms, relative to the sum of the terms' magnitudes
    bound = 1e-5 * (xr.double().abs() @ qt.dequantize().double().abs().t()) + 1e-6
    assert ((y.double() - ref).abs() <= bound).all()
    for rows in (1, 2, 3, 4, 5, 8, 9, 17, 70):  # any row count, any neighbours: bitwise the same row
        sel = torch.randperm(70, generator=torch.Generator().manual_seed(rows))[:rows]
        assert torch.equal(lin(x[sel]), y[sel])


@pytest.mark.parametrize("name", [n for n in LAYERS if LAYERS[n].offset is not None])
def test_int8_offsets_multiply_the_rounded_activations(name):
    """With the offsets on the unrounded x's sums (the old int4-a8 form), a product misses w . x_rounded
    by the offsets times the rounding error, far above float32 rounding: the reference above tells them apart."""
    qt = LAYERS[name]
    x = torch.randn(8, COLS, generator=torch.Generator().manual_seed(2))
    xr = packed.quantize_act(x, qt.act8_block, 8)
    exact = xr.double() @ qt.dequantize().double().t()
    xs = lambda v: v.double().view(8, -1, qt.group).sum(-1)  # noqa: E731
    old = exact + (xs(x) - xs(xr)) @ qt.offset.double().t()
    y = QuantLinear([qt], 8)(x).double()
    assert (y - exact).abs().max() * 100 < (old - exact).abs().max()
    assert torch.allclose(packed.offset_sums(x, qt.group, 8, qt.act8_block).double(), xs(xr), rtol=1e-6, atol=1e-5)


@_with_acts((0, 8, 16))
def test_many_rows_pass_over_the_weights_in_blocks_with_the_same_results(name, act):
    """Long prefills go in row blocks that fit the L2 cache (int4-a8), or 8 rows at a time over slices
    of k and chunks of features (int4): a row is bitwise the same alone, inside the first block, or
    past several block, slice and chunk boundaries, and in the 1-7 rows left over."""
    if not kernel.available():
        pytest.skip(f"kernel unavailable: {kernel.unavailable_reason()}")
    t = LAYERS[name]
    big = lambda a: None if a is None else a.repeat(30, 4)  # noqa: E731 (720 features x 2,048: 6 chunks, 3 slices)
    lin = QuantLinear([QuantTensor(t.bits, t.group, big(t.codes), big(t.scale), big(t.offset), 4 * t.cols,
                                   big(t.super_scale), big(t.super_min))], act)
    x = torch.randn(300, 4 * COLS, generator=torch.Generator().manual_seed(5))
    y = lin(x)
    for rows in (slice(0, 1), slice(127, 129), slice(130, 139), slice(250, 300), slice(3, 261), slice(10, 15),
                 slice(20, 27), slice(40, 54)):  # the last three: 5, 7 and 8 + 6 rows of 8 KB, past L1
        assert torch.equal(lin(x[rows]), y[rows]), rows


@pytest.fixture
def avx2_then_best():
    """Runs the integer paths with AVX2 first; restores the CPU's best instruction set afterwards."""
    if not kernel.available():
        pytest.skip(f"kernel unavailable: {kernel.unavailable_reason()}")
    kernel.isa("avx2")
    yield kernel
    kernel.isa("best")


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize("heads, d", [(12, 128), (14, 64), (4, 80), (2, 8), (20, 64)])
def test_attention_avx512_and_avx2_are_bitwise_equal(kv_dtype, heads, d, avx2_then_best):
    """The AVX-512 build of attention does each output element's float operations as the AVX2 build
    does (two query heads' products in the halves of a 16-float vector, values 16 at a time): decode
    rows and verification runs alike, any group of query heads per KV head (1 to 10), bitwise."""
    from specdec.quant import kv_format
    g = torch.Generator().manual_seed(heads * d)
    kv_heads, rows, context = 2, 6, 203
    slots = torch.randperm(context + rows + 40, generator=g)[: context + rows]  # paged: any slots
    k, v = (kv_format.encode(torch.randn(kv_heads, context + rows + 40, d, generator=g), kv_dtype) for _ in range(2))
    q = torch.randn(rows, heads, d, generator=g)
    lens = torch.tensor([context + 1 + r for r in range(rows - 1)] + [37])  # a run of 5, then a short row
    ctx_slots = torch.cat([slots[:n] for n in lens.tolist()])
    starts = torch.cumsum(lens, 0) - lens
    outs = []
    for isa in ("avx2", "best"):
        avx2_then_best.isa(isa)
        out = torch.empty(rows, heads * d)
        kernel.attention(q, k, v, ctx_slots, starts, lens, d ** -0.5, out)
        outs.append(out)
    if avx2_then_best.isa() != "avx512-vnni":
        pytest.skip("this CPU has no AVX-512: only the AVX2 build runs")
    assert torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1])


@_with_acts((8, 16))
def test_vnni_and_avx2_paths_are_bitwise_equal(name, act, avx2_then_best):
    """The VNNI build of the integer paths computes the same exact integer sums and the same float
    operations as the AVX2 build: any row count, bitwise. Extreme activations reach the codes' and
    the rounded activations' largest products (the int16 bounds the VNNI lanes rely on). An odd number
    of features leaves runs that the VNNI per-32 tiles (two or four features at a time) end alone."""
    t = LAYERS[name]
    big = lambda a: None if a is None else a.repeat(10, 4)[:237]  # noqa: E731 (237 features x 2,048)
    lin = QuantLinear([QuantTensor(t.bits, t.group, big(t.codes), big(t.scale), big(t.offset), 4 * t.cols,
                                   big(t.super_scale), big(t.super_min))], act)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(70, 4 * COLS, generator=g)
    x[::7] = torch.sign(torch.randn(10, 4 * COLS, generator=g)) * 1e3  # every value at +-max: |xq| = 127
    # up to 12 rows in one register tile under VNNI (8 on AVX2); 13 and 17: every row in one pass
    row_sets = (slice(0, 1), slice(1, 3), slice(3, 8), slice(8, 16), slice(16, 25), slice(42, 54), slice(54, 67),
                slice(25, 42), slice(0, 70))
    avx2 = [lin(x[r]) for r in row_sets]
    assert avx2_then_best.isa("best") in ("avx2", "avx512-vnni")
    if avx2_then_best.isa() != "avx512-vnni":
        pytest.skip("this CPU has no AVX-512 VNNI: only the AVX2 path runs")
    for r, ref in zip(row_sets, avx2):
        assert torch.equal(lin(x[r]), ref), r


def test_q6k_extreme_codes_and_activations_stay_exact(avx2_then_best):
    """Q6_K's VNNI tiles sum (codes - 32) . xq over 8 values within int16 before each group's scale: codes
    all 0 or all 63, scales -128 and 127, and activations all at +-127 reach that bound (8 * 32 * 127).
    Both builds give the same bits, within float32 rounding of the exact sum, at every tile size."""
    rows, cols = 32, 512
    raw = np.zeros((rows * cols // 256, 210), dtype=np.uint8)
    blocks = raw.reshape(rows, -1, 210)
    mixed = np.random.default_rng(3).choice(np.array([0, 255], dtype=np.uint8), (rows, cols // 256, 192))
    for f in range(rows):  # codes all 0, all 63, or each 0, 15, 48 or 63
        blocks[f, :, :192] = (0, 255, mixed[f])[f % 3]
        blocks[f, :, 192:208] = np.array([-128, 127], dtype=np.int8).view(np.uint8)[f // 3 % 2]
    blocks[..., 208:210] = np.array([0.01], dtype=np.float16).view(np.uint8)
    t = QuantTensor.from_codes(decode(raw, Q.Q6_K, rows, cols))
    lin = QuantLinear([t], 8)
    x = torch.full((20, cols), 1e3)
    x[1::2] = -1e3
    x[4:8, ::2] = -1e3  # half the values at each extreme
    sets = (slice(0, 1), slice(0, 5), slice(0, 12), slice(0, 13), slice(0, 20))
    avx2 = [lin(x[r]) for r in sets]
    ref = packed.quantize_act(x, 256, 8).double() @ t.dequantize().double().t()
    assert ((avx2[-1].double() - ref).abs() <= 1e-5 * ref.abs().max()).all()
    if avx2_then_best.isa("best") != "avx512-vnni":
        pytest.skip("this CPU has no AVX-512 VNNI: only the AVX2 path runs")
    for r, y in zip(sets, avx2):
        assert torch.equal(lin(x[r]), y), r


@pytest.mark.parametrize("bits", [4, 3])
def test_requantized_codes_fit_each_group_at_least_as_well_as_its_range(bits):
    """The least-squares fit per 64 values: codes in range, packed and read back exactly, and a squared
    error no larger than the range's own scale and minimum give (the fit's search starts there)."""
    rng = np.random.default_rng(bits)
    w = (rng.standard_normal((40, 256)) * rng.uniform(0.1, 3, (40, 1))).astype(np.float32)
    w[3] = 0.5  # a constant row: every code equal, the offset carries it
    c = requantize(w, bits, 64)
    assert c.q.min() >= 0 and c.q.max() < 2 ** bits and c.scale.shape == (40, 4) and (c.scale > 0).all()
    for v in (c.scale, c.offset):  # float16 values, as the kernels' tiles hold them
        assert np.array_equal(v.astype(np.float16).astype(np.float32), v)
    qt = QuantTensor.from_codes(c)
    assert qt.codes.shape == (40, 256 * bits // 8) and torch.equal(qt.int_codes(), torch.from_numpy(c.q).int())
    fitted = (qt.dequantize().numpy() - w).reshape(40, 4, 64)
    g = w.reshape(40, 4, 64)
    lo, step = g.min(-1, keepdims=True), (g.max(-1, keepdims=True) - g.min(-1, keepdims=True)) / (2 ** bits - 1)
    naive = np.where(step > 0, np.round((g - lo) / np.where(step > 0, step, 1)) * step + lo, g) - g
    assert (np.square(fitted).sum(-1) <= np.square(naive).sum(-1) * (1 + 1e-4) + 1e-12).all()
    assert np.abs(fitted[3]).max() == 0
    with pytest.raises(ValueError, match="whole number of 64-value groups"):
        requantize(w[:, :96], bits, 64)
    with pytest.raises(ValueError, match="beyond float16's range"):
        requantize(w * 1e5, bits, 64)


def test_kernel_and_fallback_agree_and_mixed_parts_fill_their_columns(monkeypatch):
    if not kernel.available():
        pytest.skip(f"kernel unavailable: {kernel.unavailable_reason()}")
    dense = torch.randn(5, COLS)
    lin = QuantLinear([LAYERS["Q4_K"], dense, LAYERS["Q6_K"]])
    assert lin.shape == (2 * ROWS + 5, COLS)
    x = torch.randn(6, COLS, generator=torch.Generator().manual_seed(5))
    fast = lin(x)
    monkeypatch.setattr(packed.kernel, "available", lambda: False)
    slow = lin(x)
    w = torch.cat([LAYERS["Q4_K"].dequantize(), dense, LAYERS["Q6_K"].dequantize()])
    ref = x.double() @ w.double().t()
    bound = 1e-5 * (x.double().abs() @ w.double().abs().t()) + 1e-6  # float32 sums of 512 terms
    for y in (fast, slow):
        assert ((y.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("act,names", [(8, ["Q4_K", "Q5_0", "Q6_K", "Q4_K", "Q8_0"]), (8, ["R4_64", "R3_64", "R4_64"]),
                                       (16, ["Q4_K", "Q6_K", "Q4_K"])],
                         ids=["int4-a8", "int4-a8-requantized", "int4-a16"])
def test_a_fused_projection_equals_its_parts_called_alone(act, names):
    """q|k|v-like parts of mixed layouts in one `qlinear_parts` call (x rounded once per way the parts
    read it, one fork): every part's columns are bitwise what it gives alone, at 1 to 70 rows."""
    if not kernel.available():
        pytest.skip(f"kernel unavailable: {kernel.unavailable_reason()}")
    from specdec.quant.decoder import describe_linear
    keep: list = []
    fused = QuantLinear([LAYERS[n] for n in names], act)
    desc = describe_linear(fused, None, keep)
    for rows in (1, 2, 5, 8, 9, 17, 70):
        x = torch.randn(rows, COLS, generator=torch.Generator().manual_seed(rows))
        out = torch.full((rows, desc.n), float("nan"))
        assert kernel._lib().qlinear_parts(x.data_ptr(), rows, COLS, desc.parts, desc.num_parts, out.data_ptr(),
                                           desc.n, 2) == 0
        alone = torch.cat([QuantLinear([LAYERS[n]], act)(x) for n in names], dim=1)
        assert torch.equal(out, alone), rows


@pytest.mark.parametrize("act", [8, 16], ids=["int4-a8", "int4-a16"])
def test_prompt_rows_are_bitwise_the_rows_alone(act):
    """From 32 rows a projection runs as a prompt (tiles of features with every row inside): over several
    tiles, parts and threads, each of 100 rows is
    bitwise what it gives alone, and what it gives beside 31 others (the last count below the prompt path)."""
    if not kernel.available():
        pytest.skip(f"kernel unavailable: {kernel.unavailable_reason()}")
    from specdec.quant.decoder import describe_linear
    keep: list = []
    names = ["Q6_K", "Q4_K", "Q5_0", "R3_64", "R4_64"] * 3 if act == 8 else ["Q4_K", "Q6_K"] * 6
    lin = QuantLinear([LAYERS[n] for n in names], act)  # held: desc points into its scales
    desc = describe_linear(lin, None, keep)
    x = torch.randn(100, COLS, generator=torch.Generator().manual_seed(7))

    def parts(rows: torch.Tensor) -> torch.Tensor:
        out = torch.full((rows.shape[0], desc.n), float("nan"))
        assert kernel._lib().qlinear_parts(rows.data_ptr(), rows.shape[0], COLS, desc.parts, desc.num_parts,
                                           out.data_ptr(), desc.n, 2) == 0
        return out

    y = parts(x)
    assert torch.equal(torch.cat([parts(x[i:i + 1]) for i in range(100)]), y)
    assert torch.equal(torch.cat([parts(x[i:i + 31]) for i in range(0, 93, 31)] + [parts(x[93:])]), y)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, "R4_64", "R3_64"])
@pytest.mark.parametrize("supers", [3, 6])
def test_row_interleaved_tiles_give_each_feature_as_alone(qtype, supers):
    """Under int8, Q4_K, Q6_K and a draft's 4- and 3-bit codes per 64 values are read as tiles of 16 features
    side by side (tiles_rows16.h, tiles_rows16_g64.h): a part of 13 features (one tile, three lanes of
    padding) equals its features called as parts of one feature each (a tile column asked for lane by
    lane), at verification and prompt row counts, with an odd and an even number of super-blocks."""
    if not kernel.available():
        pytest.skip(f"kernel unavailable: {kernel.unavailable_reason()}")
    cols, rng = 256 * supers, np.random.default_rng(supers)
    if qtype in ("R4_64", "R3_64"):
        t = QuantTensor.from_codes(requantize(rng.standard_normal((13, cols)).astype(np.float32), int(qtype[1]), 64))
        size = cols // 64 * packed.TILE64_BYTES[t.bits]
    else:
        t = QuantTensor.from_codes(decode(_random_blocks(qtype, rng, 13, cols), qtype, 13, cols))
        size = supers * packed.TILE16_BYTES[t.bits]
    whole = QuantLinear([t], 8)
    alone = QuantLinear([whole.select_rows(torch.tensor([i])).parts[0] for i in range(13)], 8)
    assert whole.tiles[0] is not None and whole.tiles[0].numel() == size
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(supers)) * 4
    for rows in (1, 2, 5, 9, 17, 31, 40):
        assert torch.equal(whole(x[:rows]), alone(x[:rows])), rows


def test_int8_tiles_refuse_scales_they_cannot_hold():
    """A Q4_K part whose super-block scale is not a float16 value (no GGUF file has one) is refused
    with a clear error, not run on some other arithmetic."""
    if not kernel.available():
        pytest.skip(f"kernel unavailable: {kernel.unavailable_reason()}")
    t = LAYERS["Q4_K"]
    d = t.super_scale * (1 + 2 ** -12)  # 23 significant bits: float32, not float16
    scale = t.sub_scales().float() * d.repeat_interleave(256 // t.group, dim=1)
    odd = QuantTensor(t.bits, t.group, t.codes, scale, t.offset, t.cols, d, t.super_min)
    with pytest.raises(ValueError, match="float16"):
        QuantLinear([odd], 8)
    assert QuantLinear([odd], 16)(torch.randn(2, COLS)).shape == (2, ROWS)  # int16 reads the file's layout
    r = LAYERS["R4_64"]  # the same for codes per 64 values: their tiles hold float16 scales and offsets
    for scale, offset in ((r.scale * (1 + 2 ** -12), r.offset), (r.scale, r.offset * (1 + 2 ** -12))):
        with pytest.raises(ValueError, match="float16 scales and offsets"):
            QuantLinear([QuantTensor(r.bits, r.group, r.codes, scale, offset, r.cols)], 8)


def test_a_projection_with_a_part_off_the_integer_paths_is_refused_unwritten():
    if not kernel.available():
        pytest.skip(f"kernel unavailable: {kernel.unavailable_reason()}")
    from specdec.quant.decoder import describe_linear
    keep: list = []
    desc = describe_linear(QuantLinear([LAYERS["Q4_K"], LAYERS["Q4_0"]], 0), None, keep)  # weight-only
    x, out = torch.randn(3, COLS), torch.zeros(3, desc.n)
    assert kernel._lib().qlinear_parts(x.data_ptr(), 3, COLS, desc.parts, desc.num_parts, out.data_ptr(),
                                       desc.n, 2) == -1
    assert not out.any()


def test_kernel_refuses_an_unsupported_layout():
    if not kernel.available():
        pytest.skip(f"kernel unavailable: {kernel.unavailable_reason()}")
    qt = LAYERS["Q8_0"]
    with pytest.raises(ValueError, match="unsupported layout"):
        kernel.qlinear(torch.randn(1, COLS), 8, 64, qt.codes, qt.scale, None, torch.empty(1, ROWS))


def _c_type(decl: str, structs: dict[str, type]) -> tuple[str, object]:
    """'const float* x' -> ('x', its ctypes type as kernel.py should declare it)."""
    m = re.fullmatch(r"(.+?)\s*\b(\w+)", decl.strip())
    ctype, name = m[1].replace("const", "").strip(), m[2]
    base = ctype.rstrip("*").strip()
    if ctype.endswith("*"):
        return name, ctypes.POINTER(structs[base]) if base in structs else ctypes.c_void_p
    return name, structs.get(base) or {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float,
                                   "double": ctypes.c_double}[base]


def test_the_ctypes_table_follows_the_header():
    """kernels.h declares the C ABI once; kernel.py's structs and SIGNATURES must follow it exactly
    (a mismatch would pass wrong arguments silently)."""
    text = re.sub(r"//[^\n]*", "", Path(kernel.__file__).with_name("kernels.h").read_text())
    structs = {"Part": kernel.Part, "Linear": kernel.Linear, "Layer": kernel.Layer, "Dims": kernel.Dims,
               "ChainRow": kernel.ChainRow, "CoupledRow": kernel.CoupledRow}
    declared = dict(re.findall(r"struct (\w+) \{([^}]*)\};", text))
    assert set(declared) == set(structs)
    for name, body in declared.items():
        fields = [_c_type(f, structs) for f in body.split(";") if f.strip()]
        assert fields == list(structs[name]._fields_), name
    functions = re.findall(r"\b(int|void|double) (\w+)\(([^)]*)\);", text)
    assert [f[1] for f in functions] == list(kernel.SIGNATURES)
    for result, name, params in functions:
        restype, args = kernel.SIGNATURES[name]
        assert restype is {"int": ctypes.c_int, "double": ctypes.c_double, "void": None}[result], name
        assert [_c_type(p, structs) for p in params.split(",")] == args, name
    formats = {"F32": torch.float32, "F16": torch.float16, "I8": torch.int8}
    defined = {formats[n]: int(v) for n, v in re.findall(r"#define KV_FORMAT_(\w+) (\d+)", text)}
    assert defined == kv_format.CODES


def test_int8_kv_rows_hold_codes_and_their_scales():
    """An int8 K/V row is its codes, round-half-even(x / scale) with scale = max|x| / 127 per group of 32
    values (16 or 8 for other head sizes), then the scales' bytes; reading it back is within half a step
    of every value, and an all-zero group stays zero."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 2, 64, generator=g) * torch.tensor([0.01, 1.0, 30.0, 1e-4, 2.0]).view(5, 1, 1)
    x[1, 0, 3] = 500.0   # an outlier channel moves only its own group's scale
    x[3, 1, 32:] = 0
    rows = kv_format.encode(x, torch.int8)
    assert rows.shape == (5, 2, kv_format.row_width(torch.int8, 64)) == (5, 2, 72) and rows.dtype == torch.int8
    scale = x.view(5, 2, 2, 32).abs().amax(-1) / 127
    assert torch.equal(rows[..., 64:].contiguous().view(torch.float32), scale)
    assert rows[..., :64].abs().max() == 127 and not rows[3, 1, 32:64].any()
    back = kv_format.decode(rows, torch.float32, 64)
    assert ((back - x).view(5, 2, 2, 32).abs() <= (scale / 2 * (1 + 1e-6)).unsqueeze(-1)).all()
    assert (back[1, 0, 32:] - x[1, 0, 32:]).abs().max() < 0.05
    assert [kv_format.row_width(torch.int8, d) for d in (128, 48, 8)] == [144, 48 + 12, 12]
    assert torch.equal(kv_format.decode(kv_format.encode(x, torch.float16), torch.float32, 64), x.half().float())


@pytest.mark.parametrize("target", ["tiny_qwen", "tiny_kquant"])
def test_int4_model_logits_close_to_float32(target, request):
    """Report-style check: int4 keeps the file's weights, so only the summation order differs; int4-a8
    also rounds activations to int8 (per 256 values on the K-quant model's super-blocks), int4-a16 to
    int16 on super-blocks only (elsewhere it is int4)."""
    from specdec.models.loader import load_model
    from specdec.models.llama import LlamaModel
    from specdec.quant.attention import AttentionMetadata, SeqAttention
    ids = torch.tensor([5, 17, 99, 3, 250, 41, 7])
    out, supers = {}, {}
    for precision in ("float32", "int4", "int4-a16", "int4-a8"):
        loaded = load_model(str(request.getfixturevalue(target)), precision, progress=False)
        assert loaded.precision == precision
        supers[precision] = sum(sub is not None for w in loaded.weights.values() if isinstance(w, QuantLinear)
                                for sub in w.subs)
        model = LlamaModel(loaded.config, loaded.weights, 64, torch.device("cpu"))
        cfg, n = loaded.config, model.row_align * -(-len(ids) // model.row_align)
        caches = [(torch.zeros(cfg.num_kv_heads, 64, cfg.head_dim), torch.zeros(cfg.num_kv_heads, 64, cfg.head_dim))
                  for _ in range(cfg.num_layers)]
        pad = n - len(ids)
        meta = AttentionMetadata(torch.arange(len(ids)), [SeqAttention(0, len(ids), 0, torch.arange(len(ids)))], n)
        hidden = model.forward(torch.cat([ids, ids.new_zeros(pad)]), torch.arange(n), meta, caches)
        out[precision] = model.compute_logits(hidden)[: len(ids)]
    assert model.packed and model.row_align == 1
    scale = out["float32"].abs().max().item()
    err = (out["int4"] - out["float32"]).abs().max().item()
    assert 0 < err < 1e-3 * scale  # same weights, different summation order
    err8 = (out["int4-a8"] - out["float32"]).abs().max().item()
    assert err < err8 < 0.1 * scale
    assert supers["int4"] == 0 and (supers["int4-a8"] > 0) == (target == "tiny_kquant")
    assert supers["int4-a16"] == supers["int4-a8"]
    err16 = (out["int4-a16"] - out["float32"]).abs().max().item()
    if target == "tiny_kquant":
        assert err < err16 < err8 / 50  # int16 rounding: 256 times finer than int8
    else:
        assert torch.equal(out["int4-a16"], out["int4"])  # no super-blocks: float32 activations


def test_k_quant_scales_are_integers_times_one_scale_per_super_block():
    """int4-a8 sums a whole Q4_K / Q6_K super-block in integers: each group's scale must be exactly
    super_scale times a small integer (the block's own sub-scale)."""
    for name, block in (("Q4_K", 256), ("Q6_K", 256), ("Q5_K", 32), ("Q4_0", 32), ("Q8_0", 32)):
        qt = LAYERS[name]
        assert qt.act8_block == block, name
        if qt.super_scale is None:
            continue
        sub = qt.sub_scales()
        assert sub.dtype == torch.int8  # a byte per group, as the file holds them
        d = qt.super_scale.repeat_interleave(256 // qt.group, dim=1)
        assert torch.equal(sub.float() * d, qt.scale)
        if qt.super_min is not None:  # Q4_K: offsets are -super_min times the file's 6-bit minimums
            m = qt.min_codes()
            assert m.dtype == torch.uint8 and int(m.max()) <= 63
            assert torch.equal(-(m.float() * qt.super_min.repeat_interleave(8, dim=1)), qt.offset)
    bad = LAYERS["Q4_K"]
    bad = QuantTensor(bad.bits, bad.group, bad.codes, bad.scale * 1.001, bad.offset, bad.cols, bad.super_scale)
    with pytest.raises(ValueError, match="multiples of the super-block scale"):
        QuantLinear([bad], act=8)
    QuantLinear([bad], act=0)  # weight-only int4 never needs the integer scales
    q = LAYERS["Q4_K"]
    bad = QuantTensor(q.bits, q.group, q.codes, q.scale, q.offset * 1.001, q.cols, q.super_scale, q.super_min)
    with pytest.raises(ValueError, match="multiples of the super-block minimum"):
        QuantLinear([bad], act=8)
    QuantLinear([bad], act=16)  # int4-a16 keeps float offsets


def test_int4_a16_refuses_integer_scales_that_would_overflow_its_int16_products():
    """int4-a16 multiplies codes by the integer group scales in int16 and sums them in int32 lanes:
    scales larger than a real Q4_K's 6 bits would overflow, so such a layer is refused, not miscomputed."""
    q = LAYERS["Q4_K"]
    big = QuantTensor(q.bits, q.group, q.codes, q.super_scale.repeat_interleave(8, dim=1) * 100, q.offset, q.cols,
                      q.super_scale)
    assert big.sub_scales().max() == 100
    with pytest.raises(ValueError, match="overflow"):
        QuantLinear([big], act=16)
    QuantLinear([big], act=8)  # int8 products (vpmaddubsw) have room for 8-bit scales


def test_an_older_packed_cache_is_packed_again(tiny_kquant, tmp_path, monkeypatch):
    """A cache written before super_scale existed would silently lose int4-a8's super-block path."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from specdec.models.loader import load_model
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    first = load_model(str(tiny_kquant), "int4-a8", progress=False)
    path = next((tmp_path / "home" / "cache" / first.sha256).glob("weights-int4.safetensors"))
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    old = {k: v for k, v in load_file(str(path)).items() if not k.endswith("super_scale")}
    save_file(old, str(path), metadata={k: v for k, v in meta.items() if k != "format"})
    again = load_model(str(tiny_kquant), "int4-a8", progress=False)
    assert not again.cache_hit
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["format"] == meta["format"]
        assert any(k.endswith("super_scale") for k in f.keys())  # noqa: SIM118 (safe_open is no dict)
    assert load_model(str(tiny_kquant), "int4-a8", progress=False).cache_hit


_SPEC_CASES = [(p, *case) for p in ("int4", "int4-a16", "int4-a8")
               for case in (("ngram", None, None), ("draft_model", "tiny_llama", None),
                            ("draft_model", "tiny_llama", "q4_1"))]
_SPEC_CASES += [("int4-a8", "draft_model", "tiny_llama", fmt) for fmt in ("q4_64", "q3_64")]  # int8 paths only


@pytest.mark.parametrize("precision,method,draft,requantize", _SPEC_CASES)
@pytest.mark.parametrize("target", ["tiny_qwen", "tiny_kquant"])
def test_int4_speculative_equals_plain_greedy(target, request, method, draft, requantize, precision):
    model = str(request.getfixturevalue(target))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = ["hello there", "the cat sat on the mat and then the cat sat on the mat", "a"]
    plain = LLM(config=engine_config(model, precision=precision), progress=False)
    ref = [o.token_ids for o in plain.generate(prompts, params)]
    cfg = engine_config(model, precision=precision)
    cfg.speculative = SpeculativeConfig(method=method, num_speculative_tokens=3, policy="fixed",
                                        draft_model=str(request.getfixturevalue(draft)) if draft else None,
                                        draft={"requantize": requantize})
    spec = LLM(config=cfg, progress=False)
    if requantize:  # the draft's own weights, requantized: only acceptance may change
        drafts = spec.engine.speculator.drafts
        assert drafts.proposers[drafts.default_id].loaded.requantized == requantize
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == ref
    assert all(o.stats.precision == precision for o in outs)
    # int4 rows are not padded: the cost model prices every extra verified row
    assert all(c.verify_costs.row_align == 1 for c in spec.engine.speculator.controllers.values())
    assert sum(o.stats.drafted_tokens for o in outs) > 0


def test_int4_refuses_a_safetensors_folder(tmp_path):
    from specdec.models.gguf_loader import ModelFileError
    from specdec.models.loader import load_model
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelFileError, match="int4"):
        load_model(str(tmp_path), "int4", progress=False)


def test_matmul_error_bench_tells_the_two_offset_forms_apart():
    """`specdec bench matmul`'s measure on a designed layer: the exact form (and the kernel) is closer to
    float64 W x than the offsets on unrounded sums are, and Q6_K (no offsets) has one form."""
    from specdec.bench.matmul_error import part_errors, summarize
    x = torch.randn(16, COLS, generator=torch.Generator().manual_seed(3))
    q4k, q6k = part_errors(LAYERS["Q4_K"], x), part_errors(LAYERS["Q6_K"], x)
    assert q4k["qtype"] == "Q4_K" and q4k["exact"] < q4k["unrounded"]
    assert q6k["qtype"] == "Q6_K" and q6k["exact"] == q6k["unrounded"]
    if kernel.available():
        assert q4k["kernel_vs_exact"] < 1e-5 and q6k["kernel_vs_exact"] < 1e-5
    rows = summarize([{"layer": 0, "part": "attn_q", **q4k}, {"layer": 1, "part": "attn_q", **q4k}])
    assert rows[0]["layers"] == 2 and rows[0]["ratio_min"] == rows[0]["ratio_max"] > 1
