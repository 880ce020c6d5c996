"""`python -m specdec.bench.attention`: the attention kernel over a long paged K/V cache, against this
machine's read bandwidth.

For each context length and K/V format (quant/kv_format.py), the caches of every layer of the real
shape are filled with random rows and one forward's attention (one kernel call per layer) is timed:
one decode row, and k + 1 rows of one verification (one pass over the cache for all of them). The
bound is the caches' bytes read once at the measured read bandwidth (measured before and after; the
higher is used). Formats are interleaved round by round, so they share the machine's slow and fast
moments. JSON (ms with min-max, GB/s, share of the bandwidth, rows against one row) and a PNG.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from specdec.bench.bandwidth import measure_read_bandwidth
from specdec.bench.steps import SHAPES
from specdec.config import KV_CACHE_DTYPES
from specdec.extras import require_plotting
from specdec.fileio import atomic_write_text
from specdec.quant import kernel, kv_format
from specdec.runner.model_runner import kv_cache_dtype

FORMATS = {name: kv_cache_dtype(name) for name in KV_CACHE_DTYPES if name != "auto"}  # the cache's formats


class Caches:
    """Every layer's K/V caches of one format after `context` tokens, and the q rows of one step."""

    def __init__(self, cfg, dtype: torch.dtype, context: int, rows: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        slots, d = context + rows, cfg.head_dim

        def cache() -> torch.Tensor:
            return kv_format.encode(torch.randn(cfg.num_kv_heads, slots, d, generator=g), dtype)

        self.layers = [(cache(), cache()) for _ in range(cfg.num_layers)]
        self.q = torch.randn(rows, cfg.num_heads, d, generator=g)
        self.out = torch.empty(rows, cfg.num_heads * d)
        self.context, self.scale, self.cfg = context, d ** -0.5, cfg
        row_bytes = kv_format.row_width(dtype, d) * dtype.itemsize
        self.bytes = 2 * cfg.num_layers * cfg.num_kv_heads * context * row_bytes  # read once a forward

    def seconds(self, n: int) -> float:
        """One forward's attention for n rows: row i's context is the first context + i + 1 slots."""
        ctx_len = torch.arange(self.context + 1, self.context + n + 1)
        ctx_slots = torch.cat([torch.arange(int(length)) for length in ctx_len])
        ctx_start = torch.cumsum(ctx_len, 0) - ctx_len
        q, out = self.q[:n].contiguous(), self.out[:n]
        t0 = time.perf_counter()
        for k, v in self.layers:
            kernel.attention(q, k, v, ctx_slots, ctx_start, ctx_len, self.scale, out)
        return time.perf_counter() - t0


def run(shape: str, contexts: list[int], formats: list[str], rows: list[int], repeats: int, out: str,
        plot: str | None) -> dict:
    cfg = SHAPES[shape]
    before = measure_read_bandwidth()
    cells = []
    from tqdm import tqdm
    for context in tqdm(contexts, desc="attention: contexts", unit="context", file=sys.stderr):
        caches = {f: Caches(cfg, FORMATS[f], context, max(rows)) for f in formats}
        times = {(f, n): [] for f in formats for n in rows}
        for r in range(repeats + 1):  # the first round warms up
            for f in formats:
                for n in rows:
                    seconds = caches[f].seconds(n)
                    if r:
                        times[(f, n)].append(seconds)
        cells += [(context, f, n, times[(f, n)], times[(f, rows[0])], caches[f].bytes) for f in formats for n in rows]
        del caches
    peak = max(before, measure_read_bandwidth())
    results = [_result(*cell, peak) for cell in cells]
    for r in results:
        print(f"  context {r['context']:6d} {r['kv']:8s} {r['rows']:2d} rows: {r['ms']:8.2f} ms [{r['ms_min']:.2f}-"
              f"{r['ms_max']:.2f}]  {r['gb_s']:5.1f} GB/s = {100 * r['of_read_bandwidth']:3.0f} % of read"
              f"  {r['vs_one_row']:.2f}x one row", file=sys.stderr, flush=True)
    report = {"mode": "attention", "shape": shape, "contexts": contexts, "kv": formats, "rows": rows,
              "threads": torch.get_num_threads(), "repeats": repeats, "interleaved": True,
              "read_gb_s": {"before": before, "after": peak if peak != before else None, "used": peak},
              "isa": kernel.isa(), "results": results}
    atomic_write_text(Path(out), json.dumps(report, indent=1))
    if plot:
        _plot(report, plot)
    return report


def _result(context: int, fmt: str, n: int, times: list[float], one_row: list[float], nbytes: int,
            peak: float) -> dict:
    ms = [t * 1e3 for t in times]
    med = statistics.median(times)
    return {"context": context, "kv": fmt, "rows": n, "ms": statistics.median(ms), "ms_min": min(ms),
            "ms_max": max(ms), "bytes": nbytes, "gb_s": nbytes / med / 1e9,
            "of_read_bandwidth": nbytes / med / 1e9 / peak,
            "bound_ms": nbytes / peak / 1e6, "vs_one_row": med / statistics.median(one_row)}


def _plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for fmt in dict.fromkeys(r["kv"] for r in report["results"]):
        for n in sorted({r["rows"] for r in report["results"]}):
            pts = [(r["context"], 100 * r["of_read_bandwidth"]) for r in report["results"]
                   if r["kv"] == fmt and r["rows"] == n]
            ax.plot(*zip(*pts), marker="o", linestyle="-" if n == 1 else "--", label=f"{fmt} K/V, {n} row(s)")
    ax.axhline(70, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("K/V bytes read per second, % of read bandwidth")
    ax.set_title(f"attention over the paged cache, {report['shape']}, {report['threads']} threads, "
                 f"read {report['read_gb_s']['used']:.1f} GB/s", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec.bench.attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen2.5-coder-1.5b-instruct", choices=sorted(SHAPES))
    p.add_argument("--contexts", default="2048,4096,8192,16384", help="context lengths (tokens)")
    p.add_argument("--kv", default="float32,float16,int8", help=f"K/V formats, from {', '.join(FORMATS)}")
    p.add_argument("--rows", default="1,5", help="rows per forward; the first is the reference")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="bench-attention.json")
    p.add_argument("--plot", default="bench-attention.png", help="PNG plot; empty for none")
    a = p.parse_args(argv)
    try:
        contexts, rows = [int(x) for x in a.contexts.split(",")], [int(x) for x in a.rows.split(",")]
        formats = a.kv.split(",")
        if min(contexts) < 1 or min(rows) < 1 or a.repeats < 1 or not set(formats) <= set(FORMATS):
            raise ValueError
    except ValueError:
        p.error(f"--contexts, --rows and --repeats take integers >= 1, --kv formats from {', '.join(FORMATS)}")
    if not kernel.available():
        print(f"attention: the CPU kernel is unavailable: {kernel.unavailable_reason()}", file=sys.stderr)
        return 1
    require_plotting(a.plot, "python -m specdec.bench.attention")
    run(a.shape, contexts, formats, rows, a.repeats, a.out, a.plot or None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
