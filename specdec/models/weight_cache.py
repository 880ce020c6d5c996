"""Dequantized-weight cache: safetensors files written tensor by tensor, loaded memory-mapped.

Writing streams one tensor at a time (peak memory is one tensor, not the model) through a
temporary name that is renamed only when complete, so an interrupted write leaves nothing a later
run would trust. Loading maps the file: two engines, or two processes, share its pages.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import safe_open

from specdec.fileio import atomic_write_text

_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def write_streaming(path: Path, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                    tensors: Iterable[tuple[str, torch.Tensor]], metadata: dict[str, str] | None = None,
                    on_tensor: Callable[[str], None] | None = None) -> None:
    """Write a safetensors file whose header is known up front; `tensors` must yield every name of
    `shapes` in order, each of that shape."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict[str, object] = {"__metadata__": metadata or {}}
    offset = 0
    for name, shape in shapes.items():
        n = itemsize
        for s in shape:
            n *= s
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            names = iter(shapes)
            for name, tensor in tensors:
                expected = next(names)
                assert name == expected and tuple(tensor.shape) == shapes[name], (name, expected, tensor.shape)
                f.write(tensor.to(dtype).contiguous().view(torch.uint8).numpy().tobytes())
                if on_tensor:
                    on_tensor(name)
            assert next(names, None) is None, "not every tensor was written"
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def load_mmap(path: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt", device=device) as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def _memo_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"


def _read_memo(memo_path: Path) -> dict[str, str]:
    try:
        return json.loads(memo_path.read_text())
    except (OSError, ValueError):
        return {}


def record_sha256(path: Path, digest: str, memo_path: Path) -> None:
    memo = _read_memo(memo_path)
    memo[_memo_key(path)] = digest
    atomic_write_text(memo_path, json.dumps(memo, indent=0))


def file_sha256(path: Path, memo_path: Path | None = None) -> str:
    """sha256 of a file, memoized by (real path, size, mtime) so a warm load does not re-read it."""
    if memo_path and (known := _read_memo(memo_path).get(_memo_key(path))):
        return known
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    digest = h.hexdigest()
    if memo_path:
        record_sha256(path, digest, memo_path)
    return digest
