"""SpeculativeConfig's groups: built from nested mappings or the flat keys of earlier configs (YAML
files and Python alike), validated with one ValueError naming the key."""
from __future__ import annotations

from dataclasses import replace

import pytest

from specdec.config import (FLAT_SPEC_KEYS, ControllerConfig, DraftConfig, NgramConfig, RouterConfig, SpeculativeConfig,
                            SuffixConfig, load_yaml_config)

FLAT = {"policy": "fixed", "ngram_max": 5, "ngram_min": 2, "suffix_max_tokens": 8, "suffix_min_prob": 0.2,
        "suffix_spec_factor": 2.0, "suffix_cache_tokens": 10, "acceptance_threshold": 0.3, "health_window": 4,
        "reprobe_interval": 5, "reprobe_k": 1, "min_gain": 0.05, "draft_cost_ratio": 0.2, "deterministic": True,
        "router": True, "router_exploration": 0.5, "extra_drafts": ["x.gguf"], "draft_idle_seconds": 30,
        "draft_vocab_size": 4096}
NESTED = SpeculativeConfig(
    policy="fixed", ngram=NgramConfig(max_n=5, min_n=2),
    suffix=SuffixConfig(max_tokens=8, min_prob=0.2, spec_factor=2.0, cache_tokens=10),
    controller=ControllerConfig(acceptance_threshold=0.3, health_window=4, reprobe_interval=5, reprobe_k=1,
                                min_gain=0.05, draft_cost_ratio=0.2, deterministic=True),
    router=RouterConfig(enabled=True, exploration=0.5),
    draft=DraftConfig(extra_models=["x.gguf"], idle_seconds=30, vocab_size=4096))


def test_flat_and_nested_keys_build_the_same_config():
    assert SpeculativeConfig.from_dict(FLAT) == NESTED
    nested = {"policy": "fixed", "ngram": {"max_n": 5, "min_n": 2},
              "suffix": {"max_tokens": 8, "min_prob": 0.2, "spec_factor": 2.0, "cache_tokens": 10},
              "controller": {"acceptance_threshold": 0.3, "health_window": 4, "reprobe_interval": 5, "reprobe_k": 1,
                             "min_gain": 0.05, "draft_cost_ratio": 0.2, "deterministic": True},
              "router": {"enabled": True, "exploration": 0.5},
              "draft": {"extra_models": ["x.gguf"], "idle_seconds": 30, "vocab_size": 4096}}
    assert SpeculativeConfig.from_dict(nested) == NESTED
    assert SpeculativeConfig(**nested) == NESTED                 # groups may come as mappings
    # every flat key names a real field
    for group, name in FLAT_SPEC_KEYS.values():
        assert hasattr(getattr(SpeculativeConfig(), group), name)


def test_yaml_accepts_the_flat_keys_and_the_groups(tmp_path):
    flat = tmp_path / "flat.yaml"
    flat.write_text("execution_config:\n  draft_model: ngram\n  draft_precision: int4\nspeculative:\n"
                    + "".join(f"  {k}: {v}\n" for k, v in FLAT.items()))
    nested = tmp_path / "nested.yaml"
    nested.write_text("execution_config:\n  draft_model: ngram\n  draft_precision: int4\nspeculative:\n"
                      "  policy: fixed\n  ngram: {max_n: 5, min_n: 2}\n"
                      "  suffix: {max_tokens: 8, min_prob: 0.2, spec_factor: 2.0, cache_tokens: 10}\n"
                      "  controller: {acceptance_threshold: 0.3, health_window: 4, reprobe_interval: 5,\n"
                      "               reprobe_k: 1, min_gain: 0.05, draft_cost_ratio: 0.2, deterministic: true}\n"
                      "  router: {enabled: true, exploration: 0.5}\n"
                      "  draft: {extra_models: [x.gguf], idle_seconds: 30, vocab_size: 4096}\n")
    expected = replace(NESTED, draft_model="ngram", draft=replace(NESTED.draft, precision="int4"))
    assert load_yaml_config(flat)[0].speculative == expected == load_yaml_config(nested)[0].speculative


@pytest.mark.parametrize("text, needle", [
    ("speculative:\n  suffix_min_prob: 1.5\n", r"suffix\.min_prob must be in \[0, 1\]"),
    ("speculative:\n  suffix:\n    min_prob: 1.5\n", r"suffix\.min_prob must be in \[0, 1\]"),
    ("speculative:\n  suffix:\n    bogus: 1\n", r"unknown key speculative\.suffix\.bogus"),
    ("speculative:\n  suffix_bogus: 1\n", r"unknown key speculative\.suffix_bogus"),
    ("speculative:\n  suffix: 3\n", r"speculative\.suffix must be a mapping"),
    ("speculative:\n  min_gain: 0.1\n  controller:\n    min_gain: 0.2\n",
     r"controller\.min_gain is set twice \(min_gain and controller\.min_gain\)"),
    ("execution_config:\n  draft_precision: int4\nspeculative:\n  draft:\n    precision: int4\n",
     r"draft\.precision is set twice"),
    ("speculative:\n  router_exploration: -1\n", r"router\.exploration must be >= 0"),
    ("speculative:\n  ngram_min: 3\n  ngram_max: 2\n", r"ngram\.min_n <= ngram\.max_n"),
    ("speculative:\n  num_speculative_tokens: 3\n", r"unknown key speculative\.num_speculative_tokens"),
])
def test_yaml_errors_name_the_key(tmp_path, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text("execution_config:\n  draft_model: ngram\n" + text if "execution_config" not in text else text)
    with pytest.raises(ValueError, match=needle):
        load_yaml_config(path)


def test_groups_validate_their_fields():
    for make, needle in ((lambda: ControllerConfig(min_gain=1.0), r"controller\.min_gain"),
                         (lambda: ControllerConfig(reprobe_k=0), r"controller\.reprobe_k"),
                         (lambda: ControllerConfig(draft_cost_ratio=-0.1), r"controller\.draft_cost_ratio"),
                         (lambda: DraftConfig(precision="fp8"), r"draft\.precision"),
                         (lambda: DraftConfig(extra_models="x"), r"draft\.extra_models"),
                         (lambda: DraftConfig(requantize="q2_k"), r"draft\.requantize"),
                         (lambda: SuffixConfig(max_tokens=64), r"suffix\.max_tokens"),
                         (lambda: SpeculativeConfig(controller={"min_gian": 0.1}),
                          r"unknown key speculative\.controller\.min_gian")):
        with pytest.raises(ValueError, match=needle):
            make()
