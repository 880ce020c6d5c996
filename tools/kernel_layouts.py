"""Draw docs/kernel-layouts.png: what the CPU kernels read, as they hold it (docs/cpu-kernels.md).

`python tools/kernel_layouts.py [--out PATH]`. A developer tool (matplotlib only); the figure is a
diagram of the layouts, no measurement.
"""
from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLUE, ORANGE, GREEN, GREY, RED = "#4c72b0", "#dd8452", "#55a868", "#c8c8c8", "#c44e52"


def _box(ax, x, y, w, h, color, text="", size=7, alpha=1.0):
    from matplotlib.patches import Rectangle
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="black", linewidth=0.5, alpha=alpha))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size)


def _panel(ax, title: str, note: str, note_at: tuple[float, float], ylim: tuple[float, float]) -> None:
    """A panel's title, its note on the right, its extent; no axes."""
    ax.set_title(title, fontsize=8, loc="left")
    ax.text(*note_at, note, fontsize=6.5, va="center")
    ax.set_xlim(-40, 150)
    ax.set_ylim(*ylim)
    ax.axis("off")


def weights(ax) -> None:
    """A Q4_K part under int4-a8: row-interleaved tiles, one stream; one tile; one run of its codes."""
    ax.text(-2, 5.35, "the part's stream", ha="right", va="center", fontsize=7)
    for i, label in enumerate(["f 0-15, sb 0", "sb 1", "sb 2", "...", "f 16-31, sb 0", "sb 1"]):
        _box(ax, i * 16, 5, 15, 0.7, BLUE if i == 0 else GREY, label, size=6, alpha=1.0 if i == 0 else 0.6)
    ax.text(-2, 3.35, "one tile: 2,368 B", ha="right", va="center", fontsize=7)
    parts = [("sub 128", 8, ORANGE), ("mins 128", 8, ORANGE), ("d", 4.5, GREEN), ("dmin", 4.5, GREEN)]
    x = 0.0
    for name, w, color in parts:
        _box(ax, x, 3, w, 0.7, color, name, size=5.5)
        x += w
    for g in range(8):  # codes: 8 groups of 4 runs of 64 bytes
        _box(ax, x + g * 9.2, 3, 8.9, 0.7, BLUE, f"group {g}" if g < 3 else "", size=5.5)
    ax.text(-2, 1.35, "one run: 64 B", ha="right", va="center", fontsize=7)
    for f in range(16):  # 16 features x 4 values
        _box(ax, f * 6, 1, 5.8, 0.7, BLUE if f % 2 == 0 else "#7f9fd0", f"f{f}" if f < 4 or f == 15 else "", size=5.5)
    ax.annotate("", xy=(x + 4.6, 2.95), xytext=(48, 1.75), arrowprops=dict(arrowstyle="<-", linewidth=0.6))
    _panel(ax, "weights: a Q4_K part under int4-a8, as row-interleaved tiles of 16 features x 256 values",
           "a lane a feature: 4 bytes = values 4i..4i+3 (low\nnibbles) and 16+4i.. (high) of one group\n\n"
           "one vpdpbusd: the run's 64 codes x 4 bytes of x\nbroadcast = 64 multiply-adds, any row count\n\n"
           "per row and feature, exact in int32:\nS = Σ_g sc_g · (q_g · xq_g), M = Σ_g m_g · Σ xq_g;\n"
           "acc -= dmin·dx·M; acc += d·dx·S", (104, 3.0), (0.3, 6.0))


def activations(ax) -> None:
    """A row tile: up to 8 rows rounded to int8 once per layer input, read for every feature."""
    for r in range(8):
        y = 7 - r
        ax.text(-2, y + 0.35, f"row {r}", ha="right", va="center", fontsize=6.5)
        for j in range(3):
            _box(ax, j * 34, y, 30, 0.7, RED if j == 1 else GREY, "xq: 256 int8" if j == 1 and r == 0 else "",
                 alpha=1.0 if j == 1 else 0.5)
            _box(ax, j * 34 + 30.5, y, 2.5, 0.7, GREEN if j == 1 else GREY, alpha=1.0 if j == 1 else 0.5)
    _panel(ax, "activations: a tile of up to 8 rows (a verification's k + 1), rounded once per layer input",
           "per row and super-block: 256 codes, dx = max|x| / 127 (green)\n"
           "and 8 group sums Σ xq_g (for the minimums)\n\n"
           "the tile's codes are decoded once per group\nfor all its rows: 8 rows read the weights once",
           (104, 4), (-0.5, 8.5))


def kv_cache(ax) -> None:
    """One layer's K (or V) cache, head-major, and the three row formats."""
    for h in range(2):
        y = 3.2 - 1.6 * h
        ax.text(-2, y + 0.35, f"KV head {h} (thread {h})", ha="right", va="center", fontsize=7)
        for t in range(12):
            _box(ax, t * 7.5, y, 7, 0.7, BLUE if t < 9 else GREY, f"slot {t}" if t < 3 else "", size=5.5,
                 alpha=1.0 if t < 9 else 0.5)
        ax.annotate("", xy=(9 * 7.5 - 1, y - 0.2), xytext=(0, y - 0.2),
                    arrowprops=dict(arrowstyle="->", linewidth=0.8))
    rows = [("float32", 512, BLUE), ("float16", 256, ORANGE), ("int8 + scales", 144, RED)]
    for i, (name, nbytes, color) in enumerate(rows):
        y = 3.4 - i * 1.1
        ax.text(100, y + 0.35, name, ha="right", va="center", fontsize=7)
        _box(ax, 101, y, nbytes / 512 * 40, 0.7, color, f"{nbytes} B", size=6)
        if name.startswith("int8"):
            _box(ax, 101 + 128 / 512 * 40, y, 16 / 512 * 40, 0.7, GREEN)
    _panel(ax, "K/V cache, one layer: [num_kv_heads, slots, row], a KV head's context one stream per thread",
           "one row = one token's head (d = 128); int8: 128 codes, then a\nfloat32 scale max|x| / 127 per 32 "
           "values; read in blocks of\n32 rows, widened once to float32 for every query head", (101, 0.0), (-1, 4.4))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "docs" / "kernel-layouts.png"))
    a = p.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(3, 1, figsize=(10, 8.5), gridspec_kw={"height_ratios": [6.5, 9, 5.5]})
    weights(axes[0])
    activations(axes[1])
    kv_cache(axes[2])
    fig.tight_layout()
    out = Path(a.out)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".png")
    os.close(fd)
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, out)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
