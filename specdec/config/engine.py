"""EngineConfig: everything one engine is built from."""
from __future__ import annotations

from dataclasses import dataclass, field

from specdec.config.model import CacheConfig, ModelConfig, SamplingConfig, SchedulerConfig, StructuredConfig
from specdec.config.speculative import SpeculativeConfig


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None  # None: plain decoding
    structured: StructuredConfig = field(default_factory=StructuredConfig)  # bounds on grammar work
    sampling: SamplingConfig = field(default_factory=SamplingConfig)        # how sampled drafts are verified
