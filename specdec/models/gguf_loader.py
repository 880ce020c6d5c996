"""GGUF files -> hyperparameters, metadata and dense tensors.

Reading uses the `gguf` package (GGUFReader, gguf.quants.dequantize). Dequantized weights are cached
as memory-mapped safetensors keyed by the GGUF's sha256, so a second load maps them instead of
dequantizing again, and two engines (or two processes) share the same pages.
"""
from __future__ import annotations

import json
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

from specdec.models import weight_cache
from specdec.models.llama import SUPPORTED_ARCHITECTURES, LlamaConfig, param_shapes


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


def read_metadata(source: str | Path | gguf.GGUFReader) -> dict[str, Any]:
    """All key/value metadata of a GGUF file as plain Python values (lists for arrays)."""
    reader = source if isinstance(source, gguf.GGUFReader) else open_reader(source)
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = field.contents()
    return meta


SUPPORTED_TENSOR_TYPES = {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
                          Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}


def config_from_metadata(meta: dict[str, Any], tensor_names: set[str]) -> LlamaConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelFileError(f"unknown architecture {arch!r}: specdec runs {', '.join(SUPPORTED_ARCHITECTURES)}")

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelFileError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    return LlamaConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // num_heads)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        max_position=int(get("context_length")),
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        tie_embeddings="output.weight" not in tensor_names,
    )


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
    if weights_path.exists() and config_path.exists():
        cfg = LlamaConfig(**json.loads(config_path.read_text()))
        return cfg, weight_cache.load_mmap(weights_path, device), True

    reader = open_reader(path)
    tensors = {t.name: t for t in reader.tensors}
    cfg = config_from_metadata(read_metadata(reader), set(tensors))
    shapes = param_shapes(cfg)
    sources = _gguf_sources(cfg)
    for name in shapes:
        for src in sources[name]:
            if src not in tensors:
                raise ModelFileError(f"{path}: tensor {src} is missing")
            if tensors[src].tensor_type not in SUPPORTED_TENSOR_TYPES:
                raise ModelFileError(f"{path}: tensor {src} has unsupported type {tensors[src].tensor_type.name}")

    def build(name: str) -> torch.Tensor:
        parts = []
        for src in sources[name]:
            w = _dequantize(tensors[src])
            if cfg.architecture == "llama" and src.endswith(("attn_q.weight", "attn_k.weight")):
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
    weight_cache.atomic_write_text(config_path, json.dumps(cfg.__dict__, indent=1))
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
