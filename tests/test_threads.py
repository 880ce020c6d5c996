"""The thread-count tuner: it measures each count, keeps the fastest, re-probes and follows a change;
each runner applies its own count around its own forward only; and no thread count changes a result,
so switching between forwards is safe."""
from __future__ import annotations

import pytest
import torch

from specdec.quant.options import KernelOptions
from specdec.runner.threads import ThreadTuner, size_class, using_threads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def drive(tuner: ThreadTuner, seconds_per_row: dict[int, float], forwards: int, rows: int = 1) -> list[int]:
    """Forwards as a runner runs them: each on the chosen count (`using_threads`). Returns the counts
    torch ran them on."""
    ran = []
    for _ in range(forwards):
        t = tuner.choose(rows)
        with using_threads(t):
            ran.append(torch.get_num_threads())
        tuner.record(rows, t, seconds_per_row[t] * rows)
    return ran


def test_measures_every_count_then_keeps_the_fastest(restore_threads):
    tuner = ThreadTuner(2, probe_every=10)
    torch.set_num_threads(2)
    chosen = drive(tuner, {1: 1.0, 2: 0.6}, 40)
    # the most threads first, then each other count: each twice, its first forward a warm-up
    assert chosen[:4] == [2, 2, 1, 1]
    assert chosen[4:].count(2) >= 34 and tuner.best(1) == 2
    assert torch.get_num_threads() == 2  # each forward's count was its own: torch's is restored


def test_a_cold_first_forward_is_not_measured(restore_threads):
    """A process's first forward (weights paged in, thread pool started) is slow on any count: it
    must not make one thread look faster than two."""
    tuner = ThreadTuner(2, probe_every=50)
    t = tuner.choose(1)
    tuner.record(1, t, 5.0)  # cold
    drive(tuner, {1: 1.0, 2: 0.6}, 10)
    assert tuner.best(1) == 2


def test_follows_a_competing_process_and_back(restore_threads):
    tuner = ThreadTuner(2, probe_every=5, alpha=0.5)
    drive(tuner, {1: 1.0, 2: 0.6}, 20)
    assert tuner.best(1) == 2
    drive(tuner, {1: 1.0, 2: 2.5}, 40)  # another process took a core: one thread is now faster
    assert tuner.best(1) == 1
    drive(tuner, {1: 1.0, 2: 0.6}, 60)
    assert tuner.best(1) == 2


def test_several_rows_always_take_every_core(restore_threads):
    """One-row forwards are tuned; verification and prefill forwards never try fewer cores (one
    thread on a long prefill would cost seconds), even while one thread wins at one row."""
    tuner = ThreadTuner(4, probe_every=5)
    drive(tuner, {1: 1.0, 2: 2.0, 4: 3.0}, 20, rows=1)
    assert tuner.best(1) == 1
    assert set(drive(tuner, {1: 0.1, 2: 0.1, 4: 1.0}, 30, rows=5)) == {4}
    assert set(drive(tuner, {1: 0.1, 2: 0.1, 4: 1.0}, 30, rows=600)) == {4}
    assert size_class(1) != size_class(5)


@pytest.mark.parametrize("n, counts", [(1, [1]), (2, [1, 2]), (6, [1, 2, 4, 6])])
def test_candidate_counts(n, counts):
    assert ThreadTuner(n).counts == counts


@pytest.mark.parametrize("path", ["kernel", "mkl"])
@pytest.mark.parametrize("precision", ["float32", "bfloat16", "int4", "int4-a16", "int4-a8"])
def test_thread_count_never_changes_logits(tiny_qwen, precision, path, restore_threads):
    from specdec.core.outputs import ScheduledChunk, SchedulerOutput
    from specdec.models.llama import LlamaModel
    from specdec.models.loader import load_model
    from specdec.runner.model_runner import ModelRunner
    options = KernelOptions()
    if path == "mkl":
        if precision != "float32":
            pytest.skip("the float32 path does not apply")
        options = KernelOptions(dense=False)
    loaded = load_model(str(tiny_qwen), precision, progress=False)
    model = LlamaModel(loaded.config, loaded.weights, 256, torch.device("cpu"), options=options)
    runner = ModelRunner(model, 64, 4, torch.device("cpu"))
    tokens = torch.randint(0, 260, (29,), generator=torch.Generator().manual_seed(0)).tolist()
    chunk = [ScheduledChunk("a", tokens, 0, list(range(8)), len(tokens))]
    results = []
    for threads in (1, 2, 1):
        torch.set_num_threads(threads)
        results.append(runner.execute(SchedulerOutput(chunks=chunk, num_batched_tokens=len(tokens))).logits)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_each_runner_runs_its_forwards_on_its_own_count(tiny_qwen, restore_threads):
    """A target and a draft model with different counts (fixed, or tuned) each run their own forwards on
    their own count, and leave torch's as they found it: neither inherits the other's."""
    from specdec.core.outputs import ScheduledChunk, SchedulerOutput
    from specdec.models.llama import LlamaModel
    from specdec.models.loader import load_model
    from specdec.runner.model_runner import ModelRunner
    loaded = load_model(str(tiny_qwen), "float32", progress=False)
    seen: list[int] = []

    def runner(tuner: ThreadTuner) -> ModelRunner:
        model = LlamaModel(loaded.config, loaded.weights, 256, torch.device("cpu"))
        forward = model.forward
        model.forward = lambda *args: (seen.append(torch.get_num_threads()), forward(*args))[1]
        return ModelRunner(model, 64, 4, torch.device("cpu"), tuner=tuner)

    target, draft = runner(ThreadTuner.fixed(2)), runner(ThreadTuner.fixed(1))
    torch.set_num_threads(2)
    chunk = [ScheduledChunk("a", [5, 6, 7], 0, list(range(8)), 1)]
    for r in (target, draft, target, draft):
        r.execute(SchedulerOutput(chunks=chunk, num_batched_tokens=3))
        assert torch.get_num_threads() == 2
    assert seen == [2, 1, 2, 1]
