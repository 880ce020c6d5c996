"""The HTTP server's settings, and how many engine replicas serve (Ray Serve)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
CACHE_SCOPES = ("shared", "api_key")


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
    # tenants' keys (beside api_key, the operator's: only it opens /admin); a file holds one per line
    api_keys: list[str] = field(default_factory=list)
    api_keys_file: str | None = None
    cache_scope: str = "shared"      # shared: requests share caches unless their cache_salt differs |
                                     # api_key: each key's requests share caches only among themselves
    suffix_cache_path: str | None = None  # the suffix cache is saved here on shutdown and loaded at start

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
        if not isinstance(self.api_keys, list) or any(not _is_key(k) for k in self.api_keys):
            raise ValueError("server.api_keys must be a list of non-empty keys without whitespace")
        if self.cache_scope not in CACHE_SCOPES:
            raise ValueError(f"server.cache_scope must be one of {CACHE_SCOPES}, got {self.cache_scope!r}")
        if self.cache_scope == "api_key" and not self.has_keys:
            raise ValueError("server.cache_scope: api_key needs API keys (server.api_key, api_keys or api_keys_file)")

    @property
    def has_keys(self) -> bool:
        return self.api_key is not None or bool(self.api_keys) or self.api_keys_file is not None

    def all_keys(self) -> list[str]:
        """api_key, api_keys and the keys file's (one per line; blank lines and # comments skipped).
        Raises ValueError naming the file and line of a bad one."""
        keys = ([self.api_key] if self.api_key is not None else []) + list(self.api_keys)
        if self.api_keys_file is None:
            return keys
        try:
            lines = Path(self.api_keys_file).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"server.api_keys_file: cannot read {self.api_keys_file}: {e}") from None
        for n, line in enumerate(lines, 1):
            line = line.strip()
            if line and not line.startswith("#"):
                if not _is_key(line):
                    raise ValueError(f"server.api_keys_file: {self.api_keys_file}:{n}: a key has no whitespace")
                keys.append(line)
        if not keys:
            raise ValueError(f"server.api_keys_file: {self.api_keys_file} holds no key")
        return keys


def _is_key(key: object) -> bool:
    return isinstance(key, str) and bool(key) and not any(c.isspace() for c in key)



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
    imbalance: int = 4                     # affinity spreads when its replica has this many more in flight
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
