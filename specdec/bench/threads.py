"""`specdec bench threads`: how many threads, measured on a quiet machine and under competition.

Times one layer of the real shape (default the 1.5B's gate|up, 17920 x 1536, random weights in the
real layouts) through each CPU kernel (float32, int4, int4-a16, int4-a8) at 1 row (a decode step) and at
k + 1 rows (verifying k drafts), with every thread count from 1 to the core count; first alone,
then with `--competitors` busy processes (each takes one core). Arms run interleaved within each
repeat; medians with min-max; JSON and a PNG. The engine's policy (all cores, dynamic chunks in the
kernels) is what these figures chose; the bench prints which thread count won each cell.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from specdec.contention import Contention
from specdec.extras import require_plotting
from specdec.fileio import atomic_write_text

KERNELS = ("float32", "int4", "int4-a16", "int4-a8")
ACT = {"int4-a16": 16, "int4-a8": 8}  # activation bits of the integer kernels


def layer(kind: str, out_features: int, in_features: int, seed: int = 0):
    """A random weight in the layout the precision runs: dense float32, or Q4_K as packed: 4-bit codes,
    a scale (an integer below 64 times one scale per 256 values) and an offset per 32 values."""
    from specdec.quant.packed import QuantLinear, QuantTensor
    g = torch.Generator().manual_seed(seed)
    if kind == "float32":
        return torch.randn(out_features, in_features, generator=g) / in_features ** 0.5
    groups = in_features // 32
    sub = torch.randint(0, 64, (out_features, groups), generator=g).float()
    d = torch.rand(out_features, -(-in_features // 256), generator=g) / 4096
    scale = (sub * d.repeat_interleave(8, dim=1)[:, :groups]).contiguous()
    qt = QuantTensor(4, 32, torch.randint(0, 256, (out_features, in_features // 2), generator=g, dtype=torch.uint8),
                     scale, -torch.rand(out_features, groups, generator=g) / 8, in_features,
                     d if in_features % 256 == 0 else None)  # a row of whole super-blocks, as Q4_K has
    return QuantLinear([qt], act=ACT.get(kind, 0))


def time_call(fn, calls: int) -> float:
    """Median milliseconds of `calls` calls, after one warm-up."""
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


class Competitors:
    """n busy processes (pure-Python spin loops), each taking one core while the block runs."""

    def __init__(self, n: int) -> None:
        self.n, self.procs = n, []

    def __enter__(self) -> Competitors:
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.n)]
        time.sleep(0.5 if self.n else 0)  # let them reach the scheduler
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def run_threads_bench(a) -> dict:
    require_plotting(a.plot, "specdec bench threads")
    from tqdm import tqdm

    from specdec.quant import kernel
    from specdec.quant.layers import linear

    if not kernel.available():
        raise RuntimeError(f"bench threads times specdec's CPU kernels: {kernel.unavailable_reason()}")
    out_f, in_f = (int(v) for v in a.shape.split("x"))
    cores = os.cpu_count() or 1
    thread_counts = list(range(1, cores + 1))
    row_counts = [1, a.k + 1]
    weights = {kind: layer(kind, out_f, in_f) for kind in KERNELS}
    xs = {rows: torch.randn(rows, in_f) for rows in row_counts}
    conditions = {"quiet": 0, f"{a.competitors} competing": a.competitors}
    before = torch.get_num_threads()
    cells: dict[tuple, list[float]] = {}
    noise = {}
    try:
        total = len(conditions) * a.repeats
        with tqdm(total=total, desc="bench threads", file=sys.stderr) as bar:
            for cond, n in conditions.items():
                with Competitors(n), Contention() as contention:
                    for _ in range(a.repeats):
                        for kind in KERNELS:
                            for rows in row_counts:
                                for t in thread_counts:
                                    torch.set_num_threads(t)
                                    ms = time_call(lambda: linear(xs[rows], weights[kind]), a.calls)
                                    cells.setdefault((cond, kind, rows, t), []).append(ms)
                        bar.update()
                noise[cond] = {"other_cores": contention.cores, "load_average": contention.load_average}
    finally:
        torch.set_num_threads(before)
    table = []
    for (cond, kind, rows, t), ms in cells.items():
        table.append({"condition": cond, "kernel": kind, "rows": rows, "threads": t, "ms_median": statistics.median(ms),
                      "ms_min": min(ms), "ms_max": max(ms)})
    best = {}
    for cond in conditions:
        for kind in KERNELS:
            for rows in row_counts:
                cell = [r for r in table if (r["condition"], r["kernel"], r["rows"]) == (cond, kind, rows)]
                win = min(cell, key=lambda r: r["ms_median"])
                best[f"{cond}/{kind}/{rows}"] = win["threads"]
    result = {"shape": [out_f, in_f], "cores": cores, "repeats": a.repeats, "calls": a.calls, "rows": row_counts,
              "conditions": noise, "table": table, "best_threads": best}
    _print(result, conditions, thread_counts, row_counts)
    atomic_write_text(Path(a.out), json.dumps(result, indent=1))
    if a.plot:
        _plot(result, conditions, thread_counts, row_counts, Path(a.plot))
    print(f"wrote {a.out}" + (f" and {a.plot}" if a.plot else ""))
    return result


def _cell(result: dict, cond: str, kind: str, rows: int, t: int) -> dict:
    return next(r for r in result["table"] if (r["condition"], r["kernel"], r["rows"], r["threads"]) == (cond, kind, rows, t))


def _print(result: dict, conditions: dict, thread_counts: list[int], row_counts: list[int]) -> None:
    head = "".join(f"{f'{t} thr ms [min-max]':>24}" for t in thread_counts)
    print(f"{'condition':14} {'kernel':8} {'rows':>4}{head}  best")
    for cond in conditions:
        for kind in KERNELS:
            for rows in row_counts:
                cells = [_cell(result, cond, kind, rows, t) for t in thread_counts]
                text = "".join(f"{c['ms_median']:10.2f} [{c['ms_min']:.2f}-{c['ms_max']:.2f}]".rjust(24) for c in cells)
                print(f"{cond:14} {kind:8} {rows:>4}{text}  {result['best_threads'][f'{cond}/{kind}/{rows}']}")
    for cond, v in result["conditions"].items():
        cores = v["other_cores"]
        print(f"{cond}: other processes used {cores:.2f} cores" if cores is not None else f"{cond}: not measured")


def _plot(result: dict, conditions: dict, thread_counts: list[int], row_counts: list[int], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from specdec.quality.report import save_figure
    fig, axes = plt.subplots(1, len(conditions), figsize=(6 * len(conditions), 4), sharey=True)
    labels = [f"{kind}\n{rows} row{'s' if rows > 1 else ''}" for kind in KERNELS for rows in row_counts]
    width = 0.8 / len(thread_counts)
    for ax, cond in zip(axes, conditions):
        for i, t in enumerate(thread_counts):
            ms = [_cell(result, cond, kind, rows, t)["ms_median"] for kind in KERNELS for rows in row_counts]
            ax.bar([j + i * width for j in range(len(labels))], ms, width, label=f"{t} thread{'s' if t > 1 else ''}")
        ax.set_xticks([j + width * (len(thread_counts) - 1) / 2 for j in range(len(labels))], labels, fontsize=8)
        ax.set_title(f"{cond} (layer {result['shape'][0]} x {result['shape'][1]})")
        ax.set_ylabel("ms per call (median)")
        ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
