"""`specdec bench`: plain decoding against speculative arms on the shipped prompt sets.

Every arm runs on the same loaded weights in one process; arms are interleaved per prompt and the
whole sweep repeats, so a noisy machine hits all arms alike. Reports per set and arm the median
tokens/s with min-max, the median per-prompt speedup over plain, acceptance and mean accepted
length; checks that greedy speculative output equals plain output; writes JSON and a PNG plot.
Each run logs the load average and the cores other processes took meanwhile (flagged `noisy`
above half a core).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from specdec.bench.contention import Contention
from specdec.cli import read_prompts_file
from specdec.config import CacheConfig, EngineConfig, ModelConfig, SpeculativeConfig
from specdec.models.weight_cache import atomic_write_text
from specdec.sampling_params import SamplingParams

PROMPTS_DIR = Path(__file__).parent / "prompts"
SETS = ("code_edit", "code_gen", "chat", "prose", "zh")
ARMS = {
    "plain": None,
    "draft_fixed": ("draft_model", "fixed"),
    "draft_cost_model": ("draft_model", "cost_model"),
    "ngram": ("ngram", "cost_model"),
    "ngram_fixed": ("ngram", "fixed"),
    # the draft model scoring a 32k-token sub-vocabulary (spec/subvocab.py)
    "draft_subvocab_fixed": ("draft_model", "fixed"),
    "draft_subvocab_cost_model": ("draft_model", "cost_model"),
}
SUBVOCAB_SIZE = 32768


def _arm_llm(name: str, a, target, draft):
    from specdec.llm import LLM
    spec = None
    if ARMS[name] is not None:
        method, policy = ARMS[name]
        spec = SpeculativeConfig(method=method, draft_model=draft.name if method == "draft_model" else None,
                                 num_speculative_tokens=a.k, policy=policy,
                                 draft_vocab_size=SUBVOCAB_SIZE if "subvocab" in name else None,
                                 draft_precision=draft.precision if draft else None)
    cfg = EngineConfig(model=ModelConfig(model=target.name, precision=a.precision, device=a.device,
                                         num_threads=a.threads),
                       cache=CacheConfig(target_cache_blocks=512, draft_cache_blocks=512), speculative=spec)
    return LLM(config=cfg, loaded=target, draft_loaded=draft if spec and spec.method == "draft_model" else None,
               progress=False)


def run_spec_bench(a) -> dict:
    from tqdm import tqdm

    from specdec.models.loader import load_model
    from specdec.spec.factory import default_draft

    arms = a.arms.split(",")
    unknown = set(arms) - set(ARMS)
    if unknown:
        raise ValueError(f"unknown arms {sorted(unknown)}; choose from {', '.join(ARMS)}")
    sets = a.sets.split(",")
    t0 = time.perf_counter()
    target = load_model(a.model, a.precision, a.device)
    load_seconds = time.perf_counter() - t0
    draft_name = a.draft or default_draft(target.name)
    needs_draft = any(ARMS[x] and ARMS[x][0] == "draft_model" for x in arms)
    if needs_draft and not draft_name:
        raise ValueError(f"{a.model} has no default draft: pass --draft or drop the draft arms")
    draft_precision = a.draft_precision or a.precision
    draft = load_model(draft_name, draft_precision, a.device) if needs_draft else None
    llms = {name: _arm_llm(name, a, target, draft) for name in arms}
    tok = target.tokenizer
    prompts = {s: [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
                   for p in read_prompts_file(str(PROMPTS_DIR / f"{s}.jsonl"))[: a.num_prompts]] for s in sets}
    params = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
    runs = []
    total = a.repeats * sum(len(v) for v in prompts.values()) * len(arms)
    bar = tqdm(total=total, desc="bench", file=sys.stderr)
    for rep in range(a.repeats):
        for s in sets:
            for i, ids in enumerate(prompts[s]):
                outs = {}
                for arm in arms:
                    with Contention() as busy:
                        out = llms[arm].generate([ids], params)[0]
                    outs[arm] = out
                    st = out.stats
                    runs.append({"set": s, "prompt": i, "repeat": rep, "arm": arm, "load_average": busy.load_average,
                                 "competing_cores": busy.cores, "noisy": busy.noisy, "tokens_per_second": st.tokens_per_second,
                                 "generated_tokens": st.generated_tokens, "seconds": st.seconds,
                                 "acceptance_rate": st.acceptance_rate,
                                 "mean_accepted_length": st.mean_accepted_length,
                                 "identical_to_plain": None})
                    bar.update(1)
                if "plain" in outs:
                    for r in runs[-len(arms):]:
                        r["identical_to_plain"] = outs[r["arm"]].token_ids == outs["plain"].token_ids
    bar.close()
    summary = _summarize(runs, sets, arms)
    report = {"model": target.name, "draft": draft.name if draft else None, "precision": a.precision,
              "draft_precision": draft.precision if draft else None,
              "device": a.device, "k": a.k, "max_tokens": a.max_tokens, "repeats": a.repeats,
              "num_prompts_per_set": a.num_prompts, "load_seconds": load_seconds,
              "noisy_runs": sum(r["noisy"] for r in runs), "summary": summary, "runs": runs}
    atomic_write_text(Path(a.out), json.dumps(report, indent=1))
    if a.plot:
        drafted = f", draft {draft.precision}" if draft and draft.precision != a.precision else ""
        plot(summary, sets, arms, Path(a.plot), f"{target.name} ({a.precision}{drafted}), k={a.k}, {a.max_tokens} tokens")
    _print_table(summary, sets, arms)
    print(f"{report['noisy_runs']} of {len(runs)} runs had competing processes (> 0.5 cores)", file=sys.stderr)
    print(f"wrote {a.out}" + (f" and {a.plot}" if a.plot else ""), file=sys.stderr)
    return report


def _summarize(runs: list[dict], sets: list[str], arms: list[str]) -> dict:
    out: dict = {}
    for s in sets:
        for arm in arms:
            rows = [r for r in runs if r["set"] == s and r["arm"] == arm]
            tps = [r["tokens_per_second"] for r in rows]
            entry = {"tokens_per_second": {"median": statistics.median(tps), "min": min(tps), "max": max(tps)}}
            if "plain" in arms:
                plain = {(r["prompt"], r["repeat"]): r["tokens_per_second"] for r in runs
                         if r["set"] == s and r["arm"] == "plain"}
                ratios = [r["tokens_per_second"] / plain[(r["prompt"], r["repeat"])] for r in rows]
                entry["speedup"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
                entry["identical_to_plain"] = all(r["identical_to_plain"] for r in rows)
            acc = [r["acceptance_rate"] for r in rows if r["acceptance_rate"] is not None]
            entry["acceptance_rate"] = statistics.mean(acc) if acc else None
            entry["mean_accepted_length"] = statistics.mean(r["mean_accepted_length"] for r in rows)
            out.setdefault(s, {})[arm] = entry
    return out


def _print_table(summary: dict, sets: list[str], arms: list[str]) -> None:
    print(f"{'set':10} {'arm':18} {'tok/s med [min-max]':>24} {'speedup':>8} {'accept':>7} {'tok/fwd':>7} same",
          file=sys.stderr)
    for s in sets:
        for arm in arms:
            e = summary[s][arm]
            t = e["tokens_per_second"]
            sp = e.get("speedup", {}).get("median", float("nan"))
            acc = "-" if e["acceptance_rate"] is None else f"{e['acceptance_rate']:.2f}"
            print(f"{s:10} {arm:18} {t['median']:8.2f} [{t['min']:.2f}-{t['max']:.2f}]{'':4} {sp:8.2f} {acc:>7} "
                  f"{e['mean_accepted_length']:7.2f} {e.get('identical_to_plain')}", file=sys.stderr)


def plot(summary: dict, sets: list[str], arms: list[str], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(sets)), 4))
    width = 0.8 / len(arms)
    for j, arm in enumerate(arms):
        med = [summary[s][arm]["tokens_per_second"]["median"] for s in sets]
        lo = [m - summary[s][arm]["tokens_per_second"]["min"] for s, m in zip(sets, med)]
        hi = [summary[s][arm]["tokens_per_second"]["max"] - m for s, m in zip(sets, med)]
        ax.bar([i + j * width for i in range(len(sets))], med, width, yerr=[lo, hi], capsize=3, label=arm)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sets))], sets)
    ax.set_ylabel("tokens/s (median, min-max)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)
