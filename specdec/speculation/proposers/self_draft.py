"""Self-speculation: the target, with a span of middle layers skipped, is its own draft.

Draft & Verify (Zhang et al. 2023) and SWIFT (Xia et al. 2024) show that skipping intermediate
layers (keeping the first and last few, which map tokens in and out) drafts far better than cutting
the stack short without a trained exit. The draft shares the target's weights (no second model in
memory) and has its own KV pool; rejection sampling keeps the output exactly the target's.

Draft references: `self:skip=A-B[,C-D...]` skips those layers (inclusive); `self:auto` uses the span
`choose_skip_layers` measured best for this model and precision, cached under $SPECDEC_HOME.
Choosing: teacher-force calibration text (CPython standard library source and docstrings, which
ship with every Python) through the full model and through each candidate, take the top-1
agreement of the two as the acceptance rate a of greedy drafting, and keep the candidate whose
predicted speedup (1 - a^(k+1)) / ((1 - a) (1 + k c)), with c the fraction of layers kept, is best.
"""
from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

import torch

from specdec.config import specdec_home
from specdec.speculation.policy import predicted_speedup

PREFIX = "self"
_KEEP_EDGE = 2  # layers always kept at each end
_CALIBRATION_TOKENS = 384


def is_self_draft(reference: str | None) -> bool:
    return reference is not None and (reference == PREFIX or reference.startswith(PREFIX + ":"))


def parse_skip(reference: str, num_layers: int) -> frozenset[int] | None:
    """`self:skip=8-19,22` -> those layers; `self:auto` / `self` -> None (measure). Raises ValueError."""
    spec = reference[len(PREFIX) + 1:] if ":" in reference else "auto"
    if spec == "auto":
        return None
    if not spec.startswith("skip="):
        raise ValueError(f"self-draft {reference!r}: expected self:skip=A-B[,C-D] or self:auto")
    layers: set[int] = set()
    for part in spec[5:].split(","):
        lo, _, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"self-draft {reference!r}: {part!r} is not a layer or a range") from None
        if not 0 <= a <= b < num_layers:
            raise ValueError(f"self-draft {reference!r}: layers must lie in 0..{num_layers - 1}")
        layers.update(range(a, b + 1))
    if len(layers) >= num_layers:
        raise ValueError(f"self-draft {reference!r} skips every layer")
    return frozenset(layers)


def format_skip(layers: frozenset[int]) -> str:
    spans, run = [], []
    for n in sorted(layers):
        if run and n != run[-1] + 1:
            spans.append(run)
            run = []
        run.append(n)
    if run:
        spans.append(run)
    return f"{PREFIX}:skip=" + ",".join(f"{r[0]}-{r[-1]}" for r in spans)


def candidates(num_layers: int) -> list[frozenset[int]]:
    """Contiguous middle spans of a quarter, a third and half of the layers, at several offsets."""
    inner = range(_KEEP_EDGE, num_layers - _KEEP_EDGE)
    out: list[frozenset[int]] = []
    for size in sorted({max(1, num_layers // 4), max(1, num_layers // 3), max(1, num_layers // 2)}):
        if size > len(inner):
            continue
        starts = sorted({inner.start, (inner.start + inner.stop - size) // 2, inner.stop - size})
        out += [frozenset(range(s, s + size)) for s in starts]
    return list(dict.fromkeys(out))


def calibration_tokens(tokenizer, n: int = _CALIBRATION_TOKENS) -> list[int]:
    root = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((root / f).read_text(encoding="utf-8") for f in ("textwrap.py", "heapq.py", "bisect.py")
                   if (root / f).exists())
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < 32:
        raise RuntimeError("self:auto needs the Python standard library's source for calibration")
    return ids[:n]


@torch.inference_mode()
def _top1(loaded, skip: frozenset[int], ids: list[int]) -> torch.Tensor:
    from specdec.models.llama import LlamaModel
    from specdec.quant.attention import AttentionMetadata, SeqAttention
    from specdec.quant.layers import pad_rows
    cfg, dev = loaded.config, loaded.weights["norm"].device
    model = LlamaModel(cfg, loaded.weights, len(ids) + 8, dev, skip)
    n = pad_rows(len(ids), model.row_align)
    caches = [(torch.zeros(cfg.num_kv_heads, n, cfg.head_dim, dtype=model.dtype, device=dev),
               torch.zeros(cfg.num_kv_heads, n, cfg.head_dim, dtype=model.dtype, device=dev))
              for _ in range(cfg.num_layers)]
    x = torch.tensor(ids + [0] * (n - len(ids)), device=dev)
    slots = torch.arange(len(ids), device=dev)
    meta = AttentionMetadata(slots, [SeqAttention(0, len(ids), 0, slots)], n)
    hidden = model.forward(x, torch.arange(n, device=dev), meta, caches)
    return model.compute_logits(hidden)[: len(ids)].argmax(-1)


def choose_skip_layers(loaded, k: int = 3, progress: bool = True) -> dict:
    """Measure every candidate; returns {"reference": "self:skip=...", "table": [...], ...}."""
    cands = candidates(loaded.config.num_layers)
    if not cands:
        raise ValueError(f"self:auto: {loaded.name} has too few layers ({loaded.config.num_layers}) to skip "
                         f"any while keeping {_KEEP_EDGE} at each end; name them with self:skip=A-B")
    ids = calibration_tokens(loaded.tokenizer)
    full = _top1(loaded, frozenset(), ids)
    table = []
    for i, skip in enumerate(cands):
        agree = (_top1(loaded, skip, ids) == full).float().mean().item()
        c = 1 - len(skip) / loaded.config.num_layers
        table.append({"reference": format_skip(skip), "acceptance": agree, "cost_ratio": c,
                      "predicted_speedup": predicted_speedup([agree] * k, k, c, verify_cost=1.0)})
        if progress:
            print(f"self-draft {i + 1}/{len(cands)} {table[-1]['reference']}: top-1 agreement {agree:.3f}, "
                  f"predicted {table[-1]['predicted_speedup']:.2f}x", file=sys.stderr)
    best = max(table, key=lambda r: r["predicted_speedup"])
    return {"reference": best["reference"], "table": table, "calibration_tokens": len(ids), "k": k}


def resolve_auto(loaded, progress: bool = True) -> frozenset[int]:
    """The measured best span for this model file and precision (measured once, then cached)."""
    from specdec.fileio import atomic_write_text
    key = f"{loaded.sha256 or loaded.name}-{loaded.precision}"
    path = specdec_home() / "self-draft" / f"{key}.json"
    if path.exists():
        choice = json.loads(path.read_text())
    else:
        if progress:
            print(f"self:auto: measuring which layers {loaded.name} can skip (once)", file=sys.stderr)
        choice = choose_skip_layers(loaded, progress=progress)
        atomic_write_text(path, json.dumps(choice, indent=1))
    skip = parse_skip(choice["reference"], loaded.config.num_layers)
    assert skip is not None
    return skip
