"""The model, cache, scheduler and structured-output settings, and the precision modes."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# float32: exact dequantization (the oracle); bfloat16: dense bf16; int4: the file's own blocks as packed
# int4/int8 codes with float32 activations (weight-only, near-lossless; see specdec/quant); int4-a16: the
# same weights with activations rounded to int16 per 256 values on K-quant matrices (integer dot
# products, near-lossless); int4-a8: activations rounded to int8 (llama.cpp's scheme, the fastest on
# CPUs, lossy)
PRECISIONS = ("float32", "bfloat16", "int4", "int4-a16", "int4-a8")
AUTO_CPU_PRECISION = "int4-a16"    # `auto` where the CPU kernel builds and the model has no `specdec kld` verdict
AUTO_DRAFT_PRECISION = "int4-a8"   # a draft model's where `auto` picked an int4 mode for the target, unless set
PRECISION_CHOICES = ("auto", *PRECISIONS)
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"


def specdec_home() -> Path:
    """Root of the model and weight caches ($SPECDEC_HOME, default ~/.cache/specdec)."""
    return Path(os.environ.get("SPECDEC_HOME", Path.home() / ".cache" / "specdec"))


@dataclass
class ModelConfig:
    model: str = DEFAULT_TARGET  # registry name, a .gguf path, or a Hugging Face-style folder
    precision: str = "auto"      # auto: the fastest mode meeting the precision criterion; float32: the exact oracle
    device: str = "cpu"
    max_model_len: int | None = None  # None: the model's own context length
    num_threads: int | None = None    # intra-op threads; None: chosen per forward by measurement (runner/threads.py)
    chat_template: str | None = None  # a Jinja chat template (file path or the template text); None: the model's
    seed: int | None = None           # seeds the randomness of requests that carry no seed of their own
    huge_pages: bool = True           # int4 weights copied into transparent huge pages (models/huge_pages.py)

    def __post_init__(self) -> None:
        if self.precision not in PRECISION_CHOICES:
            raise ValueError(f"precision must be one of {PRECISION_CHOICES}, got {self.precision!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")


# auto: the smallest format `specdec kld` measured as close to float32 as llama.cpp (whose default K/V is
# float16) in the model's precision mode, else the model's dtype; float16 halves the cache's memory, int8
# (codes and a scale per token and KV head) nearly quarters it
KV_CACHE_DTYPES = ("auto", "float32", "float16", "int8")


def split_kv(setting: str) -> tuple[str, str]:
    """A benchmarked setting with its K/V cache format last: 'int4-a8:kv=float16' -> ('int4-a8', 'float16');
    without one, (setting, 'auto'). The format is checked where it is used (CacheConfig)."""
    rest, found, kv = setting.partition(":kv=")
    return rest, kv if found else "auto"


@dataclass
class CacheConfig:
    block_size: int = 16
    target_cache_blocks: int = 1024   # KV blocks of the target pool (block_size tokens each)
    draft_cache_blocks: int = 1024    # KV blocks of each draft's pool
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"      # KV_CACHE_DTYPES

    def __post_init__(self) -> None:
        for name in ("block_size", "target_cache_blocks", "draft_cache_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"cache_config.{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"cache_config.kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 512  # token budget of one step (prefill chunks + decode tokens)
    max_batch_size: int = 32           # running requests
    long_prefill_token_threshold: int = 0  # >0: cap on one request's prefill chunk per step
    max_queued_requests: int = 256    # waiting requests; one more is refused (HTTP 429)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")


COUPLINGS = ("gumbel", "rejection")


@dataclass
class SamplingConfig:
    """How speculation verifies sampled tokens (YAML `sampling`). gumbel: the target's token at each
    position is the Gumbel-max of its distribution with noise fixed by (seed, choice, position), and a
    draft is kept when it equals it, so a seed fixes the text whatever the drafts (sample/coupling.py).
    rejection: Leviathan et al.'s rejection sampling, the same distribution, one random stream per
    request (a seed fixes the distribution, not the text, under adaptive k)."""
    coupling: str = "gumbel"

    def __post_init__(self) -> None:
        if self.coupling not in COUPLINGS:
            raise ValueError(f"sampling.coupling must be one of {', '.join(COUPLINGS)}, got {self.coupling!r}")


@dataclass
class StructuredConfig:
    """Bounds on the grammar work of structured outputs (YAML `structured_outputs`): llguidance's parser
    limits (its defaults) plus wall-clock bounds, so a hostile schema, regex or grammar is refused
    naming the bound (a 400) or ends only its own request, and cannot stall the server."""
    compile_timeout_s: float = 10.0      # compiling and checking one grammar; longer: refused
    mask_timeout_ms: float = 500.0       # one token mask; longer: refused at compile, or ends its request
    max_concurrent_compiles: int = 2     # grammars compiling at once (one more: 503, retry); a core each
    max_items_in_row: int = 2000         # Earley items in one parser row (ambiguity, wide alternations)
    initial_lexer_fuel: int = 1_000_000  # work building the lexer's regexes (about 50k per ms)
    step_lexer_fuel: int = 200_000       # lexer work in one token mask (about 14k per ms)
    step_max_items: int = 50_000         # Earley items in one token mask (about 20k per ms)
    max_lexer_states: int = 250_000      # lexer states one request may build (1-2 kB each)
    max_grammar_size: int = 500_000      # symbols in the grammar's productions

    def __post_init__(self) -> None:
        for name in ("compile_timeout_s", "mask_timeout_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"structured_outputs.{name} must be a number > 0, got {value!r}")
        for name in ("max_items_in_row", "initial_lexer_fuel", "step_lexer_fuel", "step_max_items",
                     "max_lexer_states", "max_grammar_size", "max_concurrent_compiles"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"structured_outputs.{name} must be an integer >= 1, got {value!r}")

    def parser_limits(self) -> dict[str, int | bool]:
        """The keyword arguments of llguidance's LLParserLimits."""
        names = ("max_items_in_row", "initial_lexer_fuel", "step_lexer_fuel", "step_max_items",
                 "max_lexer_states", "max_grammar_size")
        # errors go back to clients and into logs: without llguidance's parser-state dumps
        return {**{name: getattr(self, name) for name in names}, "verbose_errors": False}
