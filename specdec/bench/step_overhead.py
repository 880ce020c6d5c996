"""`python -m specdec.bench.step_overhead`: how much of an engine step is not model forwards, and where it goes.

Arms, each its own engine, run one after the other:
- plain: one greedy request of the code_gen set, no speculation; plain_sampled: the same sampled
  (temperature 0.7, top-p 0.95, seed 0, Gumbel-coupled as by default);
- draft: the same request with the draft model at a fixed k (every step drafts);
- draft_sampled: the same, sampled as plain_sampled;
- draft_loop, draft_sampled_loop: the two with the draft chain off (`KernelOptions.draft_chain`): one
  engine round trip a draft position, each pick on the Python side;
- suffix_batch: 8 sampled requests (temperature 0.8, top-p 0.95, seeds 0-7) of the code-editing set
  with suffix drafts up to 16, where lookups hit and the verifier's vectorised path carries the load.
Every part of a step is a wrapped call timed by its self time (bench/phase_timer.py), so the parts
add up to the step. The forwards are the target's and the draft's model forwards and output
layers; everything else (proposing, scheduling, batch building, verification, bookkeeping) is the
overhead. One step in the middle of each run is repeated under the PyTorch profiler for its peak of
newly allocated CPU memory. JSON (median share with its min-max over decode steps, and the parts'
self time per step) and a PNG of the parts.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from specdec.bench.phase_timer import PhaseTimer
from specdec.config import (CacheConfig, ControllerConfig, EngineConfig, ModelConfig, SchedulerConfig,
                            SpeculativeConfig)
from specdec.engine import LLMEngine
from specdec.extras import require_plotting
from specdec.fileio import atomic_write_text
from specdec.prompts import read_set
from specdec.request import SpecOptions
from specdec.sampling_params import SamplingParams

ARMS = ("plain", "plain_sampled", "draft", "draft_sampled", "draft_loop", "draft_sampled_loop", "suffix_batch")
# a greedy draft's positions past the first run in one C++ call (ModelRunner.draft_chain): its forwards,
# output layers and picks, timed as one part
FORWARDS = ("target forward", "target output layer", "draft forward", "draft output layer",
            "draft chain (forwards, output layers, picks)")


def _engine(arm: str, target: str, draft: str, k: int) -> LLMEngine:
    batch = 8 if arm == "suffix_batch" else 1
    # the draft arms draft every step: no health check falls back to plain decoding
    drafting = SpeculativeConfig(method="draft_model", draft_model=draft, num_speculative_tokens=k, policy="fixed",
                                 controller=ControllerConfig(acceptance_threshold=0.0))
    spec = {"plain": None, "plain_sampled": None,
            "suffix_batch": SpeculativeConfig(method="suffix", num_speculative_tokens=min(k, 16))}
    spec = spec[arm] if arm in spec else drafting
    config = EngineConfig(model=ModelConfig(model=target),
                          cache=CacheConfig(target_cache_blocks=batch * 64),
                          scheduler=SchedulerConfig(max_batch_size=batch, max_num_batched_tokens=4096),
                          speculative=spec)
    engine = LLMEngine(config, progress=False)
    if arm.endswith("_loop"):
        for proposer in engine.speculator.proposers.values():
            runner = getattr(proposer, "runner", None)  # the draft model's (n-gram lookups have none)
            if runner is not None:
                runner.model.options = dataclasses.replace(runner.model.options, draft_chain=False)
    return engine


def _requests(engine: LLMEngine, arm: str, max_tokens: int, k: int) -> None:
    if arm != "suffix_batch":
        ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": read_set("code_gen")[0]}])
        sampled = {"temperature": 0.7, "top_p": 0.95, "seed": 0} if "sampled" in arm else {}
        engine.add_request(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampled))
        return
    texts = read_set("code_edit")
    for i in range(8):
        ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": texts[i % len(texts)]}])
        params = SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(ids, params, speculative=SpecOptions(method="suffix", max_k=k))


def _instrument(engine: LLMEngine) -> PhaseTimer:
    """Wrap the step's parts; a proposer with its own runner (a draft model) gets its parts timed too."""
    timer = PhaseTimer()
    parts = [(engine, "step", "engine glue"), (engine, "_commit", "commit (append, stops, KV)"),
             (engine.scheduler, "schedule", "scheduler"), (engine.verifier, "verify", "verify"),
             (engine.output_processor, "output", "outputs (detokenize)"),
             (engine.runner, "execute", "target batch building"),
             (engine.runner.model, "forward", "target forward"),
             (engine.runner.model, "compute_logits", "target output layer")]
    spec = engine.speculator
    if spec is not None:
        parts += [(spec, "propose", "propose (planning, sampling drafts)"), (spec, "poll", "speculator poll"),
                  (spec, "verified", "speculator verified"), (spec, "end_step", "speculator end step (costs)")]
        for proposer in spec.proposers.values():
            runner = getattr(proposer, "runner", None)
            if runner is not None:
                parts += [(runner, "execute", "draft batch building"), (runner.model, "forward", "draft forward"),
                          (runner.model, "compute_logits", "draft output layer"),
                          (runner, "draft_chain", "draft batch building"),
                          (runner.model, "draft_chain", FORWARDS[-1])]
            vocab = getattr(proposer, "request_vocab", None)
            if vocab is not None:  # the output layer's rows of each request's own tokens
                parts += [(vocab, "own_scores", "draft output layer")]
    for obj, attr, name in parts:
        timer.wrap(obj, attr, name)
    return timer


