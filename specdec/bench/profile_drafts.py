"""`specdec profile-drafts`: which proposer pays on which domain, for this target on this machine.

For each candidate (draft models by name or path, `MODEL@FORMAT` packed as `draft.requantize` FORMAT
says, e.g. `qwen2.5-coder-0.5b-instruct@q3_64`; n-gram lookup as `ngram` or `ngram:MIN-MAX`) and
each shipped prompt set it measures, against plain decoding of the same prompts in the same run:
ms per draft step (batch 1), c = t_draft / t_target, acceptance ("alignment") per position, the
speedup the cost model predicts from those measurements for the same k, and the speedup measured.
Prints `proposer | params | ms/token | acceptance by domain | predicted / measured speedup`,
recommends one proposer per domain (plain decoding when none measured faster), writes JSON and a
PNG plot.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from specdec.config import DEFAULT_TARGET, PRECISIONS
from specdec.extras import require_plotting
from specdec.prompts import SETS, read_set
from specdec.speculation.policy import predicted_speedup


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile-drafts", help="measure each proposer's cost and acceptance per domain; recommend one")
    p.add_argument("--model", default=DEFAULT_TARGET, help="the target")
    p.add_argument("--precision", default="float32", choices=PRECISIONS)
    p.add_argument("--device", default="cpu")
    p.add_argument("--drafts", default=None,
                   help="comma-separated: draft models (name or path, MODEL@FORMAT for a draft.requantize "
                        "format: auto, none, q4_1, q4_64, q3_64), ngram, ngram:MIN-MAX, suffix, hybrid, "
                        "hybrid:MODEL (default: the target's registry draft, ngram, suffix)")
    p.add_argument("--sets", default=",".join(SETS))
    p.add_argument("--num-prompts", type=int, default=1, help="prompts per set")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("-k", type=int, default=3, help="draft tokens per round (fixed, so every position is measured)")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    p.add_argument("--out", default="profile-drafts.json")
    p.add_argument("--plot", default="profile-drafts.png", help="PNG plot; empty for none")
    p.set_defaults(func=cmd_profile_drafts)


def parse_candidate(spec: str) -> tuple[str, dict]:
    """'ngram' / 'ngram:2-4' -> n-gram settings; another model-free kind ('suffix') -> that kind;
    'hybrid' / 'hybrid:MODEL' -> the hybrid with that draft model (default: the registry's);
    anything else names a draft model, MODEL@FORMAT packed as `draft.requantize` FORMAT says."""
    from specdec.config import DRAFT_REQUANTIZE
    from specdec.speculation import registry
    if spec in registry.model_free_kinds() and spec != "ngram":
        return spec, {}
    kind, _, model = spec.partition(":")
    if kind in registry.model_kinds() and kind != "draft_model":
        return kind, {"draft_model": model or None}
    if spec == "ngram" or spec.startswith("ngram:"):
        lo, hi = 1, 4
        if ":" in spec:
            try:
                lo, hi = (int(x) for x in spec.split(":", 1)[1].split("-"))
            except ValueError:
                raise ValueError(f"bad n-gram setting {spec!r}: expected ngram:MIN-MAX, e.g. ngram:1-4") from None
        return "ngram", {"ngram": {"min_n": lo, "max_n": hi}}
    model, _, fmt = spec.partition("@")
    requant = None if fmt == "none" else fmt or "auto"
    if requant not in DRAFT_REQUANTIZE:
        raise ValueError(f"bad draft {spec!r}: its format must be one of none, "
                         f"{', '.join(f for f in DRAFT_REQUANTIZE if f)}")
    return "draft_model", {"draft_model": model, "draft": {"requantize": requant}}


def cmd_profile_drafts(a: argparse.Namespace) -> int:
    from specdec.fileio import atomic_write_text
    require_plotting(a.plot, "specdec profile-drafts")
    report = run_profile(a)
    atomic_write_text(Path(a.out), json.dumps(report, indent=2))
    print(f"wrote {a.out}", file=sys.stderr)
    if a.plot:
        _plot(report, a.plot)
        print(f"wrote {a.plot}", file=sys.stderr)
    return 0


def run_profile(a: argparse.Namespace) -> dict:
    from tqdm import tqdm

    from specdec.config import CacheConfig, EngineConfig, ModelConfig, SpeculativeConfig
    from specdec.llm import LLM
    from specdec.models.loader import load_model
    from specdec.sampling_params import SamplingParams
    from specdec.models.registry import default_draft

    sets = a.sets.split(",")
    if bad := sorted(set(sets) - set(SETS)):
        raise ValueError(f"unknown sets {bad}; choose from {', '.join(SETS)}")
    drafts = a.drafts.split(",") if a.drafts else [d for d in (default_draft(a.model), "ngram", "suffix") if d]
    candidates = [(spec, *parse_candidate(spec)) for spec in drafts]
    target = load_model(a.model, a.precision, a.device, progress=True, pull=True)
    loaded_drafts, draft_of = {}, {}  # (model, requantize) -> the draft loaded so; candidate -> its key
    for spec, method, kw in candidates:
        if "draft_model" in kw:  # the hybrid's default model: the registry's draft, packed as by default
            kw["draft_model"] = kw["draft_model"] or default_draft(target.name)
            kw.setdefault("draft", {"requantize": "auto"})
            key = draft_of[spec] = (kw["draft_model"], kw["draft"]["requantize"])
            if key not in loaded_drafts:
                loaded_drafts[key] = load_model(key[0], a.precision, a.device, progress=True, pull=True, requant=key[1])
            kw["draft"] = {"requantize": loaded_drafts[key].requantized}  # what auto chose

    def engine(spec: SpeculativeConfig | None, key: tuple | None = None) -> LLM:
        cfg = EngineConfig(model=ModelConfig(model=target.name, precision=a.precision, device=a.device),
                           cache=CacheConfig(target_cache_blocks=512, draft_cache_blocks=512), speculative=spec)
        return LLM(config=cfg, loaded=target, draft_loaded=loaded_drafts.get(key), progress=False)

    plain = engine(None)
    arms = {spec: engine(SpeculativeConfig(method=method, num_speculative_tokens=a.k, policy="fixed", **kw),
                         draft_of.get(spec))
            for spec, method, kw in candidates}
    params = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
    prompts = {s: read_set(s)[: a.num_prompts] for s in sets}
    runs: dict[str, dict[str, list]] = {spec: {s: [] for s in sets} for spec in arms}
    plain_runs: dict[str, list] = {s: [] for s in sets}
    total = sum(len(p) for p in prompts.values()) * (1 + len(arms))
    with tqdm(total=total, desc="profile-drafts", unit="run", file=sys.stderr) as bar:
        for s in sets:
            for prompt in prompts[s]:
                ids = _prompt_ids(plain, prompt, a.chat)
                base = plain.generate([ids], params)[0]
                plain_runs[s].append(base)
                bar.update()
                for spec, llm in arms.items():  # interleaved with plain, prompt by prompt
                    out = llm.generate([ids], params)[0]
                    if out.token_ids != base.token_ids:
                        raise RuntimeError(f"{spec}: greedy output differs from plain decoding on a {s} prompt")
                    runs[spec][s].append(out)
                    bar.update()
    return _summarise(a, target.name, candidates, arms, runs, plain_runs)


def _prompt_ids(llm, prompt: str, chat: bool) -> list[int]:
    tok = llm.tokenizer
    if chat:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True),
                          add_special_tokens=False)
    return tok.encode(prompt)


def _decode_seconds_per_token(out) -> float:
    s = out.stats
    return (s.seconds - s.ttft_seconds) / max(s.generated_tokens - 1, 1)


def _summarise(a, target: str, candidates, arms, runs, plain_runs) -> dict:
    t_target = statistics.median(_decode_seconds_per_token(o) for outs in plain_runs.values() for o in outs)
    rows, recommend = [], {}
    for spec, method, kw in candidates:
        llm = arms[spec]
        measured = llm.engine.stats().speculation
        costs = next(p for p in measured.proposers if p.id == measured.default)
        t_draft = costs.draft_step_seconds or 0.0   # one draft step at batch 1 (measured)
        t_verify = costs.verify_seconds[a.k] or t_target
        t_one = costs.verify_seconds[0] or t_target
        c = t_draft / t_one if t_one else 0.0
        domains = {}
        for s, outs in runs[spec].items():
            positions = [statistics.mean(o.stats.per_position_acceptance[j] if j < len(o.stats.per_position_acceptance)
                                         else 0.0 for o in outs) for j in range(a.k)]
            drafted = sum(o.stats.drafted_tokens for o in outs)
            # decode phase only: every arm pays the same prefill, which would only dilute the ratio
            measured = statistics.median(o.stats.decode_tokens_per_second / p.stats.decode_tokens_per_second
                                         for o, p in zip(outs, plain_runs[s]))
            domains[s] = {"acceptance": sum(o.stats.accepted_tokens for o in outs) / drafted if drafted else 0.0,
                          "per_position_acceptance": positions,
                          "predicted_speedup": predicted_speedup(positions, a.k, c, t_verify / t_one),
                          "measured_speedup": measured}
        rows.append({"proposer": spec, "method": method, "params": {**kw, "k": a.k},
                     "ms_per_draft_token": 1000 * t_draft, "cost_ratio": c, "domains": domains})
    for s in runs[candidates[0][0]]:
        best = max(rows, key=lambda r: r["domains"][s]["measured_speedup"])
        recommend[s] = best["proposer"] if best["domains"][s]["measured_speedup"] > 1.0 else "plain"
    command = (f"specdec profile-drafts --model {a.model} --precision {a.precision} --drafts "
               f"{','.join(spec for spec, _, _ in candidates)} --sets {','.join(runs[candidates[0][0]])} "
               f"--num-prompts {a.num_prompts} --max-tokens {a.max_tokens} -k {a.k}" + (" --chat" if a.chat else ""))
    report = {"command": command, "target": target, "precision": a.precision, "k": a.k, "max_tokens": a.max_tokens,
              "target_ms_per_token": 1000 * t_target, "proposers": rows, "recommendation": recommend}
    _print_table(report)
    return report


def _print_table(report: dict) -> None:
    print("proposer | params | ms/token | acceptance by domain | predicted / measured speedup")
    for r in report["proposers"]:
        params = ",".join(f"{k}={v}" for k, v in r["params"].items() if k != "draft_model")
        acc = " ".join(f"{s}={d['acceptance']:.2f}" for s, d in r["domains"].items())
        speed = " ".join(f"{s}={d['predicted_speedup']:.2f}/{d['measured_speedup']:.2f}" for s, d in r["domains"].items())
        print(f"{r['proposer']} | {params} | {r['ms_per_draft_token']:.1f} (c={r['cost_ratio']:.2f}) | {acc} | {speed}")
    print("recommended: " + ", ".join(f"{s} -> {p}" for s, p in report["recommendation"].items()))


def _plot(report: dict, path: str) -> None:
    import os

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(report["recommendation"])
    rows = report["proposers"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(len(rows), 1)
    for i, r in enumerate(rows):
        xs = [j + i * width for j in range(len(sets))]
        ax1.bar(xs, [r["domains"][s]["acceptance"] for s in sets], width, label=r["proposer"])
        ax2.bar(xs, [r["domains"][s]["measured_speedup"] for s in sets], width, label=f"{r['proposer']} measured")
        ax2.scatter(xs, [r["domains"][s]["predicted_speedup"] for s in sets], marker="_", s=200, color="black",
                    zorder=3, label="predicted" if i == 0 else None)
    for ax, title in ((ax1, "acceptance by domain"), (ax2, f"speedup over plain (k={report['k']})")):
        ax.set_xticks([j + width * (len(rows) - 1) / 2 for j in range(len(sets))], sets)
        ax.set_title(title)
        ax.legend(fontsize=8)
    ax2.axhline(1.0, color="grey", lw=0.8)
    fig.suptitle(f"profile-drafts: target {report['target']} ({report['precision']})")
    fig.tight_layout()
    tmp = f"{path}.tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
