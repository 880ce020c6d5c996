"""`specdec bench`: plain decoding against speculative arms on the shipped prompt sets.

Every arm runs on the same loaded weights in one process; arms are interleaved per prompt and the
whole sweep repeats, so a noisy machine hits all arms alike. Reports per set and arm the median
tokens/s with min-max, the median per-prompt speedup over plain, acceptance and mean accepted
length; checks that greedy speculative output equals plain output; writes JSON and a PNG plot.
Each run logs the load average and the cores other processes took meanwhile (flagged `noisy`
above half a core). Optional peers (transformers, llama.cpp, OpenVINO: peers.py) run in the same
loop on the same prompt ids and land in the same rows; a peer that fails to install, load or run is
recorded as failed (`"failed": reason` in its rows, summary and peers entry, "failed" in the table)
and the run goes on. The measured memory-bandwidth ceiling (bandwidth.py) goes into the JSON and
onto the plot.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from specdec.bench.bandwidth import ceiling, measure_read_bandwidth
from specdec.contention import Contention
from specdec.extras import require_plotting
from specdec.bench.peers import DRAFTED_PEERS, check_peers, make_peers, peer_entry, run_peer
from specdec.config import CacheConfig, DraftConfig, EngineConfig, ModelConfig, SpeculativeConfig
from specdec.fileio import atomic_write_text
from specdec.models.gguf_packed import REQUANT
from specdec.prompts import read_set
from specdec.sampling_params import SamplingParams

ARMS = {
    "plain": None,
    "draft_fixed": ("draft_model", "fixed"),
    "draft_cost_model": ("draft_model", "cost_model"),
    "ngram": ("ngram", "cost_model"),
    "ngram_fixed": ("ngram", "fixed"),
    "suffix": ("suffix", "cost_model"),
    "hybrid": ("hybrid", "cost_model"),
    # the draft as the file holds it, scoring the whole vocabulary (the defaults' `auto`s turned off)
    "draft_file_fixed": ("draft_model", "fixed"),
    "draft_file_cost_model": ("draft_model", "cost_model"),
    # the file's draft scoring a 32k-token sub-vocabulary (speculation/proposers/subvocab.py)
    "draft_subvocab_fixed": ("draft_model", "fixed"),
    "draft_subvocab_cost_model": ("draft_model", "cost_model"),
    # the draft model requantized to 4 bits at pack time (models/gguf_packed.py, REQUANT)
    "draft_q4_fixed": ("draft_model", "fixed"),
    "draft_q4_cost_model": ("draft_model", "cost_model"),
    "draft_q4_subvocab_fixed": ("draft_model", "fixed"),
    # the draft requantized to each format of REQUANT, scoring the defaults' sub-vocabulary
    **{f"draft_{fmt}_{policy}": ("draft_model", policy) for fmt in REQUANT for policy in ("fixed", "cost_model")},
}
REQUANT_ARMS = "q4_1"  # what the draft_q4 arms' draft is requantized to
SUBVOCAB_SIZE = 32768
SESSION = ("each arm is one engine; within a repeat every set's prompts run through it in file order, so the "
           "suffix cache of finished outputs warms as in a session; shared caches are cleared at each repeat")


def _arm_llm(name: str, a, target, draft):
    """The LLM of one arm, on the shared target (and draft) weights, in their precisions."""
    from specdec.llm import LLM
    spec = None
    if ARMS[name] is not None:
        method, policy = ARMS[name]
        spec = SpeculativeConfig(method=method, draft_model=draft.name if _needs_draft(name) else None,
                                 num_speculative_tokens=a.k, policy=policy,
                                 draft=DraftConfig(vocab_size=_vocab(name),
                                                   precision=draft.precision if draft else None,
                                                   requantize=draft.requantized if draft else None))
    cfg = EngineConfig(model=ModelConfig(model=target.name, precision=target.precision, device=a.device,
                                         num_threads=a.threads),
                       # no prefix cache: every run prefills its prompt, as every peer's run does
                       cache=CacheConfig(target_cache_blocks=512, draft_cache_blocks=512, enable_prefix_caching=False),
                       speculative=spec)
    return LLM(config=cfg, loaded=target, draft_loaded=draft if _needs_draft(name) else None, progress=False)


def _format(arm: str) -> str | None:
    """The REQUANT format an arm names (draft_q4_64_fixed: q4_64), if any."""
    return next((fmt for fmt in REQUANT if arm.startswith(f"draft_{fmt}_")), None)


def _requant(arm: str) -> str | None:
    """How the arm's draft is packed: the defaults' auto, or the file's blocks, or a named format."""
    if fmt := _format(arm):
        return fmt
    if arm.startswith("draft_q4"):
        return REQUANT_ARMS
    return None if arm.startswith(("draft_file", "draft_subvocab")) else "auto"


