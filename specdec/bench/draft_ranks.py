"""`python -m specdec.bench.draft_ranks`: where the target's greedy token ranks among the draft's choices.

The target decodes each prompt greedily; the draft then reads prompt and answer in one teacher-forced
pass, and each answer token's rank among the draft's logits at its position (its whole vocabulary) is
counted. The share at rank 1 is the chance a greedy chain's next draft is accepted; the share within the
top n is what a draft tree verifying n candidates a position could accept at most. Together with the
step prices (`specdec bench steps`) they bound what any draft shape gains with this pair on each set.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.catalog import default_draft
from specdec.config import DEFAULT_TARGET
from specdec.extras import require_plotting
from specdec.fileio import atomic_write_text
from specdec.prompts import read_set

RANKS = (1, 2, 3, 4, 8)
BLOCK = 16


@dataclass
class SetRanks:
    name: str
    tokens: int
    within: dict[int, float]  # rank n -> share of answer tokens the draft ranks at n or better


def answers(target: str, precision: str, prompts: dict[str, list[str]],
            max_tokens: int) -> dict[str, list[tuple[list[int], list[int]]]]:
    """Each set's (prompt ids, greedy answer ids) of its chat-templated prompts, from the target alone."""
    from tqdm import tqdm

    from specdec import LLM, SamplingParams
    llm = LLM(target, precision=precision, progress=False)
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0)
    decoded = {}
    for name, texts in tqdm(prompts.items(), desc="draft_ranks: target answers", unit="set", file=sys.stderr):
        outs = [llm.chat([{"role": "user", "content": p}], greedy) for p in texts]
        decoded[name] = [(o.prompt_token_ids, o.token_ids) for o in outs]
    return decoded


class TeacherForced:
    """The draft's logits at every position of a token sequence, one chunked pass over it."""

    def __init__(self, draft: str, precision: str, requantize: str | None, max_len: int) -> None:
        from specdec.models.llama import LlamaModel
        from specdec.models.loader import load_model
        from specdec.runner.model_runner import ModelRunner
        loaded = load_model(draft, precision, "cpu", progress=False, requant=requantize)
        blocks = -(-max_len // BLOCK)
        model = LlamaModel(loaded.config, loaded.weights, blocks * BLOCK, torch.device("cpu"))
        self.runner = ModelRunner(model, blocks, BLOCK, torch.device("cpu"))
        self.table, self.max_len = list(range(blocks)), blocks * BLOCK

    def logits(self, ids: list[int], chunk: int = 256) -> torch.Tensor:
        from specdec.core.outputs import ScheduledChunk, SchedulerOutput
        if len(ids) > self.max_len:
            raise ValueError(f"draft_ranks: {len(ids)} tokens exceed the {self.max_len} this pass was sized for")
        rows = []
        for start in range(0, len(ids), chunk):
            part = ids[start:start + chunk]
            sched = SchedulerOutput([ScheduledChunk("ranks", part, start, self.table, len(part))], len(part))
            rows.append(self.runner.execute(sched).logits.float())
        return torch.cat(rows)


def ranks(draft: TeacherForced, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """Each answer token's rank (1 = the draft's first choice) among the draft's logits at its position."""
    logits = draft.logits(prompt + answer[:-1])[len(prompt) - 1:]
    mine = logits.gather(1, torch.tensor(answer)[:, None])
    return (logits > mine).sum(1) + 1


def summarize(name: str, r: torch.Tensor) -> SetRanks:
    return SetRanks(name, len(r), {n: round((r <= n).float().mean().item(), 4) for n in RANKS})


def run(target: str, draft: str, precision: str, requantize: str | None, sets: list[str], num_prompts: int,
        max_tokens: int) -> list[SetRanks]:
    prompts = {s: read_set(s)[:num_prompts] for s in sets}
    decoded = answers(target, precision, prompts, max_tokens)
    longest = max(len(p) + len(a) for items in decoded.values() for p, a in items)
    forced = TeacherForced(draft, precision, requantize, longest)
    return [summarize(s, torch.cat([ranks(forced, p, a) for p, a in items])) for s, items in decoded.items()]


def _plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for s in report["sets"]:
        ax.plot(RANKS, [s["within"][str(n)] for n in RANKS], marker="o", label=f"{s['name']} ({s['tokens']} tokens)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("the draft's n best choices")
    ax.set_ylabel("share of the target's greedy tokens among them")
    ax.set_title(f"{report['draft']} (packed: {report['draft_requantize']}) for {report['target']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec.bench.draft_ranks", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_TARGET, help="the target")
    p.add_argument("--draft", default=None, help="the draft (default: the target's registry draft)")
    p.add_argument("--precision", default="int4-a8")
    p.add_argument("--draft-requantize", default="auto", help="as the engine packs drafts: auto, none, q4_1, q4_64, q3_64")
    p.add_argument("--sets", default="code_gen,chat,prose")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--out", default="draft-ranks.json")
    p.add_argument("--plot", default=None, help="PNG path (default: --out with .png; empty for none)")
    a = p.parse_args(argv)
    draft = a.draft or default_draft(a.model)
    if draft is None or a.num_prompts < 1 or a.max_tokens < 2:
        p.error("needs a draft (--draft, or a target with a registry draft), --num-prompts >= 1, --max-tokens >= 2")
    requantize = None if a.draft_requantize == "none" else a.draft_requantize
    plot = a.out.rsplit(".", 1)[0] + ".png" if a.plot is None else a.plot
    require_plotting(plot, "draft_ranks")
    results = run(a.model, draft, a.precision, requantize, a.sets.split(","), a.num_prompts, a.max_tokens)
    report = {"mode": "draft_ranks", "target": a.model, "draft": draft, "precision": a.precision,
              "draft_requantize": a.draft_requantize, "num_prompts": a.num_prompts, "max_tokens": a.max_tokens,
              "sets": [{"name": r.name, "tokens": r.tokens, "within": {str(n): v for n, v in r.within.items()}}
                       for r in results]}
    atomic_write_text(Path(a.out), json.dumps(report, indent=1) + "\n")
    for r in results:
        print(f"{r.name:10s} {r.tokens:5d} tokens  " + "  ".join(f"top {n}: {v:.3f}" for n, v in r.within.items()))
    if plot:
        _plot(report, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
