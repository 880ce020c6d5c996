"""`python -m specdec.bench.step_overhead`: how much of a speculative step is not model forwards.

A batch of requests sampled (temperature, top-p, seeds) with suffix drafts (up to 16 per step) on
the code-editing prompts, where lookups hit. Every engine step is timed whole, and the target's
forwards inside it (the runner's execute) apart: the rest is proposing, scheduling, logits
processing, verification and bookkeeping. Model-free drafts cost no forward, so everything but
the target's forward is overhead. One step in the middle of the run is then repeated under the
PyTorch profiler for its peak of newly allocated CPU memory. JSON, with the median share and its
min-max over steps.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from specdec.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from specdec.engine import LLMEngine
from specdec.fileio import atomic_write_text
from specdec.request import SpecOptions
from specdec.sampling_params import SamplingParams

PROMPTS = Path(__file__).parent / "prompts" / "code_edit.jsonl"


def _engine(model: str, batch: int, k: int) -> LLMEngine:
    config = EngineConfig(model=ModelConfig(model=model),
                          cache=CacheConfig(target_cache_blocks=batch * 64),
                          scheduler=SchedulerConfig(max_batch_size=batch, max_num_batched_tokens=4096),
                          speculative=SpeculativeConfig(method="suffix", num_speculative_tokens=min(k, 16)))
    return LLMEngine(config, progress=False)


def _prompts(engine: LLMEngine, batch: int) -> list[str]:
    texts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    return [engine.tokenizer.apply_chat_template([{"role": "user", "content": texts[i % len(texts)]}])
            for i in range(batch)]


def _add(engine: LLMEngine, prompts: list[str], max_tokens: int, k: int) -> None:
    for i, ids in enumerate(prompts):
        params = SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(ids, params, speculative=SpecOptions(method="suffix", max_k=k))


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


def run(model: str, batch: int, k: int, max_tokens: int) -> dict:
    engine = _engine(model, batch, k)
    prompts = _prompts(engine, batch)
    _add(engine, prompts, 16, k)          # warm-up: the kernels, the suffix cache holds nothing yet
    while engine.has_unfinished():
        engine.step()
    forward = [0.0]
    execute = engine.runner.execute

    def timed(sched):
        t0 = time.perf_counter()
        out = execute(sched)
        forward[0] += time.perf_counter() - t0
        return out
    engine.runner.execute = timed
    _add(engine, prompts, max_tokens, k)
    steps, peak = [], None
    while engine.has_unfinished():
        if peak is None and len(steps) == 8:
            peak = _peak_bytes(engine)
            continue
        forward[0] = 0.0
        t0 = time.perf_counter()
        engine.step()
        total = time.perf_counter() - t0
        steps.append({"seconds": total, "forward_seconds": forward[0]})
    decode = steps[2:]   # the first steps prefill
    share = [1.0 - s["forward_seconds"] / s["seconds"] for s in decode]
    stats = engine.stats().counters
    return {"model": model, "precision": engine.precision, "batch": batch, "k": k, "max_tokens": max_tokens,
            "steps": len(decode), "overhead_share_median": statistics.median(share),
            "overhead_share_min": min(share), "overhead_share_max": max(share),
            "overhead_seconds_total": sum(s["seconds"] - s["forward_seconds"] for s in decode),
            "step_seconds_total": sum(s["seconds"] for s in decode),
            "peak_step_bytes": peak, "generated_tokens": stats.generated_tokens,
            "target_forwards": stats.target_forwards, "per_step": steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specdec.bench.step_overhead", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="bench-step-overhead.json")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    result = run(a.model, a.batch, a.k, a.max_tokens)
    atomic_write_text(Path(a.out), json.dumps(result, indent=1) + "\n")
    summary = {k: v for k, v in result.items() if k != "per_step"}
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
