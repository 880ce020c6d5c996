"""The YAML file `specdec serve --config` reads: `execution_config` and the other sections."""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

from specdec.catalog import default_draft
from specdec.config.engine import EngineConfig
from specdec.config.model import (DEFAULT_TARGET, CacheConfig, ModelConfig, SamplingConfig, SchedulerConfig,
                                  StructuredConfig)
from specdec.config.server import AutoscalingConfig, ServerConfig, ServingConfig
from specdec.config.speculative import FLAT_SPEC_KEYS, SpeculativeConfig


# YAML: execution_config keys -> (section, field)
_EXECUTION_KEYS = {
    "target_model": ("model", "model"),
    "precision": ("model", "precision"),
    "device": ("model", "device"),
    "max_model_len": ("model", "max_model_len"),
    "num_threads": ("model", "num_threads"),
    "chat_template": ("model", "chat_template"),
    "seed": ("model", "seed"),
    "huge_pages": ("model", "huge_pages"),
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
    `suffix_max_tokens` or `min_gain`), `server`, `serving` (replicas on Ray Serve) and
    `structured_outputs` (StructuredConfig: bounds on grammar work) and `sampling` (SamplingConfig:
    coupling) sections.

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
    doc = _take(doc, {"execution_config", "speculative", "server", "serving", "structured_outputs", "sampling"},
                "top level", path)
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
    structured = _take(doc.get("structured_outputs") or {}, {f.name for f in fields(StructuredConfig)},
                       "structured_outputs", path)
    sampling = _take(doc.get("sampling") or {}, {f.name for f in fields(SamplingConfig)}, "sampling", path)
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
                              scheduler=SchedulerConfig(**sections["scheduler"]), speculative=speculative,
                              structured=StructuredConfig(**structured), sampling=SamplingConfig(**sampling))
        return config, ServerConfig(**server), ServingConfig(**serving)
    except TypeError as e:  # a wrongly typed value deep inside a dataclass check
        raise ValueError(f"{path}: {e}") from e
