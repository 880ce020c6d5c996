"""The AVX2 CPU kernels, one library: `qlinear.cpp` (linear layers: quantized weights, and dense float32
weights), `layer_ops.cpp` (RMSNorm, rotary embeddings, SwiGLU's activation), `attention.cpp` (paged
attention; `attention_avx512.cpp` the same built for AVX-512) and `decoder.cpp` (the layer loop over
them in one call; its Python side is `decoder.py`), their C ABI declared once in `kernels.h` and
mirrored once here (the structs and `SIGNATURES`). Built with the system C++ compiler on first use
into $SPECDEC_HOME/kernels (keyed by the hash of the sources and headers, written under a temporary
name, then renamed), loaded with ctypes. Where it cannot be built (no compiler, no
AVX2, not x86), `available()` says why: the pure-PyTorch paths run instead (`packed.py`, `layers.py`,
`attention.py`, `models/llama.py`), and float32 uses MKL in row blocks."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from specdec.config import specdec_home
from specdec.quant import kv_format

SOURCES = [Path(__file__).with_name(f) for f in ("qlinear.cpp", "qlinear_vnni.cpp", "layer_ops.cpp", "attention.cpp",
                                                  "attention_avx512.cpp", "decoder.cpp", "picks.cpp")]
HEADERS = sorted(Path(__file__).parent.glob("*.h"))  # every header: included, so hashed too
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-fPIC", "-std=c++17"]
# instruction sets a source is built for beyond AVX2; its code runs only where the CPU has them (kernel_isa)
EXTRA_FLAGS = {name: ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]
               for name in ("qlinear_vnni.cpp", "attention_avx512.cpp")}
ISAS = {0: "avx2", 1: "avx512-vnni"}  # kernels.h's KERNEL_ISA_*


# ---- the C ABI of kernels.h, mirrored once (tests/test_quant.py checks it against the header) ----
_ptr, _i64, _int, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class Part(ctypes.Structure):
    _fields_ = [("n", _i64), ("bits", _int), ("group", _int), ("act", _int), ("codes", _ptr), ("scale", _ptr),
                ("offset", _ptr), ("dsup", _ptr), ("sub", _ptr), ("mins", _ptr), ("dmin", _ptr), ("dense", _ptr),
                ("tiles", _ptr)]


class Linear(ctypes.Structure):
    _fields_ = [("parts", ctypes.POINTER(Part)), ("num_parts", _i64), ("n", _i64), ("bias", _ptr)]


class Layer(ctypes.Structure):
    _fields_ = [("input_norm", _ptr), ("post_norm", _ptr), ("attn_out_norm", _ptr), ("mlp_out_norm", _ptr),
                ("q_norm", _ptr), ("k_norm", _ptr), ("qkv", Linear),
                ("o", Linear), ("gate_up", Linear), ("down", Linear), ("k_cache", _ptr), ("v_cache", _ptr),
                ("rope", _int)]


class Dims(ctypes.Structure):
    _fields_ = [("hidden", _i64), ("intermediate", _i64), ("num_heads", _i64), ("num_kv_heads", _i64),
                ("head_dim", _i64), ("kv_slots", _i64), ("eps", _f32), ("attn_scale", _f32), ("kv_format", _int),
                ("q_norm_len", _i64), ("k_norm_len", _i64)]


class ChainRow(ctypes.Structure):
    _fields_ = [("feed", _i64), ("steps", _i64), ("position", _i64), ("slots", _ptr), ("tokens", _ptr), ("own", Linear),
                ("own_ids", _ptr), ("temperature", _f32), ("top_p", _f32), ("min_p", _f32), ("top_k", _i64),
                ("noise_key", _i64), ("noise_at", _i64), ("uniform", _ptr), ("probs", _ptr), ("vocab", _i64)]


class CoupledRow(ctypes.Structure):
    _fields_ = [("temperature", _f32), ("top_p", _f32), ("min_p", _f32), ("top_k", _i64), ("noise_key", _i64),
                ("position", _i64)]


# every extern "C" function: name -> (result type, [(argument, type)]); pointers to data are void pointers
SIGNATURES: dict[str, tuple[type | None, list[tuple[str, type]]]] = {
    "qlinear": (_int, [("x", _ptr), ("rows", _i64), ("k", _i64), ("bits", _int), ("group", _int), ("codes", _ptr),
                       ("scale", _ptr), ("offset", _ptr), ("n", _i64), ("y", _ptr), ("ldy", _i64),
                       ("threads", _int), ("act", _int), ("sub", _ptr), ("dsup", _ptr), ("mins", _ptr),
                       ("dmin", _ptr), ("tiles", _ptr)]),
    "kernel_isa": (_int, [("request", _int)]),
    "dense_linear": (_int, [("x", _ptr), ("rows", _i64), ("k", _i64), ("w", _ptr), ("n", _i64), ("y", _ptr),
                            ("ldy", _i64), ("threads", _int)]),
    "qlinear_parts": (_int, [("x", _ptr), ("rows", _i64), ("k", _i64), ("parts", ctypes.POINTER(Part)),
                             ("num_parts", _i64), ("y", _ptr), ("ldy", _i64), ("threads", _int)]),
    "int8_peak": (ctypes.c_double, [("threads", _int), ("seconds", ctypes.c_double)]),
    "read_pass_seconds": (ctypes.c_double, [("p", _ptr), ("bytes", _i64), ("threads", _int)]),
    "pack_tiles16": (None, [("bits", _int), ("codes", _ptr), ("sub", _ptr), ("mins", _ptr), ("d", _ptr),
                            ("dmin", _ptr), ("n", _i64), ("k", _i64), ("out", _ptr)]),
    "pack_tiles64": (None, [("bits", _int), ("codes", _ptr), ("scale", _ptr), ("offset", _ptr), ("n", _i64), ("k", _i64),
                            ("out", _ptr)]),
    "rms_norm": (None, [("x", _ptr), ("ldx", _i64), ("delta", _ptr), ("ldd", _i64), ("rows", _i64), ("h", _i64),
                        ("w", _ptr), ("eps", _f32), ("out", _ptr), ("threads", _int)]),
    "rope": (None, [("x", _ptr), ("ldx", _i64), ("rows", _i64), ("heads", _i64), ("d", _i64), ("positions", _ptr),
                    ("cos", _ptr), ("sin", _ptr)]),
    "qk_norms": (None, [("x", _ptr), ("ldx", _i64), ("rows", _i64), ("q_size", _i64), ("q_len", _i64),
                        ("k_size", _i64), ("k_len", _i64), ("q_norm", _ptr), ("k_norm", _ptr), ("eps", _f32),
                        ("threads", _int)]),
    "silu_mul": (None, [("x", _ptr), ("rows", _i64), ("n", _i64), ("out", _ptr), ("threads", _int)]),
    "attention": (None, [("q", _ptr), ("ldq", _i64), ("rows", _i64), ("num_heads", _i64), ("num_kv_heads", _i64),
                         ("d", _i64), ("kv_slots", _i64), ("k_cache", _ptr), ("v_cache", _ptr), ("ctx_slots", _ptr),
                         ("ctx_start", _ptr), ("ctx_len", _ptr), ("scale", _f32), ("out", _ptr),
                         ("threads", _int), ("kv_format", _int)]),
    "decoder_forward": (_int, [("layers", ctypes.POINTER(Layer)), ("num_layers", _i64),
                               ("dims", ctypes.POINTER(Dims)), ("final_norm", _ptr), ("h", _ptr), ("rows", _i64),
                               ("positions", _ptr), ("slot_mapping", _ptr), ("num_real", _i64),
                               ("ctx_slots", _ptr), ("ctx_start", _ptr), ("ctx_len", _ptr), ("cos", _ptr),
                               ("sin", _ptr), ("out", _ptr), ("threads", _int)]),
    "draft_chain": (_int, [("layers", ctypes.POINTER(Layer)), ("num_layers", _i64), ("dims", ctypes.POINTER(Dims)),
                           ("final_norm", _ptr), ("embed", ctypes.POINTER(Part)), ("head", ctypes.POINTER(Linear)),
                           ("head_ids", _ptr), ("never", _ptr), ("rows", ctypes.POINTER(ChainRow)),
                           ("num_rows", _i64), ("cos", _ptr), ("sin", _ptr), ("threads", _ptr),
                           ("seconds", _ptr)]),
    "coupled_picks": (None, [("logits", _ptr), ("rows", _i64), ("vocab", _i64), ("params", ctypes.POINTER(CoupledRow)),
                             ("out", _ptr), ("threads", _int)]),
}


def _cpu_has_avx2() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


def library_path() -> Path:
    sources = b"".join(f.read_bytes() for f in SOURCES + HEADERS)
    digest = hashlib.sha256(sources + " ".join(FLAGS).encode() + repr(EXTRA_FLAGS).encode()).hexdigest()[:16]
    return specdec_home() / "kernels" / f"qlinear-{digest}.so"


def build(verbose: bool = True) -> Path:
    """Compile the kernel if it is not built yet; returns the library's path. Raises RuntimeError."""
    out = library_path()
    if out.exists():
        return out
    if platform.machine() not in ("x86_64", "AMD64") or not _cpu_has_avx2():
        raise RuntimeError("the quantized kernel needs an x86-64 CPU with AVX2 and FMA")
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    if verbose:
        print(f"building the CPU kernels: {cxx} {' '.join(f.name for f in SOURCES)} -> {out}", file=sys.stderr)
    try:
        with tempfile.TemporaryDirectory(prefix="specdec-kernels-") as objects:
            compiled = []
            for src in SOURCES:  # one object per source: each with its own instruction-set flags
                compiled.append(Path(objects) / f"{src.stem}.o")
                _compile([cxx, *FLAGS, *EXTRA_FLAGS.get(src.name, []), "-c", str(src), "-o", str(compiled[-1])])
            _compile([cxx, *FLAGS, "-shared", "-o", str(tmp), *map(str, compiled)])
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _compile(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"compiling the CPU kernels failed:\n{proc.stderr[-2000:]}")


