"""`specdec bench structured`: constrained decoding, plain against speculative, on the shipped
structured set (extraction into JSON schemas, tool calls, enum choices).

Every arm runs on the same loaded weights in one process, interleaved per prompt, greedy, until
EOS (the grammar decides the end). An output counts as valid when it parses and validates: JSON
against its schema (jsonschema), each tool call against its function's parameters, a choice
against its options. Reports per arm the median whole-request speedup over plain constrained
decoding with min-max, tokens/s, validity, equality with plain, the share of tokens the grammar
forced, and the time to compute one token mask; writes JSON and a PNG.

Arms: plain (no drafts), forced (grammar-forced drafts only: the proposer is capped at 0),
ngram, suffix, draft_model, hybrid (each with forced drafts ahead of its own).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from specdec.config import CacheConfig, DraftConfig, EngineConfig, ModelConfig, SpeculativeConfig
from specdec.contention import Contention
from specdec.extras import require, require_plotting
from specdec.fileio import atomic_write_text
from specdec.request import SpecOptions
from specdec.sampling_params import SamplingParams, StructuredOutput

ARMS = {"plain": None, "forced": "ngram", "ngram": "ngram", "suffix": "suffix", "draft_model": "draft_model",
        "hybrid": "hybrid"}
DEFAULT_ARMS = "plain,forced,suffix,hybrid"


def read_items(path: Path) -> list[dict]:
    items = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not items:
        raise ValueError(f"{path} holds no prompts")
    return items


def constraint_of(item: dict, tokenizer) -> StructuredOutput:
    """The item's constraint: its response_format schema, its guided choice, or its required tool call."""
    from specdec.server.tool_grammar import call_grammar
    from specdec.server.tools import check_tools, vocab_has_call_tags
    if "tools" in item:
        choice = item.get("tool_choice", "required")
        name = choice["function"]["name"] if isinstance(choice, dict) else None
        return call_grammar(check_tools(item["tools"]), name, item.get("parallel_tool_calls", True),
                            tags_are_tokens=vocab_has_call_tags(tokenizer))
    if "guided_choice" in item:
        return StructuredOutput("choice", item["guided_choice"])
    return StructuredOutput("json_schema", item["response_format"]["json_schema"]["schema"])


def is_valid(item: dict, text: str) -> bool:
    """Whether the output parses and validates against the item's constraint."""
    import jsonschema
    from specdec.server.tool_calls import parse_tool_calls
    if "guided_choice" in item:
        return text in item["guided_choice"]
    try:
        if "tools" in item:
            content, calls = parse_tool_calls(text)
            params = {t["function"]["name"]: t["function"].get("parameters", {}) for t in item["tools"]}
            for call in calls:
                jsonschema.validate(json.loads(call["function"]["arguments"]), params[call["function"]["name"]])
            return bool(calls) and not (content or "").strip()
        jsonschema.validate(json.loads(text), item["response_format"]["json_schema"]["schema"])
        return True
    except (ValueError, KeyError, jsonschema.ValidationError):
        return False


def _llm(arm: str, a, target, draft):
    from specdec.llm import LLM
    method = ARMS[arm]
    spec = None
    if method is not None:
        spec = SpeculativeConfig(method=method, draft_model=draft.name if method in ("draft_model", "hybrid") else None,
                                 num_speculative_tokens=a.k, policy="cost_model",
                                 draft=DraftConfig(precision=draft.precision if draft else None))
    cfg = EngineConfig(model=ModelConfig(model=target.name, precision=target.precision, device=a.device,
                                         num_threads=a.threads),
                       # no prefix cache: every run prefills its prompt (the arms see the same work)
                       cache=CacheConfig(target_cache_blocks=512, draft_cache_blocks=512, enable_prefix_caching=False),
                       speculative=spec)
    needs = method in ("draft_model", "hybrid")
    return LLM(config=cfg, loaded=target, draft_loaded=draft if needs else None, progress=False)


def _generate(llm, ids: list[int], params: SamplingParams, arm: str):
    """One request to the end through the engine (the forced arm caps the proposer at 0 drafts)."""
    eng = llm.engine
    opts = SpecOptions(max_k=0) if arm == "forced" else None
    req = eng.add_request(ids, params, speculative=opts if eng.speculator is not None else None)
    last = None
    while eng.has_request(req.request_id):
        for out in eng.step():
            if out.request_id == req.request_id:
                last = out
    return last


def _run(llm, arm: str, ids: list[int], params: SamplingParams, item: dict) -> dict:
    with Contention() as busy:
        out = _generate(llm, ids, params, arm)
    s = out.stats
    return {"arm": arm, "tokens": s.generated_tokens, "seconds": s.seconds, "ttft": s.ttft_seconds,
            "tokens_per_second": s.tokens_per_second, "valid": is_valid(item, out.text), "text": out.text,
            "token_ids": out.token_ids, "finish_reason": out.finish_reason,
            "drafted": s.drafted_tokens, "accepted": s.accepted_tokens,
            "forced_drafted": s.forced_drafted_tokens, "forced_accepted": s.forced_accepted_tokens,
            "mask_seconds": s.mask_seconds, "num_masks": s.num_masks, "noisy": busy.noisy}