def _vocab(arm: str) -> int | str | None:
    """What the arm's draft scores: the defaults' auto, all, or the 32k sub-vocabulary."""
    if "subvocab" in arm:
        return SUBVOCAB_SIZE
    if _format(arm):
        return "auto"
    return None if arm.startswith(("draft_file", "draft_q4")) else "auto"


def _needs_draft(arm: str) -> bool:
    from specdec.speculation import registry
    return ARMS[arm] is not None and registry.get(ARMS[arm][0]).needs_model


def run_spec_bench(a) -> dict:
    require_plotting(a.plot, "specdec bench spec")
    from specdec.bench.weights import resolve_precisions
    from specdec.models.loader import load_model, resolve
    from specdec.models.registry import default_draft

    arms = a.arms.split(",")
    unknown = set(arms) - set(ARMS)
    if unknown:
        raise ValueError(f"unknown arms {sorted(unknown)}; choose from {', '.join(ARMS)}")
    sets = a.sets.split(",")
    peer_names = [p for p in (a.peers or "").split(",") if p]
    check_peers(peer_names, a.install_peers)  # before minutes of loading
    precision, draft_precision = resolve_precisions(a.model, a.precision, a.device, a.draft, a.draft_precision)
    t0 = time.perf_counter()
    target = load_model(a.model, precision, a.device, pull=True)
    load_seconds = time.perf_counter() - t0
    draft_name = a.draft or default_draft(target.name)
    needs_draft = any(_needs_draft(x) for x in arms)
    drafted_peers = [p for p in peer_names if p in DRAFTED_PEERS]
    if (needs_draft or drafted_peers) and not draft_name:
        raise ValueError(f"{a.model} has no default draft: pass --draft or drop the draft arms and "
                         f"{', '.join(DRAFTED_PEERS)}")
    drafts = {requant: load_model(draft_name, draft_precision, a.device, pull=True, requant=requant)
              for requant in {_requant(x) for x in arms if _needs_draft(x)}}
    draft = drafts.get(None) or next(iter(drafts.values()), None)
    llms = {name: _arm_llm(name, a, target, drafts.get(_requant(name))) for name in arms}
    tok = target.tokenizer
    prompts = {s: [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
                   for p in read_set(s)[: a.num_prompts]] for s in sets}
    params = SamplingParams(max_tokens=a.max_tokens, ignore_eos=not a.until_eos)
    num_threads = a.threads or os.cpu_count() or 1  # what our arms may use: --threads, else every core
    read_gb_s = measure_read_bandwidth(num_threads=num_threads)
    n_ctx = max(len(ids) for v in prompts.values() for ids in v) + a.max_tokens + a.k + 64
    draft_path = resolve(draft_name, pull=True)[1] if drafted_peers else None
    peers = make_peers(peer_names, target.path, draft_path, num_threads, n_ctx, a.k, a.install_peers)
    names = arms + peer_names
    try:
        runs = _sweep(a, names, llms, peers, prompts, params)
    finally:
        for p in peers.values():
            p.close()
    # this VM's bandwidth drifts by a fifth within minutes: the ceiling takes the best of before and after
    read_gb_s = max(read_gb_s, measure_read_bandwidth(num_threads=num_threads))
    roof = ceiling(read_gb_s, target.weights, target.config.tie_embeddings, target.path)
    summary = _summarize(runs, sets, names)
    report = {"model": target.name, "draft": draft.name if draft else None, "precision": precision,
              "draft_precision": draft.precision if draft else None,
              "device": a.device, "k": a.k, "max_tokens": a.max_tokens, "until_eos": a.until_eos,
              "repeats": a.repeats,
              "num_prompts_per_set": a.num_prompts, "load_seconds": load_seconds, "threads": num_threads,
              "peers": {n: peer_entry(p) for n, p in peers.items()},
              "bandwidth_gb_s": roof["bandwidth_gb_s"], "ceiling_tokens_per_second": roof["ceiling_tokens_per_second"],
              "ceiling": roof,
              "session": SESSION, "measured_costs": _measured_costs(llms),
              "noisy_runs": sum(r.get("noisy", False) for r in runs), "summary": summary, "runs": runs}
    atomic_write_text(Path(a.out), json.dumps(report, indent=1))
    if a.plot:
        drafted = f", draft {draft.precision}" if draft and draft.precision != precision else ""
        plot(summary, sets, names, Path(a.plot), f"{target.name} ({precision}{drafted}), k={a.k}, {a.max_tokens} tokens",
             roof)
    _print_table(summary, sets, names)
    print(f"memory-bandwidth ceiling: {roof['bandwidth_gb_s']:.1f} GB/s read / "
          f"{roof['weight_bytes_per_token'] / 1e6:.0f} MB per token = {roof['ceiling_tokens_per_second']:.1f} tok/s "
          f"({roof['gguf_ceiling_tokens_per_second']:.1f} on the GGUF file's {roof['gguf_bytes'] / 1e6:.0f} MB)",
          file=sys.stderr)
    print(f"{report['noisy_runs']} of {len(runs)} runs had competing processes (> 0.5 cores)", file=sys.stderr)
    print(f"wrote {a.out}" + (f" and {a.plot}" if a.plot else ""), file=sys.stderr)
    return report


