"""`--speculative-config JSON`: vLLM's speculative_config, mapped onto our SpeculativeConfig.

vLLM users pass e.g. '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}'.
The methods we have (ngram, draft_model, suffix, and our own kinds such as hybrid) map one to one;
vLLM's trained-head methods (EAGLE, Medusa, MTP, ...) are refused by name, and so is any key we do
not map, so a config never silently means less than it says.
"""
from __future__ import annotations

import json
from typing import Any

from specdec.catalog import default_draft
from specdec.config import NgramConfig, SpeculativeConfig, SuffixConfig
from specdec.speculation import registry

FLAG = "--speculative-config"
# vLLM's methods that need heads trained for the target: nothing here can run them
UNSUPPORTED_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "deepseek_mtp", "ernie_mtp",
                       "qwen3_next_mtp", "glm4_moe_mtp", "longcat_flash_mtp", "mimo_mtp", "ngram_gpu")
# vLLM key -> (our group, field); a group of None is a top-level SpeculativeConfig field
KEYS: dict[str, tuple[str | None, str]] = {
    "num_speculative_tokens": (None, "num_speculative_tokens"),
    "model": (None, "draft_model"),
    "prompt_lookup_max": ("ngram", "max_n"),
    "prompt_lookup_min": ("ngram", "min_n"),
    "suffix_decoding_max_tree_depth": ("suffix", "max_depth"),
    "suffix_decoding_max_spec_factor": ("suffix", "spec_factor"),
    "suffix_decoding_min_token_prob": ("suffix", "min_prob"),
}


def parse(text: str, target: str, policy: str | None = None) -> SpeculativeConfig:
    """The SpeculativeConfig of vLLM's JSON `text` for the target model `target`, under `policy`
    (None: the default; it decides k where the JSON gives none). Raises ValueError
    (one line, naming the flag and the key) for bad JSON, an unsupported method or an unknown key."""
    try:
        values = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{FLAG}: not JSON: {e}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{FLAG}: expected a JSON object such as "
                         '\'{"method": "ngram", "num_speculative_tokens": 4}\'')
    values = dict(values)
    method = _method(values.pop("method", None), values.get("model"))
    _check_tensor_parallel(values.pop("draft_tensor_parallel_size", 1))
    unknown = sorted(set(values) - set(KEYS))
    if unknown:
        raise ValueError(f"{FLAG}: unknown or unsupported key{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(unknown)} (supported: method, draft_tensor_parallel_size, {', '.join(KEYS)})")
    top: dict[str, Any] = {"method": method, **({"policy": policy} if policy else {})}
    groups: dict[str, dict[str, Any]] = {"ngram": {}, "suffix": {}}
    for key, value in values.items():
        group, name = KEYS[key]
        (top if group is None else groups[group])[name] = value
    _draft_model(top, target)
    ngram = groups["ngram"]
    if "min_n" in ngram and "max_n" not in ngram:  # as vLLM: a lone minimum above our default maximum raises both
        ngram["max_n"] = max(ngram["min_n"], NgramConfig.max_n)
    try:
        return SpeculativeConfig(**top, ngram=NgramConfig(**ngram), suffix=SuffixConfig(**groups["suffix"]))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{FLAG}: {e}") from None


def _method(method: Any, model: Any) -> str:
    """Our proposer kind for vLLM's method (vLLM infers draft_model from a model alone)."""
    if method is None:
        if model is None:
            raise ValueError(f'{FLAG}: give "method" (ngram, draft_model, suffix, ...) or a draft "model"')
        return "draft_model"
    if not isinstance(method, str):
        raise ValueError(f'{FLAG}: "method" must be a string, got {method!r}')
    if method in UNSUPPORTED_METHODS:
        raise ValueError(f"{FLAG}: method {method!r} needs heads trained for the target; specdec does not support "
                         f"it (supported: {', '.join(registry.kinds())})")
    if method not in registry.kinds():
        raise ValueError(f"{FLAG}: unknown method {method!r} (supported: {', '.join(registry.kinds())})")
    return method


def _check_tensor_parallel(size: Any) -> None:
    if size != 1:
        raise ValueError(f"{FLAG}: draft_tensor_parallel_size must be 1 (specdec runs the draft in one process), "
                         f"got {size!r}")


def _draft_model(top: dict[str, Any], target: str) -> None:
    """A model for the kinds that need one (the registry's default draft when none is named); none
    for the kinds that use none."""
    needs_model = registry.get(top["method"]).needs_model
    if not needs_model and top.get("draft_model") is not None:
        raise ValueError(f'{FLAG}: method {top["method"]!r} uses no model, but "model" names one')
    if needs_model and top.get("draft_model") is None:
        top["draft_model"] = default_draft(target)
        if top["draft_model"] is None:
            raise ValueError(f'{FLAG}: {target} has no default draft model; name one with "model"')
