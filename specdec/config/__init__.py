"""Engine configuration as validated dataclasses.

User mistakes raise ValueError with a message naming the field; `assert` only guards internal
invariants. The YAML `execution_config` schema maps onto these fields (see `load_yaml_config`).
"""
from specdec.config.engine import EngineConfig
from specdec.config.model import (
    AUTO_CPU_PRECISION,
    AUTO_DRAFT_PRECISION,
    COUPLINGS,
    DEFAULT_TARGET,
    KV_CACHE_DTYPES,
    PRECISION_CHOICES,
    PRECISIONS,
    CacheConfig,
    ModelConfig,
    SamplingConfig,
    SchedulerConfig,
    StructuredConfig,
    specdec_home,
    split_kv,
)
from specdec.config.server import CACHE_SCOPES, LOG_LEVELS, AutoscalingConfig, ServerConfig, ServingConfig
from specdec.config.speculative import (
    DEFAULT_K,
    DRAFT_REQUANTIZE,
    FLAT_SPEC_KEYS,
    SPEC_POLICIES,
    ControllerConfig,
    DraftConfig,
    NgramConfig,
    RouterConfig,
    SpeculativeConfig,
    SuffixConfig,
)
from specdec.config.yaml_file import load_yaml_config

__all__ = [
    "AUTO_CPU_PRECISION", "AUTO_DRAFT_PRECISION", "CACHE_SCOPES", "DEFAULT_K", "DEFAULT_TARGET", "DRAFT_REQUANTIZE",
    "FLAT_SPEC_KEYS", "KV_CACHE_DTYPES", "LOG_LEVELS",
    "PRECISIONS", "PRECISION_CHOICES", "SPEC_POLICIES", "AutoscalingConfig", "CacheConfig", "ControllerConfig",
    "DraftConfig", "EngineConfig", "ModelConfig", "NgramConfig", "RouterConfig", "SchedulerConfig", "ServerConfig",
    "ServingConfig", "SpeculativeConfig", "StructuredConfig", "SuffixConfig", "load_yaml_config", "specdec_home",
]