def _measured_costs(llms: dict) -> dict:
    """What each speculative arm's cost model measured by the end: seconds of one draft step and of
    target forwards verifying 1, 2, ... rows, per proposer (the costs its choices were made with)."""
    from dataclasses import asdict
    out = {}
    for arm, llm in llms.items():
        spec = llm.engine.stats().speculation
        if spec is not None:
            out[arm] = [{k: v for k, v in asdict(p).items() if k in ("id", "draft_step_seconds", "verify_seconds")}
                        for p in spec.proposers]
    return out


def _sweep(a, names: list[str], llms: dict, peers: dict, prompts: dict[str, list[list[int]]],
           params: SamplingParams) -> list[dict]:
    """Every repeat, set, prompt, then arm and peer in turn: one row each."""
    from tqdm import tqdm
    runs = []
    bar = tqdm(total=a.repeats * sum(len(v) for v in prompts.values()) * len(names), desc="bench", file=sys.stderr)
    for rep in range(a.repeats):
        for llm in llms.values():  # every repeat is a fresh session for the shared caches
            if llm.engine.speculator is not None:
                llm.engine.speculator.clear_caches()
        for s, set_prompts in prompts.items():
            for i, ids in enumerate(set_prompts):
                outs = {}
                for arm in names:
                    row, outs[arm] = _one_run(arm, llms, peers, ids, params, a.max_tokens)
                    runs.append({"set": s, "prompt": i, "repeat": rep, "arm": arm, "peer": arm in peers, **row,
                                 "identical_to_plain": None})
                    bar.update(1)
                if "plain" in outs:  # for peers informative only: llama.cpp rounds its own way
                    for r in runs[-len(names):]:
                        if "failed" not in r:
                            r["identical_to_plain"] = outs[r["arm"]] == outs["plain"]
    bar.close()
    return runs


def _one_run(arm: str, llms: dict, peers: dict, ids: list[int], params: SamplingParams,
             max_tokens: int) -> tuple[dict, list[int] | None]:
    """One arm or peer on one prompt: its row's figures (a failed peer run: only `failed`) and tokens."""
    pid = getattr(peers.get(arm), "pid", None)  # a worker process: its CPU is ours
    with Contention(helper_pids=(pid,) if pid else ()) as busy:
        if arm in peers:
            st = run_peer(peers, arm, ids, max_tokens)
            if isinstance(st, str):
                return {"failed": st}, None
            token_ids, accept, accepted_len = st.token_ids, None, None
        else:
            out = llms[arm].generate([ids], params)[0]
            st = out.stats
            token_ids, accept, accepted_len = out.token_ids, st.acceptance_rate, st.mean_accepted_length
    return {"load_average": busy.load_average, "competing_cores": busy.cores, "noisy": busy.noisy,
            "tokens_per_second": st.tokens_per_second, "decode_tokens_per_second": st.decode_tokens_per_second,
            "generated_tokens": st.generated_tokens, "seconds": st.seconds, "ttft_seconds": st.ttft_seconds,
            "acceptance_rate": accept, "mean_accepted_length": accepted_len}, token_ids


