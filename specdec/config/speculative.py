"""Speculation settings: the policy and one group per concern (ngram, suffix, draft, controller,
router), with the flat keys of earlier configs still accepted."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from specdec.config.model import PRECISIONS

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
    below min_prob; contexts matched up to max_depth tokens; finished outputs kept up to cache_tokens
    per cache scope (0: none; oldest out first), for at most max_scopes scopes (least recently used
    out first)."""
    max_tokens: int = 16
    spec_factor: float = 1.0
    spec_offset: float = 0.0
    min_prob: float = 0.1
    max_depth: int = 32
    cache_tokens: int = 100_000
    max_scopes: int = 64

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
        if self.max_scopes < 1:
            raise ValueError(f"suffix.max_scopes must be >= 1, got {self.max_scopes}")


DRAFT_REQUANTIZE = (None, "auto", "q4_1", "q4_64", "q3_64")  # None, "auto" and gguf_packed.REQUANT's keys


@dataclass
class DraftConfig:
    """Draft models (kinds draft_model and hybrid, and the router's extra ones)."""
    # the draft's precision (None: the target's). Losslessness never depends on the draft's numbers,
    # so a fast int4-a8 draft can serve an exact float32 target.
    precision: str | None = None
    # score only this many frequent tokens, and each request's own (None: all; "auto": 32,768 where
    # that cuts a tenth or more of a draft step's multiply-adds; speculation/proposers/subvocab.py)
    vocab_size: int | str | None = "auto"
    # int4 modes: the draft's matrices requantized at pack time, a cheaper draft step for a little
    # acceptance (models/gguf_packed.py): "q4_1" (the 8-bit-held Q5_0, Q8_0 to 4 bits per 32 values),
    # "q4_64" or "q3_64" (int4-a8 only: 4 or 3 bits per 64 values); None: the file's blocks; "auto":
    # q4_64 under int4-a8, q4_1 under the other int4 modes, where the file holds matrices they narrow
    requantize: str | None = "auto"
    extra_models: list[str] = field(default_factory=list)  # more draft models, loaded on first use
    idle_seconds: float | None = 600.0     # unload a lazily loaded draft idle this long (None: never)

    def __post_init__(self) -> None:
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ValueError(f"draft.precision must be one of {PRECISIONS} (or null: the target's), "
                             f"got {self.precision!r}")
        if self.vocab_size not in (None, "auto") and (type(self.vocab_size) is not int or self.vocab_size < 256):
            raise ValueError(f"draft.vocab_size must be >= 256, \"auto\" or null (the full vocabulary), "
                             f"got {self.vocab_size!r}")
        if self.requantize not in DRAFT_REQUANTIZE:
            raise ValueError(f"draft.requantize must be one of {DRAFT_REQUANTIZE[1:]} or null, got {self.requantize!r}")
        if not isinstance(self.extra_models, list) or not all(isinstance(d, str) and d for d in self.extra_models):
            raise ValueError("draft.extra_models must be a list of model names or paths")
        if self.idle_seconds is not None and self.idle_seconds <= 0:
            raise ValueError("draft.idle_seconds must be > 0 (or null: never unload)")


@dataclass
class ControllerConfig:
    """k per request (speculation/controller.py): the health check, probes and the cost model."""
    acceptance_threshold: float = 0.4      # health check: rolling acceptance below this -> plain decoding
    health_window: int = 8                 # drafting steps in the rolling window (more, to hold 2 drafts a step)
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


# k when none is given: the cost model picks each step's k up to its maximum from measured prices and
# acceptance, so a high ceiling costs nothing where drafts do not pay; a fixed k is paid every step
DEFAULT_K = {"cost_model": 8, "heuristic": 4, "fixed": 4}


@dataclass
class SpeculativeConfig:
    """How to speculate. `num_speculative_tokens` is k for `fixed` and the maximum k otherwise; each
    proposer kind and policy part reads its own group."""
    method: str = "draft_model"            # a proposer kind (speculation/registry.py): "draft_model", "ngram", ...
    draft_model: str | None = None         # registry name or path, for kinds that need a model
    num_speculative_tokens: int | None = None   # None: the policy's DEFAULT_K
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
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = DEFAULT_K[self.policy]
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
