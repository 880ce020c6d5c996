"""GGUF files -> hyperparameters, metadata and dense tensors.

Reading uses the `gguf` package (GGUFReader, gguf.quants.dequantize). Dequantized weights are cached
as memory-mapped safetensors keyed by the GGUF's sha256, so a second load maps them instead of
dequantizing again, and two engines (or two processes) share the same pages.
"""
from __future__ import annotations

import json
import math
import mmap
import struct
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from specdec.models import gguf_keys, weight_cache
from specdec.models.families import family, has_bias
from specdec.models.llama import LlamaConfig, param_shapes


class ModelFileError(ValueError):
    """A model file is missing, truncated, corrupt, or of a kind we cannot run."""


def open_reader(path: str | Path) -> gguf.GGUFReader:
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"model file not found: {path}")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the gguf package raises assorted errors on truncated/corrupt data
        raise ModelFileError(f"{path} is not a readable GGUF file (truncated or corrupt?): {e}") from e


_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_QUANT_SIZES = {int(t): v for t, v in gguf.GGML_QUANT_SIZES.items()}  # ggml type -> (block elements, block bytes)


def _read_value(buf: mmap.mmap, pos: int, vtype: int) -> tuple[Any, int]:
    if vtype in _SCALAR:
        return struct.unpack_from(_SCALAR[vtype], buf, pos)[0], pos + struct.calcsize(_SCALAR[vtype])
    if vtype == 8:
        (n,) = struct.unpack_from("<Q", buf, pos)
        if pos + 8 + n > len(buf):  # checked first: a corrupt length must not become a huge allocation
            raise ValueError("string runs past the end of the file")
        return buf[pos + 8:pos + 8 + n].decode("utf-8"), pos + 8 + n
    if vtype == 9:
        etype, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if etype in _SCALAR:  # fixed width (token_type): one bulk unpack
            end = pos + count * struct.calcsize(_SCALAR[etype])
            if end > len(buf):
                raise ValueError("array runs past the end of the file")
            return list(struct.unpack_from(f"<{count}{_SCALAR[etype][1]}", buf, pos)), end
        out = []
        for _ in range(count):
            v, pos = _read_value(buf, pos, etype)
            out.append(v)
        return out, pos
    raise ValueError(f"unknown GGUF value type {vtype}")


def read_metadata(path: str | Path) -> dict[str, Any]:
    """All metadata key/values of a GGUF file, read straight from its header (GGUFReader takes ~20 s
    on a 151k-token vocabulary; this takes well under a second). Also checks that the tensor data fits
    in the file, so a truncated file is refused before any work."""
    return read_header(path)[0]


