"""CPU weights in transparent huge pages.

A decode step streams every weight once. Read through the pack cache's memory map, they sit in 4 KiB
pages: a gigabyte is 262,144 of them, and the step spends part of its time walking page tables. Copied
once at load into anonymous memory advised MADV_HUGEPAGE, they sit in 2 MiB pages, 512 times fewer (the
1.5B target's one-row step ran 1.19x faster on a Xeon, docs/performance.md). The price: the copy is
private to the process (two processes no longer share the file's pages) and loading copies the bytes once.
Where the kernel offers no transparent huge pages, the weights stay mapped.
"""
from __future__ import annotations

import mmap
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from specdec.quant.packed import QuantLinear

THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
HUGE_PAGE = 2 << 20
ALIGN = 4096  # each tensor starts on its own page (and so on a cache line)


def available() -> bool:
    """Whether anonymous memory can be advised into transparent huge pages here (Linux, THP not `never`)."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP_ENABLED.read_text()
    except OSError:
        return False


def _tensors(weights: dict[str, object]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for w in weights.values():
        if isinstance(w, QuantLinear):
            w.map_tensors(lambda t: found.append(t) or t)
        elif isinstance(w, torch.Tensor):
            found.append(w)
    return found


def arena(nbytes: int) -> torch.Tensor:
    """nbytes of anonymous memory advised MADV_HUGEPAGE, starting on a huge-page boundary, as uint8. The
    tensors viewing it keep the mapping alive."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(region, dtype=torch.uint8)
    skip = -raw.data_ptr() % HUGE_PAGE
    return raw[skip:skip + nbytes]


def into_huge_pages(weights: dict[str, object]) -> dict[str, object]:
    """The same weights, every CPU tensor copied into one huge-page arena (the same values and shapes;
    a tensor shared by several entries stays shared). Unchanged where huge pages are not available."""
    tensors = [t for t in _tensors(weights) if t.device.type == "cpu"]
    if not tensors or not available():
        return weights
    unique = {t.data_ptr(): t for t in tensors}
    sizes = {p: -(-t.numel() * t.element_size() // ALIGN) * ALIGN for p, t in unique.items()}
    block = arena(sum(sizes.values()))
    moved: dict[int, torch.Tensor] = {}
    offset = 0
    for p, t in unique.items():
        n = t.numel() * t.element_size()
        moved[p] = block[offset:offset + n].view(t.dtype).view(t.shape).copy_(t)
        offset += sizes[p]
    move: Callable[[torch.Tensor], torch.Tensor] = lambda t: moved.get(t.data_ptr(), t)  # noqa: E731
    return {name: w.map_tensors(move) if isinstance(w, QuantLinear) else move(w) if isinstance(w, torch.Tensor)
            else w for name, w in weights.items()}
