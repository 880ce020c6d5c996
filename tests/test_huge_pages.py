"""Weights in transparent huge pages (models/huge_pages.py): the same values and results, every tensor
in one advised arena, the setting carried from the config, the CLI and YAML to the loader."""
from __future__ import annotations

import mmap

import pytest
import torch

from test_quant import LAYERS
from specdec.commands.generate import engine_config
from specdec.config import ModelConfig
from specdec.models import huge_pages
from specdec.models.loader import load_model
from specdec.quant.packed import QuantLinear


def _weights() -> dict[str, object]:
    shared = torch.randn(7, 64)
    return {"embed": shared, "lm_head": shared, "norm": torch.randn(64),
            "q4k": QuantLinear([LAYERS["Q4_K"], LAYERS["Q6_K"]], 8),
            "mixed": QuantLinear([LAYERS["Q8_0"], torch.randn(3, 512)], 8)}


def _pointers(weights: dict[str, object]) -> list[int]:
    return [t.data_ptr() for t in huge_pages._tensors(weights)]


@pytest.mark.skipif(not huge_pages.available(), reason="no transparent huge pages on this machine")
def test_weights_move_into_one_huge_page_arena_with_the_same_values_and_results():
    weights = _weights()
    moved = huge_pages.into_huge_pages(weights)
    before, after = huge_pages._tensors(weights), huge_pages._tensors(moved)
    assert len(before) == len(after) > 10    # codes, scales, minimums, integer scales, dense parts
    for a, b in zip(before, after):
        assert a.data_ptr() != b.data_ptr() and a.dtype == b.dtype and torch.equal(a, b)
    ptrs = sorted(_pointers(moved))
    assert all(p % huge_pages.ALIGN == 0 for p in ptrs)
    assert ptrs[-1] - ptrs[0] < 64 << 20   # one region, advised once
    assert moved["embed"].data_ptr() == moved["lm_head"].data_ptr()   # a tied table stays one tensor
    x = torch.randn(5, 512)
    for name in ("q4k", "mixed"):
        assert torch.equal(moved[name](x), weights[name](x))


def test_without_huge_pages_the_weights_stay_where_they_are(monkeypatch, tmp_path):
    never = tmp_path / "enabled"
    never.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "THP_ENABLED", never)
    assert not huge_pages.available()
    weights = _weights()
    assert huge_pages.into_huge_pages(weights) is weights


def test_the_arena_starts_on_a_huge_page_and_is_advised(monkeypatch):
    advised = []
    real = mmap.mmap

    class Spy(real):
        def madvise(self, option, *args):
            advised.append(option)
            return super().madvise(option, *args)

    monkeypatch.setattr(huge_pages.mmap, "mmap", Spy)
    arena = huge_pages.arena(3 * 4096)
    assert arena.data_ptr() % huge_pages.HUGE_PAGE == 0 and arena.numel() == 3 * 4096
    assert advised == [mmap.MADV_HUGEPAGE]


def test_the_setting_reaches_the_loader_from_flags_yaml_and_config(tiny_kquant, tmp_path):
    from specdec.cli import build_parser
    from specdec.commands.serve import _model_config
    from specdec.config.yaml_file import load_yaml_config
    assert ModelConfig().huge_pages is True
    cfg = tmp_path / "c.yaml"
    cfg.write_text("execution_config:\n  target_model: m.gguf\n  huge_pages: false\n")
    assert load_yaml_config(cfg)[0].model.huge_pages is False
    a = build_parser().parse_args(["generate", "--no-huge-pages", "x"])
    assert engine_config(a, None).model.huge_pages is False
    a = build_parser().parse_args(["generate", "x"])
    assert engine_config(a, None).model.huge_pages is True
    assert _model_config(build_parser().parse_args(["serve", "--no-huge-pages"]), ModelConfig()).huge_pages is False
    assert _model_config(build_parser().parse_args(["serve"]), ModelConfig()).huge_pages is True
    mapped = load_model(str(tiny_kquant), "int4-a8", progress=False, huge_pages=False)
    copied = load_model(str(tiny_kquant), "int4-a8", progress=False)
    same = [torch.equal(a, b) for a, b in zip(huge_pages._tensors(mapped.weights), huge_pages._tensors(copied.weights))]
    assert same and all(same)
    moved = set(_pointers(copied.weights)).isdisjoint(_pointers(mapped.weights))
    assert moved == huge_pages.available()