def read_header(path: str | Path) -> tuple[dict[str, Any], dict[str, tuple[int, tuple[int, ...]]]]:
    """`read_metadata`'s metadata, and each tensor's ggml type and dimensions by name."""
    path = Path(path)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != b"GGUF":
                raise ValueError("bad magic (not a GGUF file)")
            version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
            if version < 2:
                raise ValueError(f"GGUF version {version} is not supported")
            pos, meta = 24, {}
            for _ in range(n_kv):
                key, pos = _read_value(buf, pos, 8)
                (vtype,) = struct.unpack_from("<I", buf, pos)
                meta[key], pos = _read_value(buf, pos + 4, vtype)
            data_end, tensors = 0, {}
            for _ in range(n_tensors):
                name, pos = _read_value(buf, pos, 8)
                (n_dims,) = struct.unpack_from("<I", buf, pos)
                dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
                ttype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
                pos += 16 + 8 * n_dims
                block, nbytes = _QUANT_SIZES.get(ttype, (1, 0))  # a type unknown to gguf: its size is not checked
                data_end = max(data_end, offset + math.prod(dims) // block * nbytes)
                tensors[name] = (ttype, dims)
            align = int(meta.get("general.alignment", 32))
            if n_tensors and -(-pos // align) * align + data_end > len(buf):
                raise ValueError("tensor data runs past the end of the file")
            return meta, tensors
    except FileNotFoundError as e:
        raise ModelFileError(f"model file not found: {path}") from e
    except (ValueError, struct.error, OSError, OverflowError, MemoryError) as e:  # UnicodeDecodeError is a ValueError
        raise ModelFileError(f"{path} is not a readable GGUF file (truncated or corrupt?): {e}") from e


SUPPORTED_TENSOR_TYPES = {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
                          Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}


def config_from_metadata(meta: dict[str, Any], tensors: dict[str, Any]) -> LlamaConfig:
    """The hyperparameters of a GGUF file (`tensors`: GGUFReader's by name). Every `{arch}.*` key and
    every tensor is either read or refused by name (gguf_keys.py): nothing is skipped."""
    arch = meta.get("general.architecture")
    try:
        fam = family(arch)
    except ValueError as e:
        raise ModelFileError(str(e)) from e

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelFileError(f"GGUF metadata lacks {arch}.{key}")
        if isinstance(value, list):  # per-layer values (llama.cpp allows some): one for all layers here
            if len(set(value)) != 1:
                raise ModelFileError(f"GGUF metadata {arch}.{key} differs between layers: not implemented")
            value = value[0]
        return value

    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // num_heads))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    try:
        gguf_keys.check_keys(meta, arch, head_dim)
        freqs = tensors.get(gguf_keys.ROPE_FREQS) if fam.rope_freqs else None
        factors = None if freqs is None else tuple(float(x) for x in _dequantize(freqs).reshape(-1))
        scaling = gguf_keys.rope_scaling(meta, arch, factors)
    except ValueError as e:
        raise ModelFileError(str(e)) from e
    cfg = LlamaConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        max_position=int(get("context_length")),
        attention_bias=has_bias(fam, "blk.0.attn_q.bias" in tensors),
        tie_embeddings="output.weight" not in tensors,
        rope=scaling,
        no_rope_layers=fam.no_rope_layers(int(get("block_count"))),
    )
    _check_every_tensor_read(cfg, tensors)
    return cfg


def _check_every_tensor_read(cfg: LlamaConfig, tensors: dict[str, Any]) -> None:
    sources = _gguf_sources(cfg)
    read = {src for name in param_shapes(cfg) for src in sources[name]}
    if cfg.rope.kind == "llama3":
        read.add(gguf_keys.ROPE_FREQS)
    refuse_unread(set(tensors) - read, cfg.architecture, "the file")


def refuse_unread(unread: set[str], architecture: str, where: str) -> None:
    """ModelFileError naming a tensor the forward does not read, if there is one: never skipped."""
    if unread:
        raise ModelFileError(f"tensor {min(unread)} (of {len(unread)} unread) is not part of the {architecture} "
                             f"forward specdec runs; {where} is refused rather than run without it")


def cached_config(config_path: Path) -> LlamaConfig | None:
    """A cache's config.json, or None where it is missing or was written before a field it lacks."""
    try:
        return LlamaConfig.from_dict(json.loads(config_path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_sources(path: Path, tensors: dict[str, Any], shapes: dict[str, tuple[int, ...]],
                  sources: dict[str, list[str]]) -> None:
    """Every tensor the model needs is in the file, in a type we can read: checked before any work."""
    for name in shapes:
        for src in sources[name]:
            if src not in tensors:
                raise ModelFileError(f"{path}: tensor {src} is missing")
            if tensors[src].tensor_type not in SUPPORTED_TENSOR_TYPES:
                raise ModelFileError(f"{path}: tensor {src} has unsupported type {tensors[src].tensor_type.name}")


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row interleaving for `llama` files (back to rotate-half layout)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_sources(cfg: LlamaConfig) -> dict[str, list[str]]:
    """Our parameter name -> GGUF tensor names stacked along rows to make it."""
    src = {"embed": ["token_embd.weight"], "norm": ["output_norm.weight"], "lm_head": ["output.weight"]}
    for n in range(cfg.num_layers):
        b, p = f"blk.{n}.", f"layers.{n}."
        src[p + "input_norm"] = [b + "attn_norm.weight"]
        src[p + "qkv"] = [b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"]
        src[p + "qkv_bias"] = [b + "attn_q.bias", b + "attn_k.bias", b + "attn_v.bias"]
        src[p + "q_norm"], src[p + "k_norm"] = [b + "attn_q_norm.weight"], [b + "attn_k_norm.weight"]
        src[p + "attn_out_norm"] = [b + "post_attention_norm.weight"]
        src[p + "mlp_out_norm"] = [b + "post_ffw_norm.weight"]
        src[p + "o"] = [b + "attn_output.weight"]
        src[p + "post_norm"] = [b + "ffn_norm.weight"]
        src[p + "gate_up"] = [b + "ffn_gate.weight", b + "ffn_up.weight"]
        src[p + "down"] = [b + "ffn_down.weight"]
    return src


def _dequantize(t: Any) -> np.ndarray:
    if t.tensor_type not in SUPPORTED_TENSOR_TYPES:
        raise ModelFileError(f"tensor {t.name} has unsupported type {t.tensor_type.name}")
    from gguf.quants import dequantize
    out = dequantize(t.data, t.tensor_type)
    return out.reshape(tuple(int(s) for s in reversed(t.shape)))


def load_gguf(path: Path, sha256: str, cache_dir: Path, dtype: torch.dtype, device: str,
              progress: bool = True) -> tuple[LlamaConfig, dict[str, torch.Tensor], bool]:
    """Load a GGUF model as dense tensors of `dtype`, through the dequantized-weight cache.

    Returns (config, weights, cache_hit)."""
    dtype_name = str(dtype).removeprefix("torch.")
    weights_path = cache_dir / f"weights-{dtype_name}.safetensors"
    config_path = cache_dir / "config.json"
    cfg = cached_config(config_path) if weights_path.exists() else None
    if cfg is not None:
        return cfg, weight_cache.load_mmap(weights_path, device), True

    meta = read_metadata(path)  # also refuses a truncated file before any work
    reader = open_reader(path)
    tensors = {t.name: t for t in reader.tensors}
    cfg = config_from_metadata(meta, tensors)
    shapes = param_shapes(cfg)
    sources = _gguf_sources(cfg)
    check_sources(path, tensors, shapes, sources)

    def build(name: str) -> torch.Tensor:
        parts = []
        for src in sources[name]:
            w = _dequantize(tensors[src])
            if family(cfg.architecture).interleaved_qk and src.endswith(("attn_q.weight", "attn_k.weight")):
                w = _unpermute(w, cfg.num_heads if "attn_q" in src else cfg.num_kv_heads)
            parts.append(torch.from_numpy(np.array(w, dtype=np.float32)))  # a writable copy
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if tuple(t.shape) != shapes[name]:
            raise ModelFileError(f"{path}: {name} has shape {tuple(t.shape)}, expected {shapes[name]}")
        return t

    from tqdm import tqdm
    bar = tqdm(total=len(shapes), desc=f"dequantizing {path.name}", unit="tensor", disable=not progress)
    with ThreadPoolExecutor(max_workers=2) as pool:  # numpy releases the GIL: two cores, two tensors
        built = _bounded_map(pool, build, list(shapes), window=3)
        weight_cache.write_streaming(weights_path, shapes, dtype, built,
                                     metadata={"gguf_sha256": sha256, "created": str(time.time())},
                                     on_tensor=lambda _: bar.update(1))
    bar.close()
    weight_cache.atomic_write_text(config_path, json.dumps(cfg.to_dict(), indent=1))
    return cfg, weight_cache.load_mmap(weights_path, device), False


def _bounded_map(pool: ThreadPoolExecutor, fn: Callable[[str], torch.Tensor], names: list[str],
                 window: int) -> Iterator[tuple[str, torch.Tensor]]:
    """pool.map in order, with at most `window` results alive: peak memory stays a few tensors."""
    pending: deque = deque()
    for name in names:
        pending.append((name, pool.submit(fn, name)))
        if len(pending) >= window:
            n, fut = pending.popleft()
            yield n, fut.result()
    while pending:
        n, fut = pending.popleft()
        yield n, fut.result()
