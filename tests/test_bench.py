"""The benchmarks on tiny models: they run end to end, write JSON and PNG, and check losslessness;
the shipped prompt sets have the promised shape."""
from __future__ import annotations

import json

import pytest
import torch

from specdec.cli import main
from specdec.contention import Contention
from specdec.prompts import PROMPTS_DIR, SETS


@pytest.mark.parametrize("name", SETS)
def test_prompt_sets(name):
    rows = [json.loads(line) for line in (PROMPTS_DIR / f"{name}.jsonl").read_text().splitlines() if line.strip()]
    assert len(rows) >= 20
    assert all(isinstance(r["prompt"], str) and r["prompt"] and r["domain"] and r["source"] for r in rows)


def test_spec_bench_writes_json_and_plot(tiny_qwen, tiny_llama, tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    assert main(["bench", "--model", str(tiny_qwen), "--draft", str(tiny_llama), "--sets", "code_gen,chat",
                 "--num-prompts", "1", "--repeats", "2", "--max-tokens", "6", "-k", "3", "--threads", "1",
                 "--arms", "plain,draft_fixed,draft_file_fixed,draft_cost_model,ngram", "--out", str(out),
                 "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    assert len(report["runs"]) == 2 * 2 * 5
    for s in ("code_gen", "chat"):
        for arm in ("draft_fixed", "draft_file_fixed", "draft_cost_model", "ngram"):
            e = report["summary"][s][arm]
            assert e["identical_to_plain"] is True and e["speedup"]["min"] <= e["speedup"]["median"]
    assert all(r["competing_cores"] is not None and r["competing_cores"] >= 0 for r in report["runs"])
    assert png.stat().st_size > 1000


def test_spec_bench_draft_arms_pack_and_score_as_named():
    """The default's autos, the file's draft, and the 4-bit and sub-vocabulary variants of the file's."""
    from specdec.bench import spec_bench as sb
    sub = sb.SUBVOCAB_SIZE
    expect = {"draft_cost_model": ("auto", "auto"), "hybrid": ("auto", "auto"), "draft_file_fixed": (None, None),
              "draft_q4_fixed": ("q4_1", None), "draft_subvocab_fixed": (None, sub),
              "draft_q4_subvocab_fixed": ("q4_1", sub)}
    assert {arm: (sb._requant(arm), sb._vocab(arm)) for arm in expect} == expect


def test_contention_counts_other_processes_only(monkeypatch):
    import specdec.contention as c
    busy = iter([100.0, 103.0])   # machine-wide busy CPU seconds at enter / exit
    own = iter([5.0, 6.0])        # this process's CPU seconds
    wall = iter([0.0, 2.0])
    monkeypatch.setattr(c, "_busy_seconds", lambda: next(busy))
    monkeypatch.setattr(c.time, "process_time", lambda: next(own))
    monkeypatch.setattr(c.time, "perf_counter", lambda: next(wall))
    with c.Contention() as run:
        pass
    assert run.cores == 1.0 and run.noisy  # (3 - 1) CPU seconds by others over 2 s


def test_profile_drafts_writes_json_plot_and_a_recommendation(tiny_qwen, tiny_llama, tmp_path):
    out, png = tmp_path / "profile.json", tmp_path / "profile.png"
    assert main(["profile-drafts", "--model", str(tiny_qwen), "--drafts", f"{tiny_llama},ngram:1-3",
                 "--sets", "code_gen,prose", "--max-tokens", "8", "-k", "2",
                 "--out", str(out), "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    assert [r["proposer"] for r in report["proposers"]] == [str(tiny_llama), "ngram:1-3"]
    assert report["target_ms_per_token"] > 0
    for row in report["proposers"]:
        assert row["params"]["k"] == 2 and row["cost_ratio"] >= 0
        for s in ("code_gen", "prose"):
            d = row["domains"][s]
            assert 0 <= d["acceptance"] <= 1 and len(d["per_position_acceptance"]) == 2
            assert d["predicted_speedup"] > 0 and d["measured_speedup"] > 0
    names = {r["proposer"] for r in report["proposers"]} | {"plain"}
    for s, choice in report["recommendation"].items():
        assert choice in names
        best = max(report["proposers"], key=lambda r: r["domains"][s]["measured_speedup"])
        assert choice == (best["proposer"] if best["domains"][s]["measured_speedup"] > 1 else "plain")
    assert png.stat().st_size > 1000


def test_profile_drafts_prices_one_draft_in_each_packing(tiny_qwen, tiny_llama, tmp_path, capsys):
    """MODEL@FORMAT: the same draft packed two ways is two candidates, each recorded with its packing
    (q3_64: 3-bit codes per 64 values; none: the file's blocks); an unknown packing is refused."""
    out = tmp_path / "profile.json"
    assert main(["profile-drafts", "--model", str(tiny_qwen), "--precision", "int4-a8",
                 "--drafts", f"{tiny_llama}@q3_64,{tiny_llama}@none", "--sets", "code_gen", "--max-tokens", "6",
                 "-k", "2", "--out", str(out), "--plot", ""]) == 0
    rows = json.loads(out.read_text())["proposers"]
    assert [r["proposer"] for r in rows] == [f"{tiny_llama}@q3_64", f"{tiny_llama}@none"]
    assert [r["params"]["draft"]["requantize"] for r in rows] == ["q3_64", None]
    assert all(r["cost_ratio"] > 0 and 0 <= r["domains"]["code_gen"]["acceptance"] <= 1 for r in rows)
    assert main(["profile-drafts", "--model", str(tiny_qwen), "--drafts", f"{tiny_llama}@q2", "--out", str(out),
                 "--plot", ""]) != 0
    assert "its format must be one of none, auto, q4_1, q4_64, q3_64" in capsys.readouterr().err


def test_precision_bench_reports_agreement_and_logit_error(tiny_qwen, tmp_path):
    out, png = tmp_path / "precision.json", tmp_path / "precision.png"
    assert main(["bench", "precision", "--model", str(tiny_qwen), "--precisions", "int4,int4-a8",
                 "--sets", "code_gen,chat", "--num-prompts", "1", "--max-tokens", "6", "--threads", "1",
                 "--out", str(out), "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    assert set(report["summary"]) == {"float32", "int4", "int4-a8"} and len(report["prompts"]) == 2
    for m in ("int4", "int4-a8"):
        s = report["summary"][m]
        assert 0 <= s["match_rate"] <= 1 and 0 <= s["top1_agree"] <= 1
        assert 0 < s["mean_logit_err"] <= s["max_logit_err"] < 1  # same weights: summation order, rounded x
    # int4 keeps float32 activations: its error is far below int4-a8's
    assert report["summary"]["int4"]["max_logit_err"] < report["summary"]["int4-a8"]["max_logit_err"]
    assert png.stat().st_size > 1000


def test_threads_bench_times_every_kernel_thread_count_and_condition(tmp_path):
    from specdec.quant import kernel
    if not kernel.available():
        pytest.skip(kernel.unavailable_reason())
    out, png = tmp_path / "threads.json", tmp_path / "threads.png"
    assert main(["bench", "threads", "--shape", "96x64", "-k", "2", "--repeats", "1", "--calls", "2",
                 "--competitors", "1", "--out", str(out), "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    cores = report["cores"]
    assert report["rows"] == [1, 3] and set(report["conditions"]) == {"quiet", "1 competing"}
    assert len(report["table"]) == 2 * 4 * 2 * cores  # conditions x kernels x row counts x thread counts
    assert all(r["ms_min"] <= r["ms_median"] <= r["ms_max"] and r["ms_min"] > 0 for r in report["table"])
    assert all(1 <= t <= cores for t in report["best_threads"].values()) and len(report["best_threads"]) == 16
    assert png.stat().st_size > 1000


def test_threads_bench_layer_is_the_real_layout():
    from specdec.bench.threads import layer
    w = layer("int4", 64, 96)
    x = torch.randn(3, 96)
    dense = w.parts[0].dequantize()
    assert w.parts[0].bits == 4 and w.parts[0].offset is not None
    torch.testing.assert_close(w(x), x @ dense.T, rtol=1e-4, atol=1e-4)


def test_steps_bench_times_rows_per_model_and_precision(tmp_path, monkeypatch, capsys):
    from conftest import on_device

    from specdec.bench import steps
    from specdec.models.llama import LlamaConfig
    tiny = {name: LlamaConfig("qwen2", 300, 64, 128, layers, 4, 2, 16, 1e4, 1e-6, 512, True, False)
            for name, layers in (("tiny-draft", 1), ("tiny-target", 3))}
    monkeypatch.setattr(steps, "SHAPES", tiny)
    out, png = tmp_path / "steps.json", tmp_path / "steps.png"
    args = ["bench", "steps", "--shapes", "tiny-draft,tiny-target", "--rows", "1,3,8", "--context", "20",
            "--repeats", "2", "--device", on_device(), "--out", str(out), "--plot", str(png), "--threads", "1"]
    before = torch.get_num_threads()
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["threads"] == 1 and torch.get_num_threads() == before  # --threads applies, then is undone
    assert {(r["model"], r["precision"], r["rows"]) for r in report["results"]} == {
        (m, p, n) for m in tiny for p in ("float32", "bfloat16") for n in (1, 3, 8)}
    assert all(0 < r["ms_min"] <= r["ms"] <= r["ms_max"] for r in report["results"])
    assert all(r["vs_first_row_count"] == 1.0 for r in report["results"] if r["rows"] == 1)
    assert report["interleaved"] is True
    for r in report["results"]:  # per-round ratios to the first precision (float32: exactly 1)
        v = r["vs_first_precision"]
        assert 0 < v["min"] <= v["median"] <= v["max"]
        assert r["precision"] != "float32" or v["min"] == v["max"] == 1.0
    assert set(report["draft_cost_ratio"]) == {"float32", "bfloat16"}
    assert all(v["draft"] == "tiny-draft" and v["c"] > 0 for v in report["draft_cost_ratio"].values())
    assert png.stat().st_size > 1000
    assert main(["bench", "steps", "--shapes", "nonesuch", "--out", str(tmp_path / "x.json")]) == 2
    assert main(["bench", "steps", "--threads", "0", "--out", str(tmp_path / "x.json")]) == 2
    assert main(["bench", "steps", "--precisions", "int4", "--out", str(tmp_path / "x.json")]) == 2
    assert "no shapes for" in capsys.readouterr().err and not (tmp_path / "x.json").exists()


def test_a_draft_only_setting_times_the_target_it_is_priced_against(tmp_path, monkeypatch):
    """Asked for a draft's own setting alone (a requantized or sub-vocabulary draft), the bench times the
    target at that setting's mode as well, so the draft's c has its denominator."""
    from specdec.bench import steps

    class Fake:
        work = None

        def __init__(self, name: str, precision: str) -> None:
            self.ms = 2.0 if name == "target" else 1.0 if precision == "int4-a8" else 0.5

        def seconds(self, n: int) -> float:
            return self.ms * n / 1e3

        def close(self) -> None:
            pass

    monkeypatch.setattr(steps, "_setting", lambda name, precision, *a: Fake(name, precision))
    monkeypatch.setattr(steps, "_kernel_available", lambda: False)
    monkeypatch.setattr(steps, "SHAPES", {"draft": None, "target": None})
    report = steps.run(["draft", "target"], ["int4-a8:q4_64:vocab=64"], "cpu", [1, 2], 16, 1,
                       str(tmp_path / "s.json"), None)
    assert {(r["model"], r["precision"]) for r in report["results"]} == {
        ("draft", "int4-a8:q4_64:vocab=64"), ("draft", "int4-a8"), ("target", "int4-a8")}
    priced = report["draft_cost_ratio"]["int4-a8:q4_64:vocab=64"]
    assert priced["target_precision"] == "int4-a8" and priced["c"] == pytest.approx(0.25)


def test_steps_bench_states_integer_modes_against_the_machines_peaks(tmp_path, monkeypatch, tiny_qwen):
    """An integer mode on a real (tiny) GGUF: the read bandwidth and the int8 peak are measured, and
    every forward gets its bound (the larger of the weights' read time and its multiply-adds' time)."""
    from specdec.bench import bandwidth, steps
    from specdec.models.loader import load_model
    from specdec.quant import kernel, kv_format
    if not kernel.available():
        pytest.skip(f"kernel unavailable: {kernel.unavailable_reason()}")
    name = str(tiny_qwen)
    monkeypatch.setattr(steps, "SHAPES", {name: load_model(name, "float32", progress=False).config})
    out = tmp_path / "steps.json"
    assert main(["bench", "steps", "--shapes", name, "--precisions",
                 "int4-a8,int4-a8:kv=float16,int4-a8:kv=int8,int4-a8:vocab=64", "--rows", "1,2,9",
                 "--context", "16", "--repeats", "1", "--out", str(out), "--plot", ""]) == 0
    report = json.loads(out.read_text())
    peaks = report["peaks"]
    assert peaks["read_gb_s"] > 0 and peaks["int8_macs_per_s"] > 0 and peaks["isa"] in ("avx2", "avx512-vnni")
    work, work16 = report["work_per_step"][f"{name} int4-a8"], report["work_per_step"][f"{name} int4-a8:kv=float16"]
    assert work["bytes"] > 0 and work["macs_per_row"] > 0
    work8 = report["work_per_step"][f"{name} int4-a8:kv=int8"]
    d = load_model(name, "float32", progress=False).config.head_dim
    assert work["kv_bytes"] == 2 * work16["kv_bytes"] > 0     # auto: float32 K/V (no measurement of this model)
    width = kv_format.row_width(torch.int8, d)                                  # codes and their scales
    assert work8["kv_bytes"] == pytest.approx(work["kv_bytes"] * width / (4 * d), abs=1)
    cfg = load_model(name, "float32", progress=False).config
    sub = report["work_per_step"][f"{name} int4-a8:vocab=64"]   # an output layer of 64 rows, as held
    head = load_model(name, "int4-a8", progress=False).weights["embed" if cfg.tie_embeddings else "lm_head"]
    assert work["bytes"] - sub["bytes"] == pytest.approx(bandwidth._nbytes(head) * (1 - 64 / cfg.vocab_size), rel=0.01)
    for r in report["results"]:
        w = {"kv=float16": work16, "kv=int8": work8, "vocab=64": sub}.get(r["precision"].rpartition(":")[2], work)
        assert r["bound_ms"] == pytest.approx(steps.bound_ms(w, r["rows"], peaks)) and r["x_bound"] > 0
        assert (r["r"] is None) == (r["rows"] == 1)
    assert main(["bench", "steps", "--precisions", "int4-a8:kv=fp8", "--out", str(tmp_path / "x.json")]) == 2
    assert main(["bench", "steps", "--precisions", "int4-a8:vocab=0", "--out", str(tmp_path / "x.json")]) == 2
    # a draft's own options price it against the target as it runs
    assert steps._target_setting("int4-a8:q4_1:vocab=64:kv=float16") == "int4-a8:kv=float16"
    assert steps._options("int4-a8:q4_1:vocab=64") == ("int4-a8", "q4_1", "auto", 64)


def test_attention_bench_states_each_format_against_the_read_bandwidth(tmp_path, monkeypatch):
    from specdec.bench import attention
    from specdec.bench.attention import FORMATS
    from specdec.models.llama import LlamaConfig
    from specdec.quant import kernel, kv_format
    if not kernel.available():
        pytest.skip(f"kernel unavailable: {kernel.unavailable_reason()}")
    monkeypatch.setattr(attention, "SHAPES", {"tiny": LlamaConfig("qwen2", 300, 64, 128, 2, 4, 2, 16, 1e4, 1e-6,
                                                                  512, True, False)})
    out = tmp_path / "attention.json"
    assert attention.main(["--shape", "tiny", "--contexts", "32,64", "--rows", "1,3", "--repeats", "1",
                           "--out", str(out), "--plot", ""]) == 0
    report = json.loads(out.read_text())
    cells = {(r["context"], r["kv"], r["rows"]): r for r in report["results"]}
    assert set(cells) == {(c, f, n) for c in (32, 64) for f in ("float32", "float16", "int8") for n in (1, 3)}
    peak = report["read_gb_s"]["used"]
    for (context, fmt, n), r in cells.items():
        width = kv_format.row_width(FORMATS[fmt], 16) * FORMATS[fmt].itemsize  # bytes of one KV head's row
        assert r["bytes"] == 2 * 2 * 2 * context * width                      # K and V, 2 layers, 2 KV heads
        assert r["gb_s"] == pytest.approx(r["bytes"] / (r["ms"] / 1e3) / 1e9, rel=1e-6)
        assert r["of_read_bandwidth"] == pytest.approx(r["gb_s"] / peak) and r["ms_min"] <= r["ms"] <= r["ms_max"]
        assert (r["vs_one_row"] == 1.0) == (n == 1)
    with pytest.raises(SystemExit):
        attention.main(["--kv", "fp8"])


def test_a_steps_bound_is_the_larger_of_memory_and_compute():
    from specdec.bench.steps import bound_ms
    work, peaks = {"bytes": 1e9, "macs_per_row": 1e9}, {"read_gb_s": 10.0, "int8_macs_per_s": 100e9}
    assert bound_ms(work, 1, peaks) == pytest.approx(100.0)    # the weights' read: 0.1 s
    assert bound_ms(work, 17, peaks) == pytest.approx(170.0)   # 17 rows' multiply-adds: 0.17 s


def test_each_bench_mode_takes_its_own_flags_and_spec_is_the_default(capsys):
    from specdec.cli import build_parser
    from specdec.commands.bench import MODES, with_default_mode
    parser = build_parser()
    assert with_default_mode(["bench", "--sets", "chat"]) == ["bench", "spec", "--sets", "chat"]
    assert with_default_mode(["bench"]) == ["bench", "spec"]
    assert with_default_mode(["bench", "steps", "--rows", "1"]) == ["bench", "steps", "--rows", "1"]
    assert with_default_mode(["generate", "--sets"]) == ["generate", "--sets"]
    a = parser.parse_args(["bench", "steps", "--rows", "1,5", "--context", "64"])
    assert (a.mode, a.rows, a.context) == ("steps", "1,5", 64)
    for mode, flag in (("steps", "--sets"), ("threads", "--peers"), ("decode", "--rates"), ("spec", "--rows")):
        with pytest.raises(SystemExit):
            parser.parse_args(["bench", mode, flag, "x"])
    assert "unrecognized arguments" in capsys.readouterr().err
    for mode in MODES:  # every mode has its help and the model flags
        assert parser.parse_args(["bench", mode, "--model", "m"]).model == "m"


def test_every_bench_command_in_the_docs_parses():
    """The commands the results tables print (docs_report rebuilds them from each run's JSON) are valid."""
    import re
    import shlex
    from pathlib import Path

    from specdec.cli import build_parser
    from specdec.commands.bench import with_default_mode
    root = Path(__file__).resolve().parents[1]
    parser = build_parser()
    commands = {c for f in [root / "README.md", *(root / "docs").glob("*.md")]
                for c in re.findall(r"`(specdec bench[^`]*)`", f.read_text())}
    assert len(commands) > 10
    for command in commands:
        argv = [w for w in shlex.split(command)[1:] if not w.startswith("#")]
        if any(w in ("...", "MODE", "N", "SECONDS") or "[" in w for w in argv):
            continue  # a synopsis in prose, not a command
        parser.parse_args(with_default_mode(argv))


def test_phase_timer_splits_a_call_into_self_times():
    import time

    from specdec.bench.phase_timer import PhaseTimer

    class Work:
        def inner(self):
            time.sleep(0.02)

        def outer(self):
            time.sleep(0.01)
            self.inner()
            self.inner()
    w, timer = Work(), PhaseTimer()
    timer.wrap(w, "inner", "inner")
    timer.wrap(w, "outer", "outer")
    t0 = time.perf_counter()
    w.outer()
    wall = time.perf_counter() - t0
    assert timer.calls == {"inner": 2, "outer": 1}
    assert timer.seconds["inner"] >= 0.04 and 0.01 <= timer.seconds["outer"] < 0.04
    assert sum(timer.seconds.values()) == pytest.approx(wall, rel=0.05)


def test_step_overhead_bench_parts_add_up_to_the_step(tiny_qwen, tiny_llama, tmp_path):
    from specdec.bench.step_overhead import FORWARDS, main as overhead
    out = tmp_path / "overhead.json"
    assert overhead(["--model", str(tiny_qwen), "--draft", str(tiny_llama), "--arms", "plain,draft,draft_sampled",
                     "-k", "2", "--max-tokens", "20", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    plain, draft, sampled = report["arms"]
    assert (plain["arm"], plain["k"], draft["arm"], draft["k"], sampled["arm"]) == ("plain", 0, "draft", 2,
                                                                                   "draft_sampled")
    for r in (plain, draft, sampled):
        assert r["steps"] >= 5 and 0.0 < r["overhead_share_median"] < 1.0
        parts = r["parts_ms_per_step"]
        wall = sum(s["wall_seconds"] for s in r["per_step"])
        assert r["step_seconds_total"] == pytest.approx(wall, rel=0.05)   # the parts cover the step
        assert sum(parts.values()) == pytest.approx(1e3 * r["step_seconds_total"] / r["steps"], rel=1e-6)
        assert sum(ms for n, ms in parts.items() if n not in FORWARDS) == pytest.approx(
            1e3 * r["overhead_seconds_total"] / r["steps"], rel=1e-6)
    # the drafts, greedy or sampled, in one C++ call a step (the draft chain)
    chain = "draft chain (forwards, output layers, picks)"
    assert chain in draft["parts_ms_per_step"] and chain in sampled["parts_ms_per_step"]
    assert not any(n.startswith("draft") for n in plain["parts_ms_per_step"])


def test_first_argmax_is_torchs():
    from specdec.sample.sampler import first_argmax
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 3, (64, 257), generator=g).float()        # many ties: the first one wins
    x[3] = float("-inf")
    x[5, 17] = x[5, 40] = float("nan")
    for rows in (x, x[:, ::3], x[7], x.double()):
        assert torch.equal(first_argmax(rows), rows.argmax(-1))


def test_draft_ranks_of_the_target_itself_are_all_first(tiny_qwen, tmp_path):
    """A draft that is the target, teacher-forced over the target's own greedy answers, ranks every answer
    token first: its logits at each position are the ones the target picked from (batch invariance)."""
    from specdec.bench import draft_ranks
    out = tmp_path / "ranks.json"
    assert draft_ranks.main(["--model", str(tiny_qwen), "--draft", str(tiny_qwen), "--precision", "float32",
                             "--draft-requantize", "none", "--sets", "chat,code_gen", "--num-prompts", "2",
                             "--max-tokens", "8", "--out", str(out), "--plot", ""]) == 0
    report = json.loads(out.read_text())
    assert [s["name"] for s in report["sets"]] == ["chat", "code_gen"]
    for s in report["sets"]:
        assert s["tokens"] > 0 and all(v == 1.0 for v in s["within"].values())


def test_draft_ranks_counts_how_far_down_a_different_draft_ranks_the_target(tiny_llama):
    from specdec.bench import draft_ranks
    forced = draft_ranks.TeacherForced(str(tiny_llama), "float32", None, 64)
    answer = [5, 9, 3, 7]
    r = draft_ranks.ranks(forced, [1, 2, 3], answer)
    logits = forced.logits([1, 2, 3] + answer[:-1])[2:]
    assert r.tolist() == [int((row > row[t]).sum()) + 1 for row, t in zip(logits, answer)]
    shares = draft_ranks.summarize("x", r).within
    assert list(shares.values()) == sorted(shares.values()) and shares[8] <= 1.0
