"""Engine configuration as validated dataclasses.

User mistakes raise ValueError with a message naming the field; `assert` only guards internal
invariants. The YAML `execution_config` schema maps onto these fields (see `load_yaml_config`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

PRECISIONS = ("float32", "bfloat16")
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"


def specdec_home() -> Path:
    """Root of the model and weight caches ($SPECDEC_HOME, default ~/.cache/specdec)."""
    return Path(os.environ.get("SPECDEC_HOME", Path.home() / ".cache" / "specdec"))


@dataclass
class ModelConfig:
    model: str = DEFAULT_TARGET  # registry name, a .gguf path, or a Hugging Face-style folder
    precision: str = "float32"   # float32 is the exact oracle; others are named speed modes
    device: str = "cpu"
    max_model_len: int | None = None  # None: the model's own context length
    num_threads: int | None = None    # torch intra-op threads; None leaves torch's default

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")


@dataclass
class CacheConfig:
    block_size: int = 16
    target_cache_blocks: int = 1024   # KV blocks of the target pool (block_size tokens each)
    draft_cache_blocks: int = 1024    # KV blocks of each draft's pool
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "target_cache_blocks", "draft_cache_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"cache_config.{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 512  # token budget of one step (prefill chunks + decode tokens)
    max_batch_size: int = 32           # running requests
    long_prefill_token_threshold: int = 0  # >0: cap on one request's prefill chunk per step

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")


SPEC_METHODS = ("draft_model", "ngram")
SPEC_POLICIES = ("cost_model", "heuristic", "fixed")


@dataclass
class SpeculativeConfig:
    """How to speculate. `num_speculative_tokens` is k for `fixed` and the maximum k otherwise."""
    method: str = "draft_model"            # "draft_model" | "ngram"
    draft_model: str | None = None         # registry name or path (draft_model method)
    num_speculative_tokens: int = 4
    policy: str = "cost_model"             # "cost_model" | "heuristic" | "fixed"
    ngram_max: int = 4                     # prompt lookup: longest n-gram tried first
    ngram_min: int = 1
    acceptance_threshold: float = 0.4      # health check: rolling acceptance below this -> plain decoding
    health_window: int = 8                 # drafting steps in the rolling window
    reprobe_interval: int = 16             # plain steps between re-probes after a fallback
    reprobe_k: int = 2
    ema_alpha: float = 0.3                 # weight of the newest observation in acceptance/cost EMAs
    deterministic: bool = False            # cost model decides from acceptance counts and static costs only
    draft_cost_ratio: float = 0.4          # static t_draft / t_target (deterministic mode, and the prior)
    verify_cost_slope: float = 0.05        # static extra cost of each scored token beyond one
    plain_interval_after: int | None = None  # long-output guard: after this many tokens ...
    plain_interval_steps: int = 0            # ... this many plain steps between speculation rounds

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method must be one of {SPEC_METHODS}, got {self.method!r}")
        if self.policy not in SPEC_POLICIES:
            raise ValueError(f"speculative policy must be one of {SPEC_POLICIES}, got {self.policy!r}")
        if not 0 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [0, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        if not 0.0 <= self.acceptance_threshold <= 1.0:
            raise ValueError("acceptance_threshold must be in [0, 1]")
        if not 0.0 < self.ema_alpha <= 1.0:
            raise ValueError("ema_alpha must be in (0, 1]")
        for name in ("health_window", "reprobe_interval", "reprobe_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.plain_interval_after is not None and self.plain_interval_after < 0:
            raise ValueError("plain_interval_after must be >= 0")
        if self.plain_interval_steps < 0:
            raise ValueError("plain_interval_steps must be >= 0")


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None  # None: plain decoding


# YAML: execution_config keys -> (section, field)
_EXECUTION_KEYS = {
    "target_model": ("model", "model"),
    "precision": ("model", "precision"),
    "device": ("model", "device"),
    "max_model_len": ("model", "max_model_len"),
    "num_threads": ("model", "num_threads"),
    "max_batch_size": ("scheduler", "max_batch_size"),
    "max_num_batched_tokens": ("scheduler", "max_num_batched_tokens"),
    "long_prefill_token_threshold": ("scheduler", "long_prefill_token_threshold"),
}


def load_yaml_config(path: str | Path) -> tuple[EngineConfig, dict[str, Any]]:
    """Read `execution_config` from a YAML file into an EngineConfig.

    Returns the config and the remaining top-level sections (for later consumers such as the server).
    Unknown keys are an error naming the key.
    """
    import yaml

    with open(path) as f:
        doc = yaml.safe_load(f) or {}
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: top level must be a mapping")
    exe = dict(doc.pop("execution_config", {}) or {})
    sections: dict[str, dict[str, Any]] = {"model": {}, "cache": {}, "scheduler": {}}
    cache = exe.pop("cache_config", {}) or {}
    cache_names = {f.name for f in fields(CacheConfig)}
    for key, value in cache.items():
        if key not in cache_names:
            raise ValueError(f"{path}: unknown key execution_config.cache_config.{key}")
        sections["cache"][key] = value
    for key, value in exe.items():
        if key not in _EXECUTION_KEYS:
            raise ValueError(f"{path}: unknown key execution_config.{key}")
        section, name = _EXECUTION_KEYS[key]
        sections[section][name] = value
    config = EngineConfig(
        model=ModelConfig(**sections["model"]),
        cache=CacheConfig(**sections["cache"]),
        scheduler=SchedulerConfig(**sections["scheduler"]),
    )
    return config, doc
