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
    """One Q4_K part under int4-a8: five arrays, a feature's super-block j a segment of each."""
    arrays = [("codes [n, k/2] uint8", 128, BLUE, "128 B: 8 groups of 32 nibbles"),
              ("scales [n, k/32] int8", 8, ORANGE, "8 B"), ("minimums [n, k/32] uint8", 8, ORANGE, "8 B"),
              ("d [n, k/256] float32", 4, GREEN, "4 B"), ("dmin [n, k/256] float32", 4, GREEN, "4 B")]
    for i, (name, nbytes, color, note) in enumerate(arrays):
        y = 4 - i
        ax.text(-2, y + 0.35, name, ha="right", va="center", fontsize=7)
        for j in range(3):  # super-blocks j-1, j, j+1 of feature f
            w = 30 if nbytes == 128 else max(2.2, nbytes * 0.6)
            _box(ax, j * 34, y, w, 0.7, color if j == 1 else GREY, note if j == 1 and nbytes == 128 else "",
                 alpha=1.0 if j == 1 else 0.6)
            if j == 1 and nbytes < 128:
                ax.text(j * 34 + w + 0.8, y + 0.35, note, va="center", fontsize=6)
    ax.text(34 + 15, 5.2, "super-block j of feature f", ha="center", fontsize=7)
    _panel(ax, "weights: a Q4_K part under int4-a8, per output feature f and super-block j (256 weights)",
           "codes: byte i of a group holds values i and 16 + i\n\n"
           "one exact int32 sum per super-block and row:\n"
           "Σ_g sc_g · (q_g · xq_g), then d · dx · sum\n"
           "minus dmin · dx · Σ_g m_g · Σ xq_g\n\n"
           "a thread takes features in chunks;\neach feature's arrays are read in order,\n"
           "1 KB ahead of the line in use (prefetch)", (104, 2.4), (-0.5, 5.8))


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
    fig, axes = plt.subplots(3, 1, figsize=(10, 8.5), gridspec_kw={"height_ratios": [6, 9, 5.5]})
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