def _peak_bytes(engine: LLMEngine) -> int:
    """Peak of CPU memory allocated during one step beyond what was live before it."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        engine.step()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    return max(totals, default=0)


def run_arm(arm: str, target: str, draft: str, k: int, max_tokens: int) -> dict:
    engine = _engine(arm, target, draft, k)
    _requests(engine, arm, 16, k)          # warm-up: kernels, thread tuning, the draft's first forwards
    while engine.has_unfinished():
        engine.step()
    timer = _instrument(engine)
    _requests(engine, arm, max_tokens, k)
    steps, peak = [], None
    while engine.has_unfinished():
        if peak is None and len(steps) == 8:
            peak = _peak_bytes(engine)
            continue
        before = timer.snapshot()
        t0 = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t0
        parts = timer.since(before)      # engine.step is wrapped too: they add up to the step
        steps.append({"seconds": sum(parts.values()), "wall_seconds": wall,
                      "forward_seconds": sum(parts.get(n, 0.0) for n in FORWARDS), "parts": parts})
    return _summary(arm, engine, k, max_tokens, steps[2:], peak)   # the first steps prefill


def _summary(arm: str, engine: LLMEngine, k: int, max_tokens: int, decode: list[dict], peak: int | None) -> dict:
    share = [1.0 - s["forward_seconds"] / s["seconds"] for s in decode]
    total = sum(s["seconds"] for s in decode)
    names = sorted({n for s in decode for n in s["parts"]})
    parts = {n: sum(s["parts"].get(n, 0.0) for s in decode) for n in names}
    stats = engine.stats().counters
    return {"arm": arm, "model": engine.config.model.model, "precision": engine.precision,
            "k": 0 if arm.startswith("plain") else k, "max_tokens": max_tokens, "steps": len(decode),
            "step_ms_median": 1e3 * statistics.median(s["seconds"] for s in decode),
            "overhead_share_median": statistics.median(share),
            "overhead_share_min": min(share), "overhead_share_max": max(share),
            "overhead_share_whole": 1.0 - sum(s["forward_seconds"] for s in decode) / total,
            "overhead_seconds_total": total - sum(s["forward_seconds"] for s in decode),
            "step_seconds_total": total,
            "parts_ms_per_step": {n: 1e3 * v / len(decode) for n, v in sorted(parts.items(), key=lambda x: -x[1])},
            "parts_share": {n: v / total for n, v in parts.items()},
            "peak_step_bytes": peak, "generated_tokens": stats.generated_tokens,
            "target_forwards": stats.target_forwards,
            "per_step": [{k: v for k, v in s.items() if k != "parts"} for s in decode]}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4))
    names = sorted({n for r in results for n in r["parts_share"] if n not in FORWARDS})
    for i, r in enumerate(results):
        left = 0.0
        for j, n in enumerate(names):
            width = 100 * r["parts_share"].get(n, 0.0)
            ax.barh(i, width, left=left, color=plt.cm.tab20(j % 20), label=n if i == 0 else None)
            left += width
    ax.set_yticks(range(len(results)), [r["arm"] for r in results])
    ax.set_xlabel("% of the step outside the forwards, by part (self time)")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specdec.bench.step_overhead", description=__doc__.split("\n")[0])
    ap.add_argument("--arms", default="plain,draft", help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("-k", type=int, default=4, help="drafts a step (suffix_batch: the most a step)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--machine", default=None, help="the machine, named in the report")
    ap.add_argument("--out", default="bench-step-overhead.json")
    a = ap.parse_args(argv)
    arms = a.arms.split(",")
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        ap.error(f"unknown arm(s) {', '.join(unknown)}; choose from {', '.join(ARMS)}")
    require_plotting("png", "python -m specdec.bench.step_overhead")
    if a.threads:
        torch.set_num_threads(a.threads)
    results = []
    for arm in arms:
        print(f"[{arm}] ...", file=sys.stderr, flush=True)
        results.append(run_arm(arm, a.model, a.draft, a.k, a.max_tokens))
    settings = [f"--arms {a.arms}", f"-k {a.k}", f"--max-tokens {a.max_tokens}"]
    settings += [f"--{name} {value}" for name, value in (("model", a.model), ("draft", a.draft))
                 if value != ap.get_default(name)]
    report = {"date": time.strftime("%Y-%m-%d"), "machine": a.machine,
              "command": "python -m specdec.bench.step_overhead " + " ".join(settings), "arms": results}
    out = Path(a.out)
    atomic_write_text(out, json.dumps(report, indent=1) + "\n")
    plot(results, out.with_suffix(".png"))
    for r in results:
        print(f"{r['arm']:>13}: step {r['step_ms_median']:.1f} ms, outside the forwards "
              f"{100 * r['overhead_share_median']:.1f} % [{100 * r['overhead_share_min']:.1f}-"
              f"{100 * r['overhead_share_max']:.1f}] (whole run {100 * r['overhead_share_whole']:.1f} %)")
        for n, ms in r["parts_ms_per_step"].items():
            print(f"{'':>15}{n:<40}{ms:8.2f} ms  {100 * r['parts_share'][n]:5.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
