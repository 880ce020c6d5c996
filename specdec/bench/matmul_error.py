"""`specdec bench matmul`: each quantized matrix product's error under int8 activations (int4-a8), on the
real model's weights and activations, against float64.

Activations come from the weight-only `int4` model (float32 activations) teacher-forced over a chunk of
the `specdec kld` corpus; each linear layer's inputs are recorded. Per part of each layer (q, k, v, o,
gate|up, down: one GGUF tensor each), over the rows from `--first` on, the relative error
||y - W x|| / ||W x|| (float64, W dequantized exactly) of:
- `exact`: the kernel's arithmetic, w . x_rounded: the offsets (Q4_K's -dmin * m) multiply the same rounded
  x as the codes, as llama.cpp's Q8_K `bsums` do;
- `unrounded`: the offsets multiplying the unrounded x's sums, which the kernels did before, so the
  rounding error was weighted by the unsigned codes s * q instead of the centred weights.
The kernel's own output is checked against `exact` on the way (`kernel_vs_exact`).
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

from specdec.quant.options import KernelOptions
from specdec.quant.packed import QuantLinear, QuantTensor, quantize_act

PARTS = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
         "down": ("ffn_down",)}


class _Recording(QuantLinear):
    """A layer that keeps a copy of every input it is called with."""

    def __init__(self, lin: QuantLinear) -> None:
        super().__init__(lin.parts, lin.act)
        self.inputs: list[torch.Tensor] = []

    def __call__(self, x: torch.Tensor, options: KernelOptions = KernelOptions()) -> torch.Tensor:
        self.inputs.append(x.clone())
        return super().__call__(x, options)


def _qtype(p: QuantTensor) -> str:
    return {(4, 32, True): "Q4_K", (6, 16, True): "Q6_K", (8, 32, True): "Q5_K", (4, 32, False): "Q4_0/Q4_1",
            (8, 32, False): "Q5_0/Q8_0"}.get((p.bits, p.group, p.super_scale is not None), f"{p.bits}/{p.group}")


def part_errors(p: QuantTensor, x: torch.Tensor) -> dict:
    """x: [rows, in] float32 -> the relative errors of the int8-activation forms of x @ dequant(W).T."""
    w = p.dequantize().double()
    xr = quantize_act(x, p.act8_block, 8).double()
    true, exact = x.double() @ w.t(), xr @ w.t()
    norm = true.norm()
    out = {"qtype": _qtype(p), "exact": float((exact - true).norm() / norm)}
    if p.offset is not None:
        xs = lambda v: v.view(v.shape[0], -1, p.group).sum(-1)  # noqa: E731
        old = exact + (xs(x.double()) - xs(xr)) @ p.offset.double().t()
        out["unrounded"] = float((old - true).norm() / norm)
    else:
        out["unrounded"] = out["exact"]  # no offsets: both forms are the same product
    out["kernel_vs_exact"] = float((QuantLinear([p], 8)(x).double() - exact).norm() / exact.norm())
    return out


def _record(a) -> tuple[dict[str, _Recording], list[int]]:
    from specdec.bench.kld import chunks, read_corpus
    from specdec.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from specdec.llm import LLM
    cfg = EngineConfig(model=ModelConfig(model=a.model, precision="int4", num_threads=a.threads),
                       cache=CacheConfig(target_cache_blocks=a.context // 16 + 8, enable_prefix_caching=False),
                       scheduler=SchedulerConfig(max_num_batched_tokens=a.context))
    llm = LLM(config=cfg, progress=False)
    model = llm.engine.runner.model
    model.options = KernelOptions(fused_decoder=False)  # the Python layer loop, whose linear calls we see
    rec = {}
    for name, t in list(model.w.items()):
        if isinstance(t, QuantLinear) and name.startswith("layers.") and name.rsplit(".", 1)[1] in PARTS:
            rec[name] = model.w[name] = _Recording(t)
    work = chunks(llm.tokenizer, read_corpus(), a.context)
    ids = next(ids for kind, ids in work if kind == a.kind)
    llm.engine.teacher_logits(ids[:1], ids[1:])
    return rec, ids


def run_matmul_bench(a) -> dict:
    """Per layer and part, the two forms' relative errors; a summary per (part, block type)."""
    from tqdm import tqdm
    rec, ids = _record(a)
    layers = []
    for name, lin in tqdm(rec.items(), desc="matmul error", unit="layer", file=sys.stderr):
        x = torch.cat(lin.inputs)[a.first:]
        for tensor, p in zip(PARTS[name.rsplit(".", 1)[1]], lin.parts):
            if isinstance(p, QuantTensor):
                layers.append({"layer": int(name.split(".")[1]), "part": tensor, **part_errors(p, x)})
    result = {"mode": "matmul", "model": a.model, "kind": a.kind, "rows": len(ids) - 1 - a.first,
              "first": a.first, "layers": layers, "summary": summarize(layers)}
    return result


def summarize(layers: list[dict]) -> list[dict]:
    """Per (part, block type): median relative error of each form over the layers, and the ratio's range."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in layers:
        groups.setdefault((r["part"], r["qtype"]), []).append(r)
    out = []
    for (part, qtype), rows in groups.items():
        ratios = [r["unrounded"] / r["exact"] for r in rows]
        out.append({"part": part, "qtype": qtype, "layers": len(rows),
                    "unrounded": statistics.median(r["unrounded"] for r in rows),
                    "exact": statistics.median(r["exact"] for r in rows),
                    "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                    "kernel_vs_exact_max": max(r["kernel_vs_exact"] for r in rows)})
    return out


def table(result: dict) -> str:
    head = ("| tensor | type | layers | rel. error, offsets on unrounded x | rel. error, exact (w . x_rounded) | "
            "ratio, median (min-max) |\n|---|---|---|---|---|---|\n")
    return head + "\n".join(
        f"| {s['part']} | {s['qtype']} | {s['layers']} | {s['unrounded']:.2e} | {s['exact']:.2e} | "
        f"{s['ratio_median']:.2f} ({s['ratio_min']:.2f}-{s['ratio_max']:.2f}) |" for s in result["summary"])


def cmd_matmul(a) -> None:
    from specdec.fileio import atomic_write_text
    if a.first < 0 or a.first >= a.context - 1:
        raise ValueError(f"--first must be between 0 and --context - 2, got {a.first}")
    result = run_matmul_bench(a)
    atomic_write_text(Path(a.out), json.dumps(result, indent=1))
    print(table(result))
