"""`specdec bench serve`: the serving loop under Poisson arrivals, with and without speculation.

For each arrival rate, every arm (plain decoding, and each speculative configuration asked for)
receives the same requests at the same arrival times through the server's AsyncEngine (the code
path behind the HTTP routes, without the socket). Arms share the loaded weights and run one after
another per rate, so a noisy machine hits them alike. Prefix caching is off: each request pays its
prefill, as unrelated traffic would. Reports throughput, TTFT / TPOT / end-to-end p50 and p99 and
acceptance; writes JSON and a PNG plot.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

from specdec.contention import Contention
from specdec.extras import require_plotting
from specdec.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from specdec.fileio import atomic_write_text
from specdec.prompts import read_set
from specdec.sampling_params import SamplingParams


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _arms(a) -> dict[str, SpeculativeConfig | None]:
    arms: dict[str, SpeculativeConfig | None] = {"plain": None}
    for name in a.arms.split(","):
        if name == "plain":
            continue
        if name in ("ngram", "suffix"):
            arms[name] = SpeculativeConfig(method=name, num_speculative_tokens=a.k, policy=a.policy)
        elif name in ("draft", "hybrid"):
            arms[name] = SpeculativeConfig(method="draft_model" if name == "draft" else name, draft_model=a.draft,
                                           num_speculative_tokens=a.k, policy=a.policy)
        else:
            raise ValueError(f"unknown serve-bench arm {name!r} (plain, draft, ngram, suffix, hybrid)")
    return arms


async def _run_rate(engine, prompts: list[list[int]], arrivals: list[float], params: SamplingParams) -> dict:
    from specdec.server.async_engine import AsyncEngine
    ae = AsyncEngine(lambda: engine)
    ae.start()
    while not ae.ready:
        await asyncio.sleep(0.01)
    records: list[dict] = []
    t0 = time.perf_counter()

    async def one(ids: list[int], at: float) -> None:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        submitted = time.perf_counter()
        first = last = None
        stream = await ae.submit(ids, params)
        async for out in stream:
            if first is None and out.token_ids:
                first = time.perf_counter()
            last = out
        end = time.perf_counter()
        n = len(last.token_ids)
        records.append({"ttft": first - submitted, "e2e": end - submitted, "tokens": n,
                        "tpot": (end - first) / (n - 1) if n > 1 else None,
                        "drafted": last.stats.drafted_tokens, "accepted": last.stats.accepted_tokens,
                        "mean_accepted_length": last.stats.mean_accepted_length})

    await asyncio.gather(*(one(ids, at) for ids, at in zip(prompts, arrivals)))
    wall = time.perf_counter() - t0
    ae.shutdown()
    ttft = [r["ttft"] for r in records]
    tpot = [r["tpot"] for r in records if r["tpot"] is not None]
    e2e = [r["e2e"] for r in records]
    drafted = sum(r["drafted"] for r in records)
    tokens = sum(r["tokens"] for r in records)
    return {"requests": len(records), "wall_seconds": wall, "output_tokens": tokens,
            "throughput_tokens_per_second": tokens / wall, "throughput_requests_per_second": len(records) / wall,
            "ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99),
            "tpot_p50": percentile(tpot, 0.5), "tpot_p99": percentile(tpot, 0.99),
            "e2e_p50": percentile(e2e, 0.5), "e2e_p99": percentile(e2e, 0.99),
            "acceptance_rate": sum(r["accepted"] for r in records) / drafted if drafted else None,
            "mean_accepted_length": statistics.mean(r["mean_accepted_length"] for r in records)}


def run_serve_bench(a) -> dict:
    require_plotting(a.plot, "specdec bench serve")
    from tqdm import tqdm

    from specdec.bench.weights import resolve_precisions
    from specdec.engine import LLMEngine
    from specdec.models.loader import load_model
    from specdec.models.registry import default_draft

    rates = [float(r) for r in a.rates.split(",")]
    if any(r <= 0 for r in rates):
        raise ValueError("arrival rates must be > 0 requests/s")
    arms = _arms(a)
    precision, draft_precision = resolve_precisions(a.model, a.precision, a.device, a.draft, a.draft_precision)
    target = load_model(a.model, precision, a.device, pull=True)
    with_draft = [n for n in ("draft", "hybrid") if n in arms]
    for name in with_draft:
        arms[name].draft_model = arms[name].draft_model or default_draft(target.name)
        if arms[name].draft_model is None:
            raise ValueError(f"{target.name} has no default draft: pass --draft or drop the draft and hybrid arms")
    draft = (load_model(arms[with_draft[0]].draft_model, draft_precision, a.device, pull=True)
             if with_draft else None)
    tok = target.tokenizer
    pool = [p for s in a.sets.split(",") for p in read_set(s)]
    if not a.in_order:
        random.Random(a.seed).shuffle(pool)
    engines = {}
    for name, spec in arms.items():
        cfg = EngineConfig(model=ModelConfig(model=target.name, precision=precision, device=a.device,
                                             num_threads=a.threads),
                           cache=CacheConfig(enable_prefix_caching=False),
                           scheduler=SchedulerConfig(max_batch_size=a.max_batch_size), speculative=spec)
        engines[name] = LLMEngine(cfg, progress=False, loaded=target, draft_loaded=draft)
    params = SamplingParams(max_tokens=a.max_tokens, ignore_eos=not a.until_eos)
    results: dict[str, dict[str, dict]] = {name: {} for name in arms}
    bar = tqdm(total=len(rates) * len(arms), desc="bench serve", file=sys.stderr)
    for ri, rate in enumerate(rates):
        rng = random.Random(a.seed + ri)
        chosen = pool[ri * a.num_requests:(ri + 1) * a.num_requests] or pool[: a.num_requests]
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
                   [: a.max_prompt_tokens] for p in chosen]
        at, arrivals = 0.0, []
        for _ in prompts:
            at += rng.expovariate(rate)
            arrivals.append(at)
        for name in arms:
            with Contention() as busy:
                results[name][str(rate)] = asyncio.run(_run_rate(engines[name], prompts, arrivals, params))
            results[name][str(rate)].update(load_average=busy.load_average, competing_cores=busy.cores,
                                            noisy=busy.noisy)
            bar.update(1)
    bar.close()
    report = {"model": target.name, "draft": draft.name if draft else None, "precision": precision,
              "draft_precision": draft.precision if draft else None,
              "device": a.device, "k": a.k, "policy": a.policy, "max_tokens": a.max_tokens,
              "num_requests_per_rate": a.num_requests, "max_batch_size": a.max_batch_size, "rates": rates,
              "sets": a.sets, "in_order": a.in_order, "until_eos": a.until_eos,
              # one engine per arm serves every rate in turn: shared caches carry from one rate to the next
              "session": "one engine per arm across all rates", "results": results}
    atomic_write_text(Path(a.out), json.dumps(report, indent=1))
    if a.plot:
        plot(report, Path(a.plot))
    for name in arms:
        for rate in rates:
            r = results[name][str(rate)]
            acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
            print(f"{name:6} rate {rate:6.3f}/s: {r['throughput_tokens_per_second']:6.2f} tok/s, "
                  f"ttft p50 {r['ttft_p50']:.2f}s p99 {r['ttft_p99']:.2f}s, tpot p50 {r['tpot_p50'] or 0:.3f}s "
                  f"p99 {r['tpot_p99'] or 0:.3f}s, acceptance {acc}", file=sys.stderr)
    print(f"wrote {a.out}" + (f" and {a.plot}" if a.plot else ""), file=sys.stderr)
    return report


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = report["rates"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for name, by_rate in report["results"].items():
        rows = [by_rate[str(r)] for r in rates]
        axes[0].plot(rates, [x["throughput_tokens_per_second"] for x in rows], "o-", label=name)
        axes[1].plot(rates, [x["ttft_p50"] for x in rows], "o-", label=f"{name} p50")
        axes[1].plot(rates, [x["ttft_p99"] for x in rows], "x--", label=f"{name} p99")
        axes[2].plot(rates, [x["tpot_p50"] for x in rows], "o-", label=f"{name} p50")
        axes[2].plot(rates, [x["tpot_p99"] for x in rows], "x--", label=f"{name} p99")
    for ax, title in zip(axes, ("output tokens/s", "time to first token (s)", "time per output token (s)")):
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"{report['model']} ({report['precision']}), draft {report['draft']}, k={report['k']} "
                 f"{report['policy']}, {report['max_tokens']} tokens/request", fontsize=9)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)
