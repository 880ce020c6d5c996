"""check-lossless: the chi-square helper against scipy on designed tables, the binning on synthetic
samples (including calibration under the null), and on the real 0.5B target that n-gram speculation
passes while a deliberately broken rejection sampler fails."""
from __future__ import annotations

import json
import os
import time

import pytest
import torch

from broken_samplers import always_accept
from specdec.quality.chi_square import chi_square_two_sample
from specdec.quality.lossless import (
    DEFAULT_PROMPTS,
    ArmSamples,
    arm_seeds,
    check_lossless,
    compare_arms,
)


def _scipy_chi2(table: list[list[int]]):
    stats = pytest.importorskip("scipy.stats")
    return stats.chi2_contingency(table, correction=False)


# ---- the chi-square helper --------------------------------------------------------------------

def test_identical_distributions_give_p_one():
    r = chi_square_two_sample([40, 30, 20, 10], [40, 30, 20, 10])
    assert r.statistic == pytest.approx(0.0, abs=1e-12)
    assert r.df == 3 and r.p_value == pytest.approx(1.0)


@pytest.mark.parametrize("a, b", [
    ([50, 30, 20, 10], [45, 35, 15, 15]),
    ([120, 80, 40, 30, 30], [60, 45, 15, 20, 10]),   # unequal sample sizes
    ([500, 300, 200], [300, 500, 200]),              # a real shift
])
def test_matches_scipy(a, b):
    ref = _scipy_chi2([a, b])
    r = chi_square_two_sample(a, b)
    assert r.statistic == pytest.approx(ref.statistic, rel=1e-9)
    assert r.df == ref.dof
    assert r.p_value == pytest.approx(ref.pvalue, rel=1e-6, abs=1e-300)


def test_shifted_distribution_gives_tiny_p():
    r = chi_square_two_sample([500, 300, 200], [300, 500, 200])
    assert r.p_value < 1e-20


def test_sparse_and_empty_columns_are_merged_into_other():
    # columns 2 and 3 are sparse (expected < 5), column 4 is empty; "other" (last) absorbs them
    a, b = [100, 80, 2, 1, 0, 10], [90, 95, 1, 2, 0, 12]
    r = chi_square_two_sample(a, b)
    merged = [[100, 80, 13], [90, 95, 15]]
    ref = _scipy_chi2(merged)
    assert r.num_bins == 3 and r.df == 2
    assert r.statistic == pytest.approx(ref.statistic, rel=1e-9)
    assert r.p_value == pytest.approx(ref.pvalue, rel=1e-6)


def test_sparse_other_goes_into_the_smallest_column():
    r = chi_square_two_sample([100, 40, 1], [90, 50, 2])
    ref = _scipy_chi2([[100, 41], [90, 52]])
    assert r.num_bins == 2
    assert r.statistic == pytest.approx(ref.statistic, rel=1e-9)


def test_one_column_is_no_evidence():
    r = chi_square_two_sample([50, 0], [70, 0])
    assert (r.df, r.p_value) == (0, 1.0)


def test_bad_tables_are_refused():
    with pytest.raises(ValueError):
        chi_square_two_sample([1, 2], [1])
    with pytest.raises(ValueError):
        chi_square_two_sample([0, 0], [1, 2])


# ---- binning on synthetic samples --------------------------------------------------------------

