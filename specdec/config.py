"""Engine configuration as validated dataclasses.

User mistakes raise ValueError with a message naming the field; `assert` only guards internal
invariants. The YAML `execution_config` schema maps onto these fields (see `load_yaml_config`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from specdec.catalog import default_draft

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
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


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

    def __post_init__(self) -> None:
        if self.precision not in PRECISION_CHOICES:
            raise ValueError(f"precision must be one of {PRECISION_CHOICES}, got {self.precision!r}")
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


SPEC_POLICIES = ("cost_model", "heuristic", "fixed")


@dataclass
class NgramConfig:
    """Prompt lookup (kind ngram): the request's last n tokens matched for n from max_n down to min_n."""
    max_n: int = 4
    min_n: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need 1 <= ngram.min_n <= ngram.max_n, got {self.min_n} and {self.max_n}")


@dataclass
class SuffixConfig:
    """Suffix lookup (kinds suffix and hybrid): drafts up to max_tokens, no longer than spec_factor *
    match length + spec_offset, stopping where the estimated probability of the draft so far falls
    below min_prob; contexts matched up to max_depth tokens; finished outputs kept for every request
    up to cache_tokens (0: none; oldest out first)."""
    max_tokens: int = 16
    spec_factor: float = 1.0
    spec_offset: float = 0.0
    min_prob: float = 0.1
    max_depth: int = 32
    cache_tokens: int = 100_000

    def __post_init__(self) -> None:
        if not 1 <= self.max_tokens <= 32:
            raise ValueError(f"suffix.max_tokens must be in [1, 32], got {self.max_tokens}")
        if self.spec_factor <= 0:
            raise ValueError(f"suffix.spec_factor must be > 0, got {self.spec_factor}")
        if self.spec_offset < 0:
            raise ValueError(f"suffix.spec_offset must be >= 0, got {self.spec_offset}")
        if not 0.0 <= self.min_prob <= 1.0:
            raise ValueError(f"suffix.min_prob must be in [0, 1], got {self.min_prob}")
        if self.max_depth < 1:
            raise ValueError(f"suffix.max_depth must be >= 1, got {self.max_depth}")
        if self.cache_tokens < 0:
            raise ValueError(f"suffix.cache_tokens must be >= 0, got {self.cache_tokens}")


@dataclass
class DraftConfig:
    """Draft models (kinds draft_model and hybrid, and the router's extra ones)."""
    # the draft's precision (None: the target's). Losslessness never depends on the draft's numbers,
    # so a fast int4-a8 draft can serve an exact float32 target.
    precision: str | None = None
    vocab_size: int | None = None          # score only this many frequent tokens (None: all)
    extra_models: list[str] = field(default_factory=list)  # more draft models, loaded on first use
    idle_seconds: float | None = 600.0     # unload a lazily loaded draft idle this long (None: never)

    def __post_init__(self) -> None:
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ValueError(f"draft.precision must be one of {PRECISIONS} (or null: the target's), "
                             f"got {self.precision!r}")
        if self.vocab_size is not None and self.vocab_size < 256:
            raise ValueError(f"draft.vocab_size must be >= 256 (or null for the full vocabulary), "
                             f"got {self.vocab_size}")
        if not isinstance(self.extra_models, list) or not all(isinstance(d, str) and d for d in self.extra_models):
            raise ValueError("draft.extra_models must be a list of model names or paths")
        if self.idle_seconds is not None and self.idle_seconds <= 0:
            raise ValueError("draft.idle_seconds must be > 0 (or null: never unload)")


