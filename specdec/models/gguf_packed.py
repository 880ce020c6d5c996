"""GGUF -> weight-only quantized model (precisions "int4", "int4-a16", "int4-a8"): every matrix stays in
its file's blocks, carried into packed codes (`specdec.quant`); norms and biases are float32.

Q4_K / Q4_0 / Q4_1 become int4 codes (32-value groups, scale and offset); Q6_K keeps its 6-bit codes
(16-value groups, the file's bit layout); Q5_0 / Q5_K / Q8_0 become int8 codes (32-value groups); all
decode to exactly the file's values. Other types
(F16, Q2_K, ...) stay dense float32. The packed model is cached next to the dequantized ones
(`weights-int4.safetensors`, written under a temporary name, then renamed).

A draft may be requantized (`requant`, DraftConfig.requantize): its matrices quantized again at pack
time to fewer bits, in a cache of their own (A draft's numbers never reach the output, only its
acceptance does):
- `q4_1`: those held as int8 codes (Q5_0, Q8_0: 9 bits a weight as packed) to gguf's Q4_1, 4-bit codes
  with a scale and a minimum per 32 values (6 bits a weight);
- `q4_64`, `q3_64` (int4-a8 only): every matrix but the embedding held wider, to 4- or 3-bit codes with
  a float16 scale and offset per 64 values fitted by least squares (`quant/requantize.py`; 4.5 and 3.5
  bits a weight in the kernels' tiles), whose activations are rounded per 64 values too.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import save_file

from specdec.models import weight_cache
from specdec.models.gguf_loader import (ModelFileError, _dequantize, _gguf_sources, _unpermute, cached_config,
                                        check_sources, config_from_metadata, open_reader, read_header, read_metadata)
from specdec.models.families import family
from specdec.models.llama import LlamaConfig, param_shapes
from specdec.quant.gguf_blocks import PACKABLE, Codes, decode
from specdec.quant.packed import QuantLinear, QuantTensor
from specdec.quant.requantize import requantize

CACHE_NAME = "weights-int4.safetensors"
# bumped when what a packed cache holds changes; an older cache is packed again (2: K-quants' super_scale;
# 3: Q6_K's codes at 6 bits, Q4_K's super_min; 4: requantized scales and offsets float16 values)
PACK_FORMAT = "4"
_MATRICES = ("embed", "lm_head", "qkv", "o", "gate_up", "down")
_WIDE = frozenset({Q.Q5_0, Q.Q8_0})  # the types held as int8 codes


@dataclass(frozen=True)
class Requant:
    """What a draft's matrices may be requantized to: `bits`-bit codes per `group` values, from the
    `sources` types; by gguf's quantizer to `gguf_type` where set, else by least squares."""
    bits: int
    group: int
    sources: frozenset
    gguf_type: Q | None = None
    embedding: bool = False  # whether the embedding table (a row lookup, never streamed) is requantized too


REQUANT = {
    "q4_1": Requant(4, 32, _WIDE, Q.Q4_1, embedding=True),
    "q4_64": Requant(4, 64, _WIDE | {Q.Q4_0, Q.Q4_1, Q.Q5_K, Q.Q6_K}),  # all held wider than 5 bits a weight
    "q3_64": Requant(3, 64, PACKABLE),
}