def _synthetic_arm(probs: torch.Tensor, num_samples: int, seed: int) -> ArmSamples:
    """Three positions, each drawn independently from probs (a stand-in for generated ids)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.multinomial(probs, num_samples * 3, replacement=True, generator=g).view(num_samples, 3)
    return ArmSamples("synthetic", [[0]], (1.0, 1.0, 0), [ids.tolist()], [0], [0], 0.0)


def test_compare_arms_tests_each_position_and_each_consecutive_pair():
    probs = torch.softmax(torch.linspace(3, -3, 40), 0)
    tests = compare_arms(_synthetic_arm(probs, 500, 1), _synthetic_arm(probs, 400, 2), [2, 3])
    assert [t.positions for t in tests] == [[2], [3], [2, 3]]
    assert all(t.num_bins <= 21 for t in tests)


def test_calibrated_under_the_null_and_powerful_against_a_shift():
    probs = torch.softmax(torch.linspace(3, -3, 40), 0)
    p_values = [compare_arms(_synthetic_arm(probs, 400, 2 * i), _synthetic_arm(probs, 400, 2 * i + 1), [2])[0].p_value
                for i in range(200)]
    false_alarms = sum(p < 0.05 for p in p_values) / len(p_values)
    assert 0.01 <= false_alarms <= 0.10  # binomial(200, 0.05): 0.01..0.10 is beyond 3 sigma
    shifted = probs.clone()
    shifted[0] += 0.15  # about what accepting every n-gram draft does to the draft token
    shifted /= shifted.sum()
    p = compare_arms(_synthetic_arm(probs, 2000, 7), _synthetic_arm(shifted, 2000, 8), [2])[0].p_value
    assert p < 1e-4


def test_arm_seeds_are_fixed_and_the_arms_independent():
    assert arm_seeds(0, "plain", 5) == arm_seeds(0, "plain", 5)
    assert not set(arm_seeds(0, "plain", 1000)) & set(arm_seeds(0, "spec", 1000))
    assert arm_seeds(0, "plain", 5) != arm_seeds(1, "plain", 5)


# ---- the real target ---------------------------------------------------------------------------

# the CI requirement is >= 2,000 samples per arm (about 12 minutes on 2 quiet cores); lower it for a quick local run
NUM_SAMPLES = int(os.environ.get("SPECDEC_LOSSLESS_SAMPLES", "2000"))
BROKEN_SAMPLES = min(300, NUM_SAMPLES)  # caught at a few hundred samples (p < 1e-12 at 200)


@pytest.fixture(scope="module")
def torch_threads():
    """Every core this process may use (CI's quiet 2 cores: 2 threads are about 1.6x faster than 1),
    not torch's current count, which an earlier test's `--threads 1` engine may have left at 1; set
    SPECDEC_TEST_THREADS=1 on a machine that other jobs share. Restored afterwards."""
    before = torch.get_num_threads()
    yield int(os.environ.get("SPECDEC_TEST_THREADS", len(os.sched_getaffinity(0))))
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def correct_report(qwen05_loaded, torch_threads):
    t0 = time.perf_counter()
    report = check_lossless(qwen05_loaded, DEFAULT_PROMPTS[:1], method="ngram", k=3, num_samples=NUM_SAMPLES,
                            positions=(2, 3), seed=0, num_threads=torch_threads, progress=False)
    print(f"\ncorrect sampler: {time.perf_counter() - t0:.0f}s\n{report.table()}\n{report.verdict()}")
    return report


@pytest.mark.real_model
def test_ngram_speculation_passes(correct_report):
    assert correct_report.passed, correct_report.table()
    assert correct_report.drafted_tokens[0] > NUM_SAMPLES // 2  # most samples drafted at position 2
    assert 0 < correct_report.accepted_tokens[0] < correct_report.drafted_tokens[0]  # the target is unsure
    assert correct_report.num_samples_plain == correct_report.num_samples_spec == NUM_SAMPLES


@pytest.mark.real_model
def test_broken_sampler_fails(qwen05_loaded, correct_report, torch_threads):
    t0 = time.perf_counter()
    report = check_lossless(qwen05_loaded, DEFAULT_PROMPTS[:1], method="ngram", k=3,
                            num_samples=BROKEN_SAMPLES, positions=(2, 3), seed=0, num_threads=torch_threads,
                            progress=False, plain=correct_report.plain, sampler=always_accept,
                            coupling="rejection")
    print(f"\nbroken sampler: {time.perf_counter() - t0:.0f}s\n{report.table()}\n{report.verdict()}")
    assert not report.passed
    assert report.min_p_value < 1e-8
    assert report.accepted_tokens == report.drafted_tokens  # always_accept really ran


@pytest.mark.real_model
def test_cli_prints_a_verdict_and_writes_json(qwen05_loaded, torch_threads, monkeypatch, tmp_path, capsys):
    from specdec.cli import main
    monkeypatch.setattr("specdec.models.loader.load_model", lambda *a, **k: qwen05_loaded)  # no second copy
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": DEFAULT_PROMPTS[0]}) + "\n")
    out = tmp_path / "report.json"
    rc = main(["check-lossless", "--samples", "12", "--prompts-file", str(prompts), "--threads", "1",
               "--seed", "3", "--out", str(out)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith(("PASS", "FAIL")) and "Bonferroni" in lines[-1]
    assert sum(line.startswith(("PASS", "FAIL")) for line in lines) == 1
    assert rc == (0 if lines[-1].startswith("PASS") else 1)
    report = json.loads(out.read_text())
    assert report["num_samples_spec"] == 12 and report["positions"] == [2, 3]
    assert len(report["tests"]) == 3 and "plain" not in report
    assert report["passed"] == (rc == 0)


@pytest.mark.parametrize("flags, message", [
    (["--positions", "1,2"], "positions start at 2"),
    (["--positions", "2,x"], "comma-separated"),
    (["--temperature", "0"], "temperature must be > 0"),
    (["--alpha", "1.5"], "alpha"),
    (["-k", "0"], "k must be >= 1"),
])
def test_cli_refuses_bad_flags_before_loading(flags, message, capsys, monkeypatch):
    from specdec.cli import main

    def no_load(*a, **k):
        raise AssertionError("loaded weights for a doomed check")
    monkeypatch.setattr("specdec.models.loader.load_model", no_load)
    assert main(["check-lossless", *flags]) == 2
    assert message in capsys.readouterr().err


def test_cli_does_not_expose_the_broken_sampler():
    from specdec.cli import build_parser
    args = build_parser().parse_args(["check-lossless"])
    assert not [name for name in vars(args) if "broken" in name or "test_mode" in name]
    assert (args.model, args.spec, args.k, args.samples, args.positions) == (
        "qwen2.5-coder-0.5b-instruct", "ngram", 3, 2000, "2,3")