@functools.cache
def _library() -> ctypes.CDLL | str:
    """The loaded library, or the reason it is not available."""
    if os.environ.get("SPECDEC_NO_KERNEL"):
        return "disabled by SPECDEC_NO_KERNEL"
    try:
        lib = ctypes.CDLL(str(build()))
    except (RuntimeError, OSError) as e:
        return str(e)
    for name, (restype, args) in SIGNATURES.items():
        f = getattr(lib, name)
        f.argtypes = [t for _, t in args]
        f.restype = restype
    if os.environ.get("SPECDEC_KERNEL_ISA") == "avx2":  # pin AVX2 where the CPU has more (A/B measurements)
        lib.kernel_isa(0)
    return lib


def _lib() -> ctypes.CDLL:
    lib = _library()
    assert not isinstance(lib, str), lib
    return lib


def isa(request: str | None = None) -> str:
    """The instruction set of the integer-activation paths and attention ("avx512-vnni" where the CPU has
    it, else "avx2"); `request` "avx2" pins AVX2 for this process (tests compare the paths), "best" undoes it."""
    code = {None: -1, "avx2": 0, "best": 1}[request]
    return ISAS[_lib().kernel_isa(code)]


def available() -> bool:
    return not isinstance(_library(), str)


def unavailable_reason() -> str | None:
    lib = _library()
    return lib if isinstance(lib, str) else None