@dataclass
class ControllerConfig:
    """k per request (speculation/controller.py): the health check, probes and the cost model."""
    acceptance_threshold: float = 0.4      # health check: rolling acceptance below this -> plain decoding
    health_window: int = 8                 # drafting steps in the rolling window
    reprobe_interval: int = 16             # plain steps between re-probes after a fallback
    reprobe_k: int = 2
    ema_alpha: float = 0.3                 # weight of the newest step's wall/predicted ratio in its EMA
    acceptance_decay: float = 0.85         # per-request acceptance counts: weight kept per observation
    prior_strength: float = 2.0            # pseudo-observations of the engine-wide acceptance prior
    deterministic: bool = False            # cost model decides from acceptance counts and static costs only
    draft_cost_ratio: float = 0.4          # static t_draft / t_target (deterministic mode, and the prior)
    verify_cost_slope: float = 0.05        # static extra cost of each scored token beyond one
    prefill_cost_ratio: float = 0.1        # static cost of one prompt token in a prefill, per target step
    min_gain: float = 0.03                 # cost model: speculate only when it predicts >= this saving per token
    plain_interval_after: int | None = None  # long-output guard: after this many tokens ...
    plain_interval_steps: int = 0            # ... this many plain steps between speculation rounds

    def __post_init__(self) -> None:
        if not 0.0 <= self.acceptance_threshold <= 1.0:
            raise ValueError("controller.acceptance_threshold must be in [0, 1]")
        if not 0.0 <= self.min_gain < 1.0:
            raise ValueError("controller.min_gain must be in [0, 1)")
        if not 0.0 < self.ema_alpha <= 1.0:
            raise ValueError("controller.ema_alpha must be in (0, 1]")
        if not 0.0 < self.acceptance_decay <= 1.0:
            raise ValueError("controller.acceptance_decay must be in (0, 1]")
        if self.prior_strength <= 0:
            raise ValueError("controller.prior_strength must be > 0")
        for name in ("draft_cost_ratio", "verify_cost_slope", "prefill_cost_ratio"):
            if getattr(self, name) < 0:
                raise ValueError(f"controller.{name} must be >= 0")
        for name in ("health_window", "reprobe_interval", "reprobe_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"controller.{name} must be >= 1")
        if self.plain_interval_after is not None and self.plain_interval_after < 0:
            raise ValueError("controller.plain_interval_after must be >= 0")
        if self.plain_interval_steps < 0:
            raise ValueError("controller.plain_interval_steps must be >= 0")


@dataclass
class RouterConfig:
    """A proposer per request, from the prompt's domain and the gain measured there (speculation/router.py)."""
    enabled: bool = False
    exploration: float = 0.2               # UCB bonus weight of the per-domain bandit

    def __post_init__(self) -> None:
        if self.exploration < 0:
            raise ValueError("router.exploration must be >= 0")


_SPEC_GROUPS: dict[str, type] = {"ngram": NgramConfig, "suffix": SuffixConfig, "draft": DraftConfig,
                                 "controller": ControllerConfig, "router": RouterConfig}
# the flat keys configs had before the groups (still accepted by SpeculativeConfig.from_dict) -> (group, field)
FLAT_SPEC_KEYS: dict[str, tuple[str, str]] = {
    "ngram_max": ("ngram", "max_n"), "ngram_min": ("ngram", "min_n"),
    **{f"suffix_{f.name}": ("suffix", f.name) for f in fields(SuffixConfig)},
    "draft_precision": ("draft", "precision"), "draft_vocab_size": ("draft", "vocab_size"),
    "extra_drafts": ("draft", "extra_models"), "draft_idle_seconds": ("draft", "idle_seconds"),
    **{f.name: ("controller", f.name) for f in fields(ControllerConfig)},
    "router": ("router", "enabled"), "router_exploration": ("router", "exploration"),
}


def _group(cls: type, values: Any, where: str) -> Any:
    """A group dataclass from a mapping, naming an unknown key."""
    if not isinstance(values, dict):
        raise ValueError(f"{where} must be a mapping")
    names = {f.name for f in fields(cls)}
    for key in values:
        if key not in names:
            raise ValueError(f"unknown key {where}.{key}")
    return cls(**values)


@dataclass
class SpeculativeConfig:
    """How to speculate. `num_speculative_tokens` is k for `fixed` and the maximum k otherwise; each
    proposer kind and policy part reads its own group."""
    method: str = "draft_model"            # a proposer kind (speculation/registry.py): "draft_model", "ngram", ...
    draft_model: str | None = None         # registry name or path, for kinds that need a model
    num_speculative_tokens: int = 4
    policy: str = "cost_model"             # "cost_model" | "heuristic" | "fixed"
    ngram: NgramConfig = field(default_factory=NgramConfig)
    suffix: SuffixConfig = field(default_factory=SuffixConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    router: RouterConfig = field(default_factory=RouterConfig)

    def __post_init__(self) -> None:
        for name, cls in _SPEC_GROUPS.items():  # a group may come as a mapping of its fields
            value = getattr(self, name)
            if not isinstance(value, cls):
                setattr(self, name, _group(cls, value, f"speculative.{name}"))
        # which kinds exist is the proposer registry's to say (checked when an engine is built)
        if not isinstance(self.method, str) or not self.method:
            raise ValueError(f"speculative method must be a proposer kind's name, got {self.method!r}")
        if self.policy not in SPEC_POLICIES:
            raise ValueError(f"speculative policy must be one of {SPEC_POLICIES}, got {self.policy!r}")
        if not 0 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [0, 16], got {self.num_speculative_tokens}")

    @classmethod
    def from_dict(cls, values: dict[str, Any], where: str = "speculative") -> SpeculativeConfig:
        """From top-level keys, groups as mappings ({"suffix": {"max_tokens": 8}}) and the flat keys
        of earlier configs ({"suffix_max_tokens": 8}, FLAT_SPEC_KEYS). Raises ValueError naming an
        unknown key, or a field set twice (flat and nested)."""
        top = {f.name for f in fields(cls)} - set(_SPEC_GROUPS)
        kwargs: dict[str, Any] = {}
        groups: dict[str, dict[str, Any]] = {name: {} for name in _SPEC_GROUPS}
        keys: dict[tuple[str, str], str] = {}   # (group, field) -> the key that set it
        for key, value in values.items():
            if key in _SPEC_GROUPS and isinstance(value, dict):
                items = [(key, name, v, f"{key}.{name}") for name, v in value.items()]
            elif key in FLAT_SPEC_KEYS:   # `router: true` is the flat key of router.enabled
                items = [(*FLAT_SPEC_KEYS[key], value, key)]
            elif key in top:
                kwargs[key] = value
                continue
            elif key in _SPEC_GROUPS:
                raise ValueError(f"{where}.{key} must be a mapping")
            else:
                raise ValueError(f"unknown key {where}.{key}")
            for group, name, v, given in items:
                if (group, name) in keys:
                    raise ValueError(f"{where}: {group}.{name} is set twice ({keys[group, name]} and {given})")
                keys[group, name], groups[group][name] = given, v
        return cls(**kwargs, **{g: _group(_SPEC_GROUPS[g], v, f"{where}.{g}") for g, v in groups.items()})


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None  # None: plain decoding


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"          # loopback unless told otherwise
    port: int = 8000
    api_key: str | None = None       # None: no auth (also read from $SPECDEC_API_KEY by the CLI)
    max_body_bytes: int = 1 << 20    # larger request bodies get 413
    max_n: int = 4                   # choices per request
    served_model_name: str | None = None  # the name /v1/models reports (default: the target's)
    shadow_fraction: float = 0.0     # shadow A/B: share of speculative requests also decoded plainly (0: off)
    shadow_similarity: bool = False  # ... and their texts compared by the similarity monitor (specdec[monitor])
    openapi: bool = True             # publish /openapi.json and /docs
    max_tokens_limit: int | None = None    # max_tokens of one choice (None: the context's room)
    max_request_tokens: int | None = None  # prompt + max_tokens over all choices of one request
    queue_timeout: float = 600.0     # a request that waits longer without starting gets 503
    drain_seconds: float = 30.0      # on SIGTERM / SIGINT: time in-flight requests get to finish
    retry_after: int = 5             # seconds, the Retry-After of 429 / 503 answers
    log_level: str = "info"          # critical | error | warning | info (one access-log line per request) | debug
    metrics_require_key: bool = False  # /metrics needs the API key too

    def __post_init__(self) -> None:
        for name in ("max_tokens_limit", "max_request_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"server.{name} must be >= 1 (or null for no limit)")
        if self.queue_timeout <= 0 or self.drain_seconds < 0 or self.retry_after < 0:
            raise ValueError("server.queue_timeout must be > 0, drain_seconds and retry_after >= 0")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"server.port must be in [0, 65535], got {self.port}")
        if self.max_body_bytes < 1024:
            raise ValueError("server.max_body_bytes must be >= 1024")
        if self.max_n < 1:
            raise ValueError("server.max_n must be >= 1")
        if not 0.0 <= self.shadow_fraction <= 1.0:
            raise ValueError(f"server.shadow_fraction must be in [0, 1], got {self.shadow_fraction}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("server.api_key must be non-empty (or null for no auth)")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"server.log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")



_ROUTINGS = ("affinity", "random", "least_loaded")


@dataclass
class AutoscalingConfig:
    """Ray Serve autoscaling of the engine replicas on their ongoing requests."""
    min_replicas: int = 1
    max_replicas: int = 2
    target_ongoing_requests: float = 2.0   # per replica: more scales up, fewer scales down
    upscale_delay_s: float = 10.0          # the load must hold this long before a replica is added
    downscale_delay_s: float = 60.0        # ... or is gone this long before one is removed

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError("serving.autoscaling needs 0 <= min_replicas <= max_replicas and max_replicas >= 1")
        if self.target_ongoing_requests <= 0 or self.upscale_delay_s < 0 or self.downscale_delay_s < 0:
            raise ValueError("serving.autoscaling: target_ongoing_requests must be > 0, the delays >= 0")


@dataclass
class ServingConfig:
    """How many engine replicas serve: one in this process (the default), or several on Ray Serve
    behind one ingress with the same API."""
    replicas: int = 1                      # > 1, autoscaling or a ray_address: engine replicas on Ray Serve
    autoscaling: AutoscalingConfig | None = None   # replaces `replicas` when set
    routing: str = "affinity"              # affinity (prefix cache, least-loaded fallback) | random | least_loaded
    imbalance: int = 4                     # affinity yields when its replica has this many more requests queued
    ray_address: str | None = None         # None: a local Ray instance started and stopped with the server
    cpus_per_replica: float = 1.0          # Ray CPUs each replica reserves (and its engine's threads)
    object_store_mb: int = 512             # a local instance's object store (requests are small)
    dashboard: bool = False                # a local instance's Ray dashboard

    def __post_init__(self) -> None:
        if isinstance(self.autoscaling, dict):
            self.autoscaling = AutoscalingConfig(**self.autoscaling)
        if self.replicas < 1:
            raise ValueError(f"serving.replicas must be >= 1, got {self.replicas}")
        if self.routing not in _ROUTINGS:
            raise ValueError(f"serving.routing must be one of {', '.join(_ROUTINGS)}, got {self.routing!r}")
        if self.imbalance < 0 or self.cpus_per_replica <= 0 or self.object_store_mb < 64:
            raise ValueError("serving: imbalance must be >= 0, cpus_per_replica > 0, object_store_mb >= 64")

    @property
    def on_ray(self) -> bool:
        return self.replicas > 1 or self.autoscaling is not None or self.ray_address is not None

    @property
    def max_replicas(self) -> int:
        return self.autoscaling.max_replicas if self.autoscaling is not None else self.replicas


# YAML: execution_config keys -> (section, field)
_EXECUTION_KEYS = {
    "target_model": ("model", "model"),
    "precision": ("model", "precision"),
    "device": ("model", "device"),
    "max_model_len": ("model", "max_model_len"),
    "num_threads": ("model", "num_threads"),
    "chat_template": ("model", "chat_template"),
    "seed": ("model", "seed"),
    "max_batch_size": ("scheduler", "max_batch_size"),
    "max_num_batched_tokens": ("scheduler", "max_num_batched_tokens"),
    "long_prefill_token_threshold": ("scheduler", "long_prefill_token_threshold"),
    "max_queued_requests": ("scheduler", "max_queued_requests"),
    "draft_model": ("spec", "draft_model"),
    "draft_precision": ("spec", "draft_precision"),   # a flat key of SpeculativeConfig.from_dict: draft.precision
    "speculation_length": ("spec", "num_speculative_tokens"),
}
_SPEC_FIXED = {"method", "draft_model", "num_speculative_tokens", "draft_precision"}  # set through execution_config


def _take(section: dict[str, Any], allowed: set[str], where: str, path: str | Path) -> dict[str, Any]:
    if not isinstance(section, dict):
        raise ValueError(f"{path}: {where} must be a mapping")
    for key in section:
        if key not in allowed:
            raise ValueError(f"{path}: unknown key {where}.{key}")
    return dict(section)


def load_yaml_config(path: str | Path) -> tuple[EngineConfig, ServerConfig, ServingConfig]:
    """Read a YAML config: `execution_config` (the schema: target_model, draft_model,
    speculation_length, max_batch_size, precision, cache_config.{draft,target}_cache_blocks, ...),
    plus optional `speculative` (the policy and SpeculativeConfig's groups: ngram, suffix, draft,
    controller, router; each as a mapping, or by the flat keys of earlier configs such as
    `suffix_max_tokens` or `min_gain`), `server` and `serving` (replicas on Ray Serve) sections.

    draft_model: a registry name or path (draft-model speculation), a model-free proposer kind
    ("ngram": prompt lookup, "suffix": suffix decoding), "hybrid" / "hybrid:MODEL" (suffix or that
    draft model, per step), or null / "none" (plain decoding). Unknown keys are an error naming the key.
    """
    import yaml

    try:
        with open(path) as f:
            doc = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: top level must be a mapping")
    doc = _take(doc, {"execution_config", "speculative", "server", "serving"}, "top level", path)
    exe = _take(doc.get("execution_config") or {}, set(_EXECUTION_KEYS) | {"cache_config"}, "execution_config", path)
    sections: dict[str, dict[str, Any]] = {"model": {}, "cache": {}, "scheduler": {}, "spec": {}}
    sections["cache"] = _take(exe.pop("cache_config", None) or {}, {f.name for f in fields(CacheConfig)},
                              "execution_config.cache_config", path)
    for key, value in exe.items():
        section, name = _EXECUTION_KEYS[key]
        sections[section][name] = value
    spec_knobs = _take(doc.get("speculative") or {},
                       ({f.name for f in fields(SpeculativeConfig)} | set(FLAT_SPEC_KEYS)) - _SPEC_FIXED,
                       "speculative", path)
    server = _take(doc.get("server") or {}, {f.name for f in fields(ServerConfig)}, "server", path)
    serving = _take(doc.get("serving") or {}, {f.name for f in fields(ServingConfig)}, "serving", path)
    if serving.get("autoscaling") is not None:
        serving["autoscaling"] = _take(serving["autoscaling"], {f.name for f in fields(AutoscalingConfig)},
                                       "serving.autoscaling", path)
    spec = sections["spec"]
    draft = spec.get("draft_model", "default")
    if draft == "default":  # as the CLI: the registry's draft for a registry target, else n-gram
        draft = default_draft(sections["model"].get("model", DEFAULT_TARGET)) or "ngram"
    speculative = None
    if draft not in (None, "none"):
        if not isinstance(draft, str):
            raise ValueError(f"{path}: execution_config.draft_model must be a string or null")
        # a model-free kind's name here ("ngram") is resolved by the proposer registry (registry.resolve_config)
        try:
            speculative = SpeculativeConfig.from_dict({**spec, "draft_model": draft, **spec_knobs})
        except (TypeError, ValueError) as e:  # TypeError: a wrongly typed value deep inside a dataclass check
            raise ValueError(f"{path}: {e}") from e
    try:
        config = EngineConfig(model=ModelConfig(**sections["model"]), cache=CacheConfig(**sections["cache"]),
                              scheduler=SchedulerConfig(**sections["scheduler"]), speculative=speculative)
        return config, ServerConfig(**server), ServingConfig(**serving)
    except TypeError as e:  # a wrongly typed value deep inside a dataclass check
        raise ValueError(f"{path}: {e}") from e
