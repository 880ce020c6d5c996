"""The benchmarks on tiny models: they run end to end, write JSON and PNG, and check losslessness;
the shipped prompt sets have the promised shape."""
from __future__ import annotations

import json

import pytest

from specdec.bench.contention import Contention
from specdec.bench.spec_bench import PROMPTS_DIR, SETS
from specdec.cli import main


@pytest.mark.parametrize("name", SETS)
def test_prompt_sets(name):
    rows = [json.loads(line) for line in (PROMPTS_DIR / f"{name}.jsonl").read_text().splitlines() if line.strip()]
    assert len(rows) >= 20
    assert all(isinstance(r["prompt"], str) and r["prompt"] and r["domain"] and r["source"] for r in rows)


def test_spec_bench_writes_json_and_plot(tiny_qwen, tiny_llama, tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    assert main(["bench", "--model", str(tiny_qwen), "--draft", str(tiny_llama), "--sets", "code_gen,chat",
                 "--num-prompts", "1", "--repeats", "2", "--max-tokens", "6", "-k", "3", "--threads", "1",
                 "--arms", "plain,draft_fixed,draft_cost_model,ngram", "--out", str(out), "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    assert len(report["runs"]) == 2 * 2 * 4
    for s in ("code_gen", "chat"):
        for arm in ("draft_fixed", "draft_cost_model", "ngram"):
            e = report["summary"][s][arm]
            assert e["identical_to_plain"] is True and e["speedup"]["min"] <= e["speedup"]["median"]
    assert all(r["competing_cores"] is not None and r["competing_cores"] >= 0 for r in report["runs"])
    assert png.stat().st_size > 1000


def test_contention_counts_other_processes_only(monkeypatch):
    import specdec.bench.contention as c
    busy = iter([100.0, 103.0])   # machine-wide busy CPU seconds at enter / exit
    own = iter([5.0, 6.0])        # this process's CPU seconds
    wall = iter([0.0, 2.0])
    monkeypatch.setattr(c, "_busy_seconds", lambda: next(busy))
    monkeypatch.setattr(c.time, "process_time", lambda: next(own))
    monkeypatch.setattr(c.time, "perf_counter", lambda: next(wall))
    with c.Contention() as run:
        pass
    assert run.cores == 1.0 and run.noisy  # (3 - 1) CPU seconds by others over 2 s