def qlinear(x: torch.Tensor, bits: int, group: int, codes: torch.Tensor, scale: torch.Tensor,
            offset: torch.Tensor | None, out: torch.Tensor, act: int = 0,
            sub: torch.Tensor | None = None, super_scale: torch.Tensor | None = None,
            mins: torch.Tensor | None = None, super_min: torch.Tensor | None = None,
            tiles: torch.Tensor | None = None) -> None:
    """out[:, :n] = x @ W.T for W given by (codes, scale, offset); x: [rows, k] float32 contiguous,
    out: [rows, >= n] float32 with unit column stride (a column slice of a wider output is fine).
    act 8: x is first quantized to int8 per 32 values and the dot products are integer (int4-a8);
    with sub ([n, k / group] int8) and super_scale ([n, k / 256] float32), scale == super_scale * sub
    per 256 values (Q4_K, Q6_K) and x is quantized per 256 values: one integer sum per super-block.
    With act 8 on Q4_K, mins ([n, k / 32] uint8) and super_min ([n, k / 256]): the offsets are
    -super_min * mins, summed in integers over the rounded x; with tiles (`packed.tiles16`: Q4_K, Q6_K, or
    4- or 3-bit codes per 64 values), the same weights row-interleaved are read instead.
    act 16: x quantized to int16 per 256 values, integer dot products (int4-a16; needs sub)."""
    lib = _lib()
    assert x.dtype == torch.float32 and x.is_contiguous() and out.stride(1) == 1
    assert sub is None or (sub.dtype == torch.int8 and sub.is_contiguous() and super_scale is not None)
    assert mins is None or (mins.dtype == torch.uint8 and mins.is_contiguous() and super_min is not None)
    rc = lib.qlinear(x.data_ptr(), x.shape[0], x.shape[1], bits, group, codes.data_ptr(), scale.data_ptr(),
                     offset.data_ptr() if offset is not None else None, codes.shape[0], out.data_ptr(),
                     out.stride(0), torch.get_num_threads(), act,
                     sub.data_ptr() if sub is not None else None,
                     super_scale.data_ptr() if super_scale is not None else None,
                     mins.data_ptr() if mins is not None else None,
                     super_min.data_ptr() if super_min is not None else None,
                     tiles.data_ptr() if tiles is not None else None)
    if rc != 0:
        raise ValueError(f"qlinear: unsupported layout bits={bits} group={group} k={x.shape[1]}")


