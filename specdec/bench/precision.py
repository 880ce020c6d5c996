"""`specdec bench precision`: each precision mode against the float32 oracle on the shipped prompts.

Per prompt: float32 greedy output (the reference), then for each mode: its own greedy output (does
it match float32's first N tokens? where does it first differ?), its logits teacher-forced along the
reference (max / mean absolute error against float32's, top-1 agreement) and its decode tokens/s.
Modes run interleaved per prompt, so machine noise hits them alike. Writes JSON and a PNG.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from specdec.contention import Contention
from specdec.extras import require_plotting
from specdec.config import CacheConfig, EngineConfig, ModelConfig
from specdec.fileio import atomic_write_text
from specdec.prompts import read_set
from specdec.sampling_params import SamplingParams


def _first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def _one_prompt(llms: dict, modes: list[str], ids: list[int], params: SamplingParams, teacher_logits) -> dict:
    ref = llms["float32"].generate(ids, params)[0]
    ref_logits = teacher_logits(llms["float32"].engine, ids, ref.token_ids)
    finite = ref_logits.isfinite()  # never-sample ids are -inf in every mode
    row = {"modes": {"float32": {"tok_s": ref.stats.decode_tokens_per_second}}}
    for m in modes[1:]:
        out = llms[m].generate(ids, params)[0]
        logits = teacher_logits(llms[m].engine, ids, ref.token_ids)
        err = (logits - ref_logits).abs()[finite]
        first = _first_diff(out.token_ids, ref.token_ids)
        row["modes"][m] = {"tok_s": out.stats.decode_tokens_per_second, "first_diff": first,
                           "matches": first is None, "max_logit_err": err.max().item(),
                           "mean_logit_err": err.mean().item(),
                           "top1_agree": (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()}
    return row


def run_precision_bench(a) -> dict:
    require_plotting(a.plot, "specdec bench precision")
    from tqdm import tqdm

    from specdec.llm import LLM
    from specdec.quality.scoring import teacher_logits

    modes = ["float32"] + [p for p in (a.precisions or "int4,int4-a16,int4-a8").split(",") if p != "float32"]
    llms = {m: LLM(config=EngineConfig(model=ModelConfig(model=a.model, precision=m, num_threads=a.threads),
                                       cache=CacheConfig(target_cache_blocks=256)), progress=False) for m in modes}
    tok = llms["float32"].engine.loaded.tokenizer
    prompts = [(s, p) for s in a.sets.split(",") for p in read_set(s)[: a.num_prompts]]
    params = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
    rows = []
    for s, text in tqdm(prompts, desc="bench precision", file=sys.stderr):
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)
        with Contention() as contention:
            row = _one_prompt(llms, modes, ids, params, teacher_logits)
        row.update({"set": s, "prompt_tokens": len(ids), "load_average": contention.load_average,
                    "other_cores": contention.cores, "busy": contention.noisy})  # the load average counts our own threads
        rows.append(row)
    summary = {}
    for m in modes:
        speed = [r["modes"][m]["tok_s"] for r in rows]
        summary[m] = {"tok_s_median": statistics.median(speed), "tok_s_min": min(speed), "tok_s_max": max(speed),
                      "speedup_vs_float32": statistics.median(r["modes"][m]["tok_s"] / r["modes"]["float32"]["tok_s"]
                                                            for r in rows)}
        if m != "float32":
            summary[m].update({
                "match_rate": sum(r["modes"][m]["matches"] for r in rows) / len(rows),
                "max_logit_err": max(r["modes"][m]["max_logit_err"] for r in rows),
                "mean_logit_err": statistics.mean(r["modes"][m]["mean_logit_err"] for r in rows),
                "top1_agree": statistics.mean(r["modes"][m]["top1_agree"] for r in rows)})
    result = {"model": a.model, "max_tokens": a.max_tokens, "threads": a.threads, "sets": a.sets,
              "summary": summary, "prompts": rows, "busy_runs": sum(1 for r in rows if r["busy"])}
    print(f"{'mode':10} {'tok/s med [min-max]':>22} {'speedup':>8} {'match':>6} {'max err':>8} {'mean err':>9} {'top1':>6}")
    for m, v in summary.items():
        extra = (f"{v['match_rate']:6.2f} {v['max_logit_err']:8.3f} {v['mean_logit_err']:9.4f} {v['top1_agree']:6.3f}"
                 if m != "float32" else "")
        print(f"{m:10} {v['tok_s_median']:8.2f} [{v['tok_s_min']:.2f}-{v['tok_s_max']:.2f}]      "
              f"{v['speedup_vs_float32']:6.2f}x {extra}")
    print(f"match: greedy output equals float32's for all {a.max_tokens} tokens; {result['busy_runs']} of "
          f"{len(rows)} prompts ran with competing processes")
    atomic_write_text(Path(a.out), json.dumps(result, indent=1))
    if a.plot:
        _plot(summary, Path(a.plot), a.model)
    print(f"wrote {a.out}" + (f" and {a.plot}" if a.plot else ""))
    return result


def _plot(summary: dict, path: Path, model: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from specdec.quality.report import save_figure
    modes = list(summary)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar(modes, [summary[m]["tok_s_median"] for m in modes], color="tab:blue")
    ax1.set_ylabel("decode tokens/s (median)")
    ax1.set_title(f"{model}: speed")
    ax2.bar(modes[1:], [summary[m]["match_rate"] for m in modes[1:]], color="tab:green")
    ax2.set_ylim(0, 1)
    ax2.set_ylabel("greedy output == float32 (fraction of prompts)")
    ax2.set_title("agreement with the float32 oracle")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
