"""specdec: a speculative-decoding LLM inference engine on PyTorch."""
from specdec.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from specdec.llm import LLM
from specdec.request import RequestOutput, RequestStats
from specdec.sampling_params import SamplingParams, StructuredOutput

__all__ = ["LLM", "SamplingParams", "StructuredOutput", "RequestOutput", "RequestStats", "EngineConfig", "ModelConfig",
           "CacheConfig", "SchedulerConfig", "SpeculativeConfig"]
__version__ = "0.1.0"