def _summarize(runs: list[dict], sets: list[str], arms: list[str]) -> dict:
    """Per set and arm the spreads over its runs; a peer's failed runs leave out their figures and
    add `failed` (the reason; "N of M runs: reason" when some runs succeeded)."""
    out: dict = {}
    for s in sets:
        for arm in arms:
            rows = [r for r in runs if r["set"] == s and r["arm"] == arm]
            ok = [r for r in rows if "failed" not in r]
            entry = _entry(runs, s, ok, "plain" in arms) if ok else {}
            failed = [r["failed"] for r in rows if "failed" in r]
            if failed:
                entry["failed"] = f"{len(failed)} of {len(rows)} runs: {failed[0]}" if ok else failed[0]
            out.setdefault(s, {})[arm] = entry
    return out


def _entry(runs: list[dict], s: str, rows: list[dict], with_plain: bool) -> dict:
    entry = {}
    # whole request (prefill included), and decode only (after the first token): a long prompt
    # (code_edit) is mostly prefill, which speculation cannot speed up
    for rate, speedup in (("tokens_per_second", "speedup"), ("decode_tokens_per_second", "decode_speedup")):
        entry[rate] = _spread([r[rate] for r in rows])
        if with_plain:
            plain = {(r["prompt"], r["repeat"]): r[rate] for r in runs if r["set"] == s and r["arm"] == "plain"}
            entry[speedup] = _spread([r[rate] / plain[(r["prompt"], r["repeat"])] for r in rows])
    if with_plain:
        entry["identical_to_plain"] = all(r["identical_to_plain"] for r in rows)
    acc = [r["acceptance_rate"] for r in rows if r["acceptance_rate"] is not None]
    entry["acceptance_rate"] = statistics.mean(acc) if acc else None
    lens = [r["mean_accepted_length"] for r in rows if r["mean_accepted_length"] is not None]
    entry["mean_accepted_length"] = statistics.mean(lens) if lens else None  # None: a peer
    return entry


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _print_table(summary: dict, sets: list[str], arms: list[str]) -> None:
    print(f"{'set':10} {'arm':21} {'tok/s med [min-max]':>24} {'speedup':>8} {'decode tok/s':>13} {'speedup':>8} "
          f"{'accept':>7} {'tok/fwd':>7} same")
    for s in sets:
        for arm in arms:
            e = summary[s][arm]
            if "tokens_per_second" not in e:
                print(f"{s:10} {arm:21} failed: {e['failed']}")
                continue
            t = e["tokens_per_second"]
            sp = e.get("speedup", {}).get("median", float("nan"))
            dsp = e.get("decode_speedup", {}).get("median", float("nan"))
            acc = "-" if e["acceptance_rate"] is None else f"{e['acceptance_rate']:.2f}"
            tpf = "-" if e["mean_accepted_length"] is None else f"{e['mean_accepted_length']:.2f}"
            print(f"{s:10} {arm:21} {t['median']:8.2f} [{t['min']:.2f}-{t['max']:.2f}]{'':4} {sp:8.2f} "
                  f"{e['decode_tokens_per_second']['median']:13.2f} {dsp:8.2f} {acc:>7} "
                  f"{tpf:>7} {e.get('identical_to_plain')}" + (f"  failed {e['failed']}" if "failed" in e else ""))


def plot(summary: dict, sets: list[str], arms: list[str], path: Path, title: str, roof: dict | None = None) -> None:
    """Bars per set and arm (peers included); `roof` (bandwidth.ceiling) adds the dashed ceiling line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(sets)) + 2, 4))  # + the legend, outside the bars
    width = 0.8 / len(arms)
    for j, arm in enumerate(arms):
        # a failed peer: an empty bar, named so in the legend
        spread = [summary[s][arm].get("tokens_per_second", {"median": 0.0, "min": 0.0, "max": 0.0}) for s in sets]
        med = [x["median"] for x in spread]
        lo = [x["median"] - x["min"] for x in spread]
        hi = [x["max"] - x["median"] for x in spread]
        failed = any("failed" in summary[s][arm] for s in sets)
        ax.bar([i + j * width for i in range(len(sets))], med, width, yerr=[lo, hi], capsize=3,
               label=f"{arm} (failed)" if failed else arm)
    if roof is not None:
        top = roof["ceiling_tokens_per_second"]
        ax.axhline(top, color="k", linestyle="--", linewidth=1)
        ax.text(-width / 2, top * 1.015, f" memory-bandwidth ceiling {top:.1f} tok/s ({roof['bandwidth_gb_s']:.1f} GB/s / "
                f"{roof['weight_bytes_per_token'] / 1e6:.0f} MB per token)", fontsize=8, va="bottom")
        ax.set_ylim(top=max(ax.get_ylim()[1], top * 1.12))
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sets))], sets)
    ax.set_ylabel("tokens/s (median, min-max)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)
