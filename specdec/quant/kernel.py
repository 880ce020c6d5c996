"""The AVX2 linear kernels (`qlinear.cpp`: quantized weights, and dense float32 weights): built with
the system C++ compiler on first use into $SPECDEC_HOME/kernels (keyed by the source's hash,
written under a temporary name, then renamed), loaded with ctypes. Where it cannot be built (no
compiler, no AVX2, not x86), `available()` says why: the pure-PyTorch path in `packed.py` runs
instead, and float32 uses MKL in row blocks."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from specdec.config import specdec_home

SOURCE = Path(__file__).with_name("qlinear.cpp")
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]


def _cpu_has_avx2() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


def library_path() -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
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
        print(f"building the CPU kernels: {cxx} {SOURCE.name} -> {out}", file=sys.stderr)
    try:
        proc = subprocess.run([cxx, *FLAGS, "-o", str(tmp), str(SOURCE)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE.name} failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


@functools.cache
def _library() -> ctypes.CDLL | str:
    """The loaded library, or the reason it is not available."""
    if os.environ.get("SPECDEC_NO_KERNEL"):
        return "disabled by SPECDEC_NO_KERNEL"
    try:
        lib = ctypes.CDLL(str(build()))
    except (RuntimeError, OSError) as e:
        return str(e)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.qlinear.argtypes = [p, i64, i64, ctypes.c_int, ctypes.c_int, p, p, p, i64, p, i64, ctypes.c_int, ctypes.c_int,
                           p, p]
    lib.qlinear.restype = ctypes.c_int
    lib.dense_linear.argtypes = [p, i64, i64, p, i64, p, i64, ctypes.c_int]
    lib.dense_linear.restype = ctypes.c_int
    return lib


def available() -> bool:
    return not isinstance(_library(), str)


def unavailable_reason() -> str | None:
    lib = _library()
    return lib if isinstance(lib, str) else None


def qlinear(x: torch.Tensor, bits: int, group: int, codes: torch.Tensor, scale: torch.Tensor,
            offset: torch.Tensor | None, out: torch.Tensor, act8: bool = False,
            sub: torch.Tensor | None = None, super_scale: torch.Tensor | None = None) -> None:
    """out[:, :n] = x @ W.T for W given by (codes, scale, offset); x: [rows, k] float32 contiguous,
    out: [rows, >= n] float32 with unit column stride (a column slice of a wider output is fine).
    act8: x is first quantized to int8 per 32 values and the dot products are integer (int4-a8);
    with sub ([n, k / group] int16) and super_scale ([n, k / 256] float32), scale == super_scale * sub
    per 256 values (Q4_K, Q6_K) and x is quantized per 256 values: one integer sum per super-block."""
    lib = _library()
    assert not isinstance(lib, str), lib
    assert x.dtype == torch.float32 and x.is_contiguous() and out.stride(1) == 1
    assert sub is None or (sub.dtype == torch.int16 and sub.is_contiguous() and super_scale is not None)
    rc = lib.qlinear(x.data_ptr(), x.shape[0], x.shape[1], bits, group, codes.data_ptr(), scale.data_ptr(),
                     offset.data_ptr() if offset is not None else None, codes.shape[0], out.data_ptr(),
                     out.stride(0), torch.get_num_threads(), int(act8),
                     sub.data_ptr() if sub is not None else None,
                     super_scale.data_ptr() if super_scale is not None else None)
    if rc != 0:
        raise ValueError(f"qlinear: unsupported layout bits={bits} group={group} k={x.shape[1]}")


def dense_linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """out = x @ weight.T for float32 x [rows, k] and weight [n, k], both contiguous, k a multiple of 8;
    out: [rows, n] with unit column stride. Batch-invariant: each output's sum runs in a fixed order."""
    lib = _library()
    assert not isinstance(lib, str), lib
    assert x.dtype == weight.dtype == torch.float32 and x.is_contiguous() and weight.is_contiguous()
    assert out.stride(1) == 1 and out.shape == (x.shape[0], weight.shape[0])
    rc = lib.dense_linear(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), weight.shape[0], out.data_ptr(),
                          out.stride(0), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"dense_linear: k = {x.shape[1]} is not a multiple of 8")