def coupled_picks(logits: torch.Tensor, rows: list[tuple[float, float, float, int, int, int]]) -> list[int]:
    """Each row of logits [len(rows), vocab] (float32, contiguous) processed with its temperature and
    filters and picked by the Gumbel-max with its noise (picks.cpp). rows: each row's CoupledRow fields,
    (temperature, top_p, min_p, top_k, noise key, output position)."""
    assert logits.dtype == torch.float32 and logits.is_contiguous() and logits.shape[0] == len(rows)
    out = torch.empty(len(rows), dtype=torch.int64)
    params = (CoupledRow * len(rows))(*rows)
    _lib().coupled_picks(logits.data_ptr(), len(rows), logits.shape[-1], params, out.data_ptr(),
                         min(torch.get_num_threads(), len(rows)))
    return out.tolist()


def pack_tiles16(bits: int, codes: torch.Tensor, sub: torch.Tensor, mins: torch.Tensor | None, d: torch.Tensor,
                 dmin: torch.Tensor | None, out: torch.Tensor) -> None:
    """A Q4_K (bits 4: codes [n, k / 2], sub and mins [n, k / 32], d and dmin [n, k / 256] float32) or
    Q6_K part (bits 6: codes [n, k * 3 / 4], sub [n, k / 16], d; no mins) into `out` as row-interleaved
    tiles (tiles_rows16.h says the layout)."""
    n, k = codes.shape[0], codes.shape[1] * 8 // bits
    for t in (codes, sub, mins, d, dmin, out):
        assert t is None or t.is_contiguous()
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    _lib().pack_tiles16(bits, codes.data_ptr(), sub.data_ptr(), ptr(mins), d.data_ptr(), ptr(dmin), n, k,
                        out.data_ptr())


def pack_tiles64(bits: int, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                 out: torch.Tensor) -> None:
    """A part requantized per 64 values (bits 4 or 3: codes [n, k * bits / 8], scale and offset [n, k / 64]
    float32 holding float16 values, offset may be None) into `out` as row-interleaved tiles
    (tiles_rows16_g64.h says the layout)."""
    n, k = codes.shape[0], codes.shape[1] * 8 // bits
    for t in (codes, scale, offset, out):
        assert t is None or t.is_contiguous()
    _lib().pack_tiles64(bits, codes.data_ptr(), scale.data_ptr(), None if offset is None else offset.data_ptr(), n,
                        k, out.data_ptr())


def int8_peak(threads: int, seconds: float = 0.2, runs: int = 3) -> float:
    """This core's int8 multiply-add rate on `threads` threads, in multiply-adds a second, with the
    instructions the integer paths use now (`isa`): the best of `runs` runs of about `seconds`."""
    return max(_lib().int8_peak(threads, seconds) for _ in range(runs))