def _is_matrix(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in _MATRICES


def _assemble(flat: dict[str, torch.Tensor], layout: dict[str, list[dict]], act: int) -> dict[str, object]:
    weights: dict[str, object] = {}
    for name, parts in layout.items():
        if not parts:
            weights[name] = flat[name]
            continue
        built: list[QuantTensor | torch.Tensor] = []
        for i, part in enumerate(parts):
            key = f"{name}/{i}/"
            if part["bits"] == 0:
                built.append(flat[key + "dense"])
            else:
                built.append(QuantTensor(part["bits"], part["group"], flat[key + "codes"], flat[key + "scale"],
                                         flat.get(key + "offset"), part["cols"], flat.get(key + "super_scale"),
                                         flat.get(key + "super_min")))
        # an embedding with an output layer of its own is only looked up: no tiles for the int8 products
        weights[name] = QuantLinear(built, act, tiled=name != "embed" or "lm_head" not in layout)
    return weights


def _codes(t, name: str, rows: int, cols: int, requant: str | None) -> Codes:
    """A matrix's codes as packed: the file's blocks, or requantized from its values."""
    r = REQUANT.get(requant)
    if (r is None or t.tensor_type not in r.sources or cols % r.group
            or (name == "embed" and not r.embedding)):
        return decode(t.data, t.tensor_type, rows, cols)
    values = np.ascontiguousarray(_dequantize(t), dtype=np.float32).reshape(rows, cols)
    if r.gguf_type is None:
        return requantize(values, r.bits, r.group)
    import gguf
    return decode(gguf.quants.quantize(values, r.gguf_type), r.gguf_type, rows, cols)


def auto_requant(path: Path, act: int) -> str | None:
    """What `requantize: auto` packs a file's matrices as (a cheaper draft step), where any matrix a step
    reads is held in a type the format narrows: q4_64 under int8 activations (int4-a8; the best measured
    acceptance x price, docs/performance.md), q4_1 otherwise; else None (the file's blocks)."""
    fmt = "q4_64" if act == 8 else "q4_1"
    tensors = read_header(path)[1]  # the header alone: GGUFReader would parse the vocabulary for seconds
    wide = any(ttype in REQUANT[fmt].sources for name, (ttype, dims) in tensors.items()
               if name == "output.weight" or (name.startswith("blk.") and len(dims) == 2))
    return fmt if wide else None


def load_gguf_packed(path: Path, sha256: str, cache_dir: Path, act: int = 0, progress: bool = True,
                     requant: str | None = None) -> tuple[LlamaConfig, dict[str, object], bool]:
    """Returns (config, weights, cache_hit); matrices are QuantLinear (`act`: their activations' bits),
    the rest float32 tensors. `requant`: a key of REQUANT, or None for the file's blocks."""
    if requant is not None and requant not in REQUANT:
        raise ValueError(f"requantize must be one of {sorted(REQUANT)} or null, got {requant!r}")
    if requant is not None and REQUANT[requant].gguf_type is None and act != 8:
        raise ValueError(f"requantize {requant} is read by int4-a8's integer kernels only, not with "
                         f"{'float' if act == 0 else f'int{act}'} activations")
    name = CACHE_NAME if requant is None else CACHE_NAME.replace(".safetensors", f"-{requant}.safetensors")
    cache_path, config_path = cache_dir / name, cache_dir / "config.json"
    cfg = cached_config(config_path) if cache_path.exists() else None
    if cfg is not None:
        from safetensors import safe_open
        with safe_open(str(cache_path), framework="pt") as f:
            meta = f.metadata()
        if meta.get("format") == PACK_FORMAT:
            return cfg, _assemble(weight_cache.load_mmap(cache_path), json.loads(meta["layout"]), act), True

    meta = read_metadata(path)
    reader = open_reader(path)
    tensors = {t.name: t for t in reader.tensors}
    cfg = config_from_metadata(meta, tensors)
    shapes, sources = param_shapes(cfg), _gguf_sources(cfg)
    check_sources(path, tensors, shapes, sources)
    interleaved = family(cfg.architecture).interleaved_qk
    flat: dict[str, torch.Tensor] = {}
    layout: dict[str, list[dict]] = {}
    from tqdm import tqdm
    for name in tqdm(list(shapes), desc=f"packing {path.name}", unit="tensor", disable=not progress):
        parts: list[dict] = []
        dense_parts: list[np.ndarray] = []
        for i, src in enumerate(sources[name]):
            t = tensors[src]
            heads = cfg.num_heads if "attn_q" in src else cfg.num_kv_heads
            permute = interleaved and src.endswith(("attn_q.weight", "attn_k.weight"))
            if not _is_matrix(name):
                w = _dequantize(t)
                dense_parts.append(_unpermute(w, heads) if permute and w.ndim == 2 else w)
                continue
            rows, cols = int(t.shape[1]), int(t.shape[0])
            key = f"{name}/{i}/"
            if t.tensor_type in PACKABLE:
                c = _codes(t, name, rows, cols, requant)
                if permute:  # a row permutation: codes, scales and offsets move together
                    c.q, c.scale = _unpermute(c.q, heads), _unpermute(c.scale, heads)
                    c.offset = None if c.offset is None else _unpermute(c.offset, heads)
                    c.super_scale = None if c.super_scale is None else _unpermute(c.super_scale, heads)
                    c.super_min = None if c.super_min is None else _unpermute(c.super_min, heads)
                qt = QuantTensor.from_codes(c)
                for k, v in qt.tensors().items():
                    flat[key + k] = v
                parts.append({"bits": qt.bits, "group": qt.group, "cols": cols})
            else:
                w = _dequantize(t)
                flat[key + "dense"] = torch.from_numpy(np.array(_unpermute(w, heads) if permute else w,
                                                                dtype=np.float32))
                parts.append({"bits": 0, "group": 0, "cols": cols})
        if dense_parts:
            flat[name] = torch.from_numpy(np.concatenate([np.asarray(p, dtype=np.float32) for p in dense_parts]))
            if tuple(flat[name].shape) != shapes[name]:
                raise ModelFileError(f"{path}: {name} has shape {tuple(flat[name].shape)}, expected {shapes[name]}")
        layout[name] = parts
    tmp = cache_path.with_name(f".{cache_path.name}.{os.getpid()}.tmp")
    cache_dir.mkdir(parents=True, exist_ok=True)
    try:
        save_file(flat, str(tmp), metadata={"layout": json.dumps(layout), "gguf_sha256": sha256,
                                            "format": PACK_FORMAT, "created": str(time.time())})
        os.replace(tmp, cache_path)
    finally:
        tmp.unlink(missing_ok=True)
    weight_cache.atomic_write_text(config_path, json.dumps(cfg.to_dict(), indent=1))
    weights = _assemble(flat, layout, act)
    for name, w in weights.items():
        if isinstance(w, QuantLinear) and w.shape != shapes[name]:
            raise ModelFileError(f"{path}: {name} has shape {w.shape}, expected {shapes[name]}")
    return cfg, weights, False
