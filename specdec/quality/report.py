"""The `specdec eval` report: per-arm and per-set summaries, eval.json, eval.md and PNG plots.

Input is the list of per-run records eval.py builds (one per prompt and arm, already scored
against the reference). Aggregation rules: exact match, ROUGE-L and similarity are means over
prompts; BLEU is corpus BLEU over the arm's outputs; perplexity is per token over all of the arm's
output tokens; acceptance pools drafted and accepted tokens; tokens/s and speedup are medians
(speedup per prompt against the reference run of the same prompt, in the same sweep).
"""
from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path
from typing import TextIO

from specdec.fileio import atomic_write_text
from specdec.quality.text_metrics import bleu


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _token_perplexity(rows: list[dict]) -> float | None:
    """exp(total NLL / total tokens), the NLL of each output recovered from its perplexity."""
    scored = [r for r in rows if r["perplexity"] is not None]
    tokens = sum(r["generated_tokens"] for r in scored)
    if not tokens:
        return None
    return math.exp(sum(math.log(r["perplexity"]) * r["generated_tokens"] for r in scored) / tokens)


def _entry(rows: list[dict], ref_text: dict[tuple[str, int], str]) -> dict:
    diverged = [r["first_divergence"] for r in rows if r["first_divergence"] is not None]
    drafted = sum(r["drafted_tokens"] for r in rows)
    sims = [r["similarity"] for r in rows if r["similarity"] is not None]
    checks = [r["identical_to_plain_same_precision"] for r in rows
              if r["identical_to_plain_same_precision"] is not None]
    return {
        "precision": ",".join(sorted({r["precision"] for r in rows})),
        "num_prompts": len(rows),
        "exact_match_rate": sum(r["exact_match"] for r in rows) / len(rows),
        "num_diverged": len(diverged),
        "mean_first_divergence": statistics.mean(diverged) if diverged else None,
        "rouge_l": statistics.mean(r["rouge_l"] for r in rows),
        "bleu": bleu([ref_text[(r["set"], r["prompt"])] for r in rows], [r["text"] for r in rows]),
        "perplexity": _token_perplexity(rows),
        "similarity": statistics.mean(sims) if sims else None,
        "acceptance_rate": sum(r["accepted_tokens"] for r in rows) / drafted if drafted else None,
        "mean_accepted_length": statistics.mean(r["mean_accepted_length"] for r in rows),
        "mean_generated_tokens": statistics.mean(r["generated_tokens"] for r in rows),
        "tokens_per_second": _spread([r["tokens_per_second"] for r in rows]),
        "speedup": _spread([r["speedup"] for r in rows]),
        "identical_to_plain_same_precision": all(checks) if checks else None,
        "noisy_runs": sum(r["noisy"] for r in rows),
    }


def summarize(runs: list[dict], arms: list[str], sets: list[str]) -> dict:
    """{"summary": {arm: entry}, "per_set": {set: {arm: entry}}}; arms[0] is the reference."""
    ref_text = {(r["set"], r["prompt"]): r["text"] for r in runs if r["arm"] == arms[0]}
    return {"summary": {a: _entry([r for r in runs if r["arm"] == a], ref_text) for a in arms},
            "per_set": {s: {a: _entry([r for r in runs if r["arm"] == a and r["set"] == s], ref_text)
                            for a in arms} for s in sets}}