def read_pass_seconds(x: torch.Tensor, threads: int) -> float:
    """Seconds for one read of x's bytes on `threads` threads, the lines asked for ahead (peak.h)."""
    assert x.is_contiguous() and x.device.type == "cpu"
    return _lib().read_pass_seconds(x.data_ptr(), x.numel() * x.element_size(), threads)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """out = x @ weight.T for float32 x [rows, k] and weight [n, k], both contiguous, k a multiple of 8;
    out: [rows, n] with unit column stride. Batch-invariant: each output's sum runs in a fixed order."""
    lib = _lib()
    assert x.dtype == weight.dtype == torch.float32 and x.is_contiguous() and weight.is_contiguous()
    assert out.stride(1) == 1 and out.shape == (x.shape[0], weight.shape[0])
    rc = lib.dense_linear(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), weight.shape[0], out.data_ptr(),
                          out.stride(0), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"dense_linear: k = {x.shape[1]} is not a multiple of 8")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of each row of x [rows, h] (float32, unit column stride, h a multiple of 8) -> a new
    [rows, h] tensor. With `delta`, x += delta first, in place (the residual add)."""
    assert x.dtype == weight.dtype == torch.float32 and x.stride(1) == 1 and weight.is_contiguous()
    assert delta is None or (delta.dtype == torch.float32 and delta.stride(1) == 1 and delta.shape == x.shape)
    out = torch.empty(x.shape, dtype=torch.float32)
    _lib().rms_norm(x.data_ptr(), x.stride(0), delta.data_ptr() if delta is not None else None,
                    delta.stride(0) if delta is not None else 0, x.shape[0], x.shape[1], weight.data_ptr(),
                    eps, out.data_ptr(), torch.get_num_threads())
    return out


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate-half rotary embedding in place. x: [rows, heads, d] float32 with contiguous heads (a
    column slice of a wider row is fine), d a multiple of 16; positions: [rows] int64; cos, sin:
    [max_positions, d] float32 contiguous."""
    assert x.dtype == cos.dtype == sin.dtype == torch.float32 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
    assert positions.dtype == torch.int64 and positions.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
    _lib().rope(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], x.shape[2], positions.data_ptr(),
                cos.data_ptr(), sin.data_ptr())


def qk_norms_(qkv: torch.Tensor, q_size: int, k_size: int, q_norm: torch.Tensor, k_norm: torch.Tensor,
              eps: float) -> None:
    """RMSNorm of q and of k in place, over runs as long as their weights (per head, Qwen3; the whole
    projection, OLMo 2): qkv [rows, >= q_size + k_size] float32 with unit column stride, q then k;
    q_norm / k_norm float32 contiguous, lengths multiples of 8 dividing q_size / k_size."""
    q_len, k_len = q_norm.numel(), k_norm.numel()
    assert qkv.dtype == q_norm.dtype == k_norm.dtype == torch.float32 and qkv.stride(1) == 1
    assert q_norm.is_contiguous() and k_norm.is_contiguous() and q_len % 8 == k_len % 8 == 0
    assert q_size % q_len == 0 and k_size % k_len == 0 and qkv.shape[1] >= q_size + k_size
    _lib().qk_norms(qkv.data_ptr(), qkv.stride(0), qkv.shape[0], q_size, q_len, k_size, k_len, q_norm.data_ptr(),
                    k_norm.data_ptr(), eps, torch.get_num_threads())


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate|up side by side: [rows, 2 n] float32 contiguous -> [rows, n], n a
    multiple of 8."""
    assert gate_up.dtype == torch.float32 and gate_up.is_contiguous() and gate_up.shape[1] % 16 == 0
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, n, dtype=torch.float32)
    _lib().silu_mul(gate_up.data_ptr(), rows, n, out.data_ptr(), torch.get_num_threads())
    return out


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx_slots: torch.Tensor,
              ctx_start: torch.Tensor, ctx_len: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """Causal attention of rows [0, len(ctx_len)) of q [rows, num_heads, d] (contiguous heads) over
    their own contexts: row r reads the cache slots ctx_slots[ctx_start[r]:ctx_start[r] + ctx_len[r]].
    k_cache, v_cache: [num_kv_heads, slots, row width], both of one kv_format dtype, contiguous; out:
    [>= rows, num_heads * d] contiguous, its first rows written."""
    assert q.dtype == out.dtype == torch.float32 and k_cache.dtype == v_cache.dtype in kv_format.DTYPES
    assert k_cache.shape == v_cache.shape and q.shape[1] % k_cache.shape[0] == 0
    assert k_cache.shape[2] == kv_format.row_width(k_cache.dtype, q.shape[2])
    assert q.stride(2) == 1 and q.stride(1) == q.shape[2] and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert out.is_contiguous() and all(t.dtype == torch.int64 and t.is_contiguous() for t in (ctx_slots, ctx_start, ctx_len))
    _lib().attention(q.data_ptr(), q.stride(0), ctx_len.shape[0], q.shape[1], k_cache.shape[0], q.shape[2],
                     k_cache.shape[1], k_cache.data_ptr(), v_cache.data_ptr(), ctx_slots.data_ptr(),
                     ctx_start.data_ptr(), ctx_len.data_ptr(), scale, out.data_ptr(), torch.get_num_threads(),
                     kv_format.CODES[k_cache.dtype])