def _summarize(runs: list[dict], arms: list[str]) -> dict:
    plain = {(r["repeat"], r["prompt"]): r for r in runs if r["arm"] == "plain"}
    out = {}
    for arm in arms:
        rs = [r for r in runs if r["arm"] == arm]
        ratios = [plain[(r["repeat"], r["prompt"])]["seconds"] / r["seconds"] for r in rs
                  if (r["repeat"], r["prompt"]) in plain]
        tokens = sum(r["tokens"] for r in rs)
        masks = sum(r["num_masks"] for r in rs)
        out[arm] = {
            "speedup_median": statistics.median(ratios) if ratios else None,
            "speedup_min": min(ratios) if ratios else None, "speedup_max": max(ratios) if ratios else None,
            # the whole set as one job: total plain seconds over total arm seconds
            "speedup_total": (sum(plain[(r["repeat"], r["prompt"])]["seconds"] for r in rs)
                              / sum(r["seconds"] for r in rs)) if ratios else None,
            "tokens_per_second_median": statistics.median(r["tokens_per_second"] for r in rs),
            "valid_fraction": sum(r["valid"] for r in rs) / len(rs),
            "same_as_plain_fraction": (sum(r["token_ids"] == plain[(r["repeat"], r["prompt"])]["token_ids"]
                                           for r in rs) / len(rs)) if ratios else None,
            "forced_share": sum(r["forced_accepted"] for r in rs) / tokens if tokens else 0.0,
            "acceptance": (sum(r["accepted"] for r in rs) / sum(r["drafted"] for r in rs)
                           if sum(r["drafted"] for r in rs) else None),
            "mask_ms_mean": 1e3 * sum(r["mask_seconds"] for r in rs) / masks if masks else None,
        }
    return out


def run_structured_bench(a) -> dict:
    require("jsonschema", "bench", "specdec bench structured")
    require_plotting(a.plot, "specdec bench structured")
    from tqdm import tqdm

    from specdec.bench.weights import resolve_precisions
    from specdec.models.loader import load_model
    from specdec.models.registry import default_draft
    from specdec.prompts import set_path
    from specdec.server.tools import tool_messages

    arms = (a.arms or DEFAULT_ARMS).split(",")
    unknown = set(arms) - set(ARMS)
    if unknown or "plain" not in arms:
        raise ValueError(f"arms must include plain and come from {', '.join(ARMS)}; unknown: {sorted(unknown)}")
    path = Path(a.prompts_file) if a.prompts_file else set_path("structured")
    items = read_items(path)[: a.num_prompts or None]
    precision, draft_precision = resolve_precisions(a.model, a.precision, a.device, a.draft, a.draft_precision)
    target = load_model(a.model, precision, a.device, pull=True)
    needs_draft = any(ARMS[x] in ("draft_model", "hybrid") for x in arms)
    draft = (load_model(a.draft or default_draft(target.name), draft_precision, a.device, pull=True)
             if needs_draft else None)
    llms = {arm: _llm(arm, a, target, draft) for arm in arms}
    tok = target.tokenizer
    jobs = []
    for item in items:
        prompt = tok.apply_chat_template(tool_messages(item["messages"]), tools=item.get("tools"))
        params = SamplingParams(max_tokens=a.max_tokens, structured=constraint_of(item, tok))
        jobs.append((tok.encode(prompt, add_special_tokens=False), params, item))
    for arm in arms:   # page the weights in, build the grammar engine's vocabulary, start the threads
        _run(llms[arm], arm, jobs[0][0], jobs[0][1], jobs[0][2])
    runs = []
    with tqdm(total=a.repeats * len(jobs) * len(arms), desc="structured", file=sys.stderr) as bar:
        for rep in range(a.repeats):
            for i, (ids, params, item) in enumerate(jobs):
                for arm in arms:
                    runs.append({"repeat": rep, "prompt": i, "kind": item.get("kind"),
                                 **_run(llms[arm], arm, ids, params, item)})
                    bar.update()
    summary = _summarize(runs, arms)
    report = {"mode": "structured", "model": target.name, "draft": draft.name if draft else None,
              "precision": precision,
              "draft_precision": draft.precision if draft else None, "device": a.device, "k": a.k,
              "max_tokens": a.max_tokens, "repeats": a.repeats, "prompts": len(jobs), "set": str(path.name),
              "date": time.strftime("%Y-%m-%d"), "noisy_runs": sum(r["noisy"] for r in runs),
              "summary": summary, "runs": runs}
    atomic_write_text(Path(a.out), json.dumps(report, indent=1))
    if a.plot:
        plot(runs, arms, Path(a.plot), f"{target.name} ({precision}), structured set, greedy")
    for arm, s in summary.items():
        speed = ("" if s["speedup_median"] is None else
                 f"speedup {s['speedup_median']:.2f}x ({s['speedup_min']:.2f}-{s['speedup_max']:.2f}), "
                 f"whole set {s['speedup_total']:.2f}x, ")
        print(f"{arm:12s} {speed}{s['tokens_per_second_median']:.1f} tok/s, valid {s['valid_fraction']:.0%}, "
              f"forced {s['forced_share']:.0%} of tokens", file=sys.stderr)
    print(f"wrote {a.out}" + (f" and {a.plot}" if a.plot else ""), file=sys.stderr)
    return report


def plot(runs: list[dict], arms: list[str], path: Path, title: str) -> None:
    """Per-prompt whole-request speedup over plain, one box per arm."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plain = {(r["repeat"], r["prompt"]): r["seconds"] for r in runs if r["arm"] == "plain"}
    data = [[plain[(r["repeat"], r["prompt"])] / r["seconds"] for r in runs if r["arm"] == arm] for arm in arms]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.boxplot(data)
    ax.set_xticks(range(1, len(arms) + 1), arms)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(1.5, color="tab:red", lw=0.8, ls="--", label="1.5x bar")
    ax.set_ylabel("speedup over plain constrained decoding")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