def write(report: dict, out_dir: Path) -> list[Path]:
    """eval.json, eval.md, eval.png and eval_sets.png under out_dir (atomically). Returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "eval.json", out_dir / "eval.md", out_dir / "eval.png", out_dir / "eval_sets.png"]
    atomic_write_text(paths[0], json.dumps(report, indent=1, ensure_ascii=False))
    atomic_write_text(paths[1], markdown(report))
    plot(report, paths[2], paths[3])
    return paths


COLUMN_NOTES = (
    ("- **exact match**: share of prompts whose whole output equals the reference's token for token; "
     "**first divergence**: mean token index where diverging outputs first differ."),
    ("- **ROUGE-L** (F-measure, 0–1, mean over prompts) and **BLEU** (corpus, 0–100, sacrebleu `zh` "
     "tokenizer) against the reference output text."),
    ("- **perplexity**: of each arm's own output under the float32 target, per token over all outputs "
     "(the reference row is the float32 model's perplexity of its own greedy text)."),
    ("- **similarity**: cosine of all-MiniLM-L6-v2 embeddings with the reference output "
     "(`--similarity`; measured only, never used to change outputs)."),
    ("- **acceptance**: accepted / drafted tokens; **mean accepted length**: tokens per decode-phase "
     "target forward (1 for plain decoding)."),
    ("- **tokens/s**: median over prompts at batch 1; **speedup**: median [min–max] over prompts of "
     "tokens/s against the reference on the same prompt, same run."),
)


# ---- text ---------------------------------------------------------------------------------------
def _f(x: float | None, fmt: str = ".3f") -> str:
    return "–" if x is None else format(x, fmt)


def _exact(e: dict) -> str:
    return f"{e['exact_match_rate']:.2f} ({e['num_prompts'] - e['num_diverged']}/{e['num_prompts']})"


def _arm_label(arm: str, report: dict) -> str:
    return f"{arm} (reference)" if arm == report["reference"] else arm


def markdown(report: dict) -> str:
    """The human-readable report: main table, speculative check, per-set table, column notes."""
    arms = [report["reference"]] + report["candidates"]
    spec = f"draft `{report['draft']}`, " if report["draft"] else ""
    num_runs = len(report["runs"])
    lines = [
        f"# specdec eval: {report['model']}", "",
        f"Reference: plain decoding in float32 (`{report['reference']}`). Candidates: "
        + ", ".join(f"`{c}`" for c in report["candidates"]) + f". {spec}k={report['k']} ({report['spec_policy']} policy).",
        f"Greedy, at most {report['max_tokens']} tokens, chat template {'on' if report['chat'] else 'off'}, "
        f"batch 1, arms interleaved per prompt. Sets: "
        + ", ".join(f"{s} ({report['num_prompts_per_set']})" for s in report["sets"])
        + f". Device {report['device']}; {report['noisy_runs']} of {num_runs} runs had competing processes "
        f"(> 0.5 cores). {report['created']}.", "",
        ("| candidate | precision | exact match | first divergence | ROUGE-L | BLEU | perplexity | similarity "
         "| acceptance | mean accepted length | tokens/s | speedup |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in arms:
        e = report["summary"][arm]
        sp = e["speedup"]
        lines.append(f"| {_arm_label(arm, report)} | {e['precision']} | {_exact(e)} | {_f(e['mean_first_divergence'], '.1f')} "
                     f"| {e['rouge_l']:.3f} | {e['bleu']:.1f} | {_f(e['perplexity'])} | {_f(e['similarity'])} "
                     f"| {_f(e['acceptance_rate'], '.2f')} | {e['mean_accepted_length']:.2f} "
                     f"| {e['tokens_per_second']['median']:.2f} "
                     f"| {sp['median']:.2f} [{sp['min']:.2f}–{sp['max']:.2f}] |")
    checks = [(a, report["summary"][a]["identical_to_plain_same_precision"]) for a in arms]
    checks = [(a, ok) for a, ok in checks if ok is not None]
    if checks:
        lines += ["", "Check, greedy speculative output equal to plain output at the same precision: "
                  + "; ".join(f"`{a}` {'identical' if ok else '**DIFFERS**'}" for a, ok in checks) + "."]
    lines += ["", "## Per set", "",
              "| set | candidate | exact match | ROUGE-L | BLEU | perplexity | similarity | acceptance | tokens/s | speedup |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for s in report["sets"]:
        for arm in arms:
            e = report["per_set"][s][arm]
            lines.append(f"| {s} | {_arm_label(arm, report)} | {_exact(e)} | {e['rouge_l']:.3f} | {e['bleu']:.1f} "
                         f"| {_f(e['perplexity'])} | {_f(e['similarity'])} | {_f(e['acceptance_rate'], '.2f')} "
                         f"| {e['tokens_per_second']['median']:.2f} | {e['speedup']['median']:.2f} |")
    lines += ["", "## Columns", "", *COLUMN_NOTES, "",
              "![quality and speedup per candidate](eval.png)", "", "![per set](eval_sets.png)", ""]
    return "\n".join(lines)


def print_table(report: dict, file: TextIO) -> None:
    print(f"{'candidate':24} {'exact':>6} {'ROUGE-L':>8} {'BLEU':>6} {'ppl':>7} {'sim':>6} {'accept':>7} "
          f"{'tok/fwd':>7} {'tok/s':>7} {'speedup':>7}", file=file)
    for arm in [report["reference"]] + report["candidates"]:
        e = report["summary"][arm]
        print(f"{arm:24} {e['exact_match_rate']:6.2f} {e['rouge_l']:8.3f} {e['bleu']:6.1f} {_f(e['perplexity']):>7} "
              f"{_f(e['similarity']):>6} {_f(e['acceptance_rate'], '.2f'):>7} {e['mean_accepted_length']:7.2f} "
              f"{e['tokens_per_second']['median']:7.2f} {e['speedup']['median']:7.2f}", file=file)


# ---- plots --------------------------------------------------------------------------------------
def save_figure(fig, path: Path) -> None:
    """Write a PNG under a temporary name, then rename: readers never see half a plot."""
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


def plot(report: dict, overall_path: Path, sets_path: Path) -> None:
    """Overall quality metrics and speedup per candidate; exact match and speedup per set."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cands = report["candidates"]
    summary = report["summary"]
    metrics = [("exact match", lambda e: e["exact_match_rate"]), ("ROUGE-L", lambda e: e["rouge_l"]),
               ("BLEU / 100", lambda e: e["bleu"] / 100)]
    if report["similarity"]:
        metrics.append(("similarity", lambda e: e["similarity"] or 0.0))
    title = f"{report['model']} vs plain float32, k={report['k']}, {report['max_tokens']} tokens"

    fig, (ax_q, ax_s) = plt.subplots(1, 2, figsize=(max(9, 2.2 * len(cands)), 4))
    width = 0.8 / len(metrics)
    for j, (label, get) in enumerate(metrics):
        ax_q.bar([i + j * width for i in range(len(cands))], [get(summary[c]) for c in cands], width, label=label)
    ax_q.set_xticks([i + 0.4 - width / 2 for i in range(len(cands))], cands, rotation=20, fontsize=8)
    ax_q.set_ylim(0, 1.05)
    ax_q.set_title("agreement with the reference", fontsize=9)
    ax_q.legend(fontsize=7)
    med = [summary[c]["speedup"]["median"] for c in cands]
    err = [[m - summary[c]["speedup"]["min"] for c, m in zip(cands, med)],
           [summary[c]["speedup"]["max"] - m for c, m in zip(cands, med)]]
    ax_s.bar(range(len(cands)), med, yerr=err, capsize=3, color="tab:gray")
    ax_s.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax_s.set_xticks(range(len(cands)), cands, rotation=20, fontsize=8)
    ax_s.set_ylabel("speedup over the reference (median, min-max)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, overall_path)
    plt.close(fig)

    sets = report["sets"]
    fig, (ax_e, ax_p) = plt.subplots(1, 2, figsize=(max(9, 1.8 * len(sets) * 2), 4))
    width = 0.8 / len(cands)
    for j, c in enumerate(cands):
        xs = [i + j * width for i in range(len(sets))]
        ax_e.bar(xs, [report["per_set"][s][c]["exact_match_rate"] for s in sets], width, label=c)
        ax_p.bar(xs, [report["per_set"][s][c]["speedup"]["median"] for s in sets], width, label=c)
    for ax, ylabel in ((ax_e, "exact match rate"), (ax_p, "speedup (median)")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sets))], sets)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    ax_p.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    fig.suptitle(title + ", per set", fontsize=9)
    fig.tight_layout()
    save_figure(fig, sets_path)
    plt.close(fig)
