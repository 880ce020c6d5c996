"""`specdec generate --compare-plain`: speculative against plain decoding on the same weights, timed
so that the figure can be trusted.

Both engines are warmed up first; then each round runs the prompts once per side, the order
alternating between rounds (a machine that speeds up or slows down hits both sides alike). Per side
the median tokens/s over the rounds; the speedup is the median of the rounds' paired ratios, with
their min and max. Timings taken while other processes competed for the CPU are flagged, and with
nothing drafted there is no speedup to speak of, so none is printed.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from specdec.contention import Contention, busy_warning
from specdec.speculation import registry


@dataclasses.dataclass
class Run:
    """One side's pass over the prompts in one round."""
    outputs: list
    seconds: float
    contention: Contention

    @property
    def tokens(self) -> int:
        return sum(o.stats.generated_tokens for o in self.outputs)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def add_args(g: argparse.ArgumentParser) -> None:
    g.add_argument("--compare-plain", action="store_true",
                   help="also run plain decoding on the same weights, alternating with speculation over "
                        "--compare-repeats rounds, and print the median speedup")
    g.add_argument("--compare-repeats", type=int, default=3, metavar="N",
                   help="rounds of --compare-plain (default 3)")


def compare(a: argparse.Namespace, llm, inputs: list, params) -> tuple[list, list[str]]:
    """Time `llm` (speculative) against a plain engine on its weights. Returns the speculative
    outputs of the first round and the report's lines (for stderr, after the outputs)."""
    from specdec.llm import LLM
    plain = LLM(config=dataclasses.replace(llm.engine.config, speculative=None), loaded=llm.engine.loaded)
    warm_up([llm, plain], inputs[0])
    runs: dict[str, list[Run]] = {"spec": [], "plain": []}
    for n in range(a.compare_repeats):
        order = [("spec", llm), ("plain", plain)]
        for side, engine in order if n % 2 == 0 else order[::-1]:
            runs[side].append(_timed(engine, inputs, params, a.batch))
    return runs["spec"][0].outputs, report(runs, llm.engine.config.speculative, params.greedy)


def warm_up(llms: list, prompt) -> None:
    """A few throwaway tokens on each engine from the prompt's first token (a one-token prompt fills
    no prefix-cache block): the first forwards of a process page the weights in, start the thread
    pool and make the thread tuner's first tries, which belong to neither side of the comparison."""
    from specdec.sampling_params import SamplingParams
    for llm in llms:
        llm.generate([prompt[:1]], SamplingParams(max_tokens=4, ignore_eos=True))


def _timed(llm, inputs: list, params, batch: bool) -> Run:
    with Contention() as busy:
        t0 = time.perf_counter()
        outputs = llm.generate(inputs, params, batch=batch)
        seconds = time.perf_counter() - t0
    return Run(outputs, seconds, busy)


def report(runs: dict[str, list[Run]], spec, greedy: bool) -> list[str]:
    """The comparison's stderr lines: each side's median rate, the paired speedup (or why there is
    none), whether the output matched, and a warning when other processes competed."""
    spec_runs, plain_runs = runs["spec"], runs["plain"]
    n = len(spec_runs)
    outs = [o for r in spec_runs for o in r.outputs]
    drafted, accepted = sum(o.stats.drafted_tokens for o in outs), sum(o.stats.accepted_tokens for o in outs)
    first = outs[0].stats
    what = first.proposer if (first.proposer or "").startswith(first.method) else f"{first.method} {first.proposer}"
    if drafted:
        forward = statistics.fmean(o.stats.mean_accepted_length for o in outs)
        what += f": acceptance {accepted / drafted:.2f}, {forward:.2f} tokens/forward"
    else:
        what += ": nothing drafted"
    rounds = f"median of {n} round{'s' if n > 1 else ''}"
    lines = [f"plain decoding:       {plain_runs[0].tokens} tokens, "
             f"{statistics.median(r.tokens_per_second for r in plain_runs):.2f} tokens/s ({rounds})",
             f"speculative decoding: {spec_runs[0].tokens} tokens, "
             f"{statistics.median(r.tokens_per_second for r in spec_runs):.2f} tokens/s ({rounds}; {what})"]
    same = all(s.token_ids == p.token_ids for rs, rp in zip(spec_runs, plain_runs)
               for s, p in zip(rs.outputs, rp.outputs))
    match = "output identical to plain" if same else (
        "output differs from plain (sampling)" if not greedy else "OUTPUT DIFFERS FROM PLAIN (greedy: a bug)")
    if drafted:
        ratios = [s.tokens_per_second / p.tokens_per_second for s, p in zip(spec_runs, plain_runs)]
        spread = f", min {min(ratios):.2f}x, max {max(ratios):.2f}x" if n > 1 else ""
        lines.append(f"speedup {statistics.median(ratios):.2f}x (median of {n} paired "
                     f"round{'s' if n > 1 else ''}{spread}); {match}")
    else:
        lines.append(f"no speedup figure: nothing was drafted ({_no_drafts_reason(spec)}); {match}")
    warning = busy_warning([r.contention for r in spec_runs + plain_runs])
    return lines + ([warning] if warning else [])


def _no_drafts_reason(spec) -> str:
    """Why a speculative engine may draft nothing, as far as its configuration tells."""
    if spec.num_speculative_tokens == 0:
        return "k = 0"
    chose = {"cost_model": "the cost model chose plain decoding",
             "heuristic": "the heuristic policy chose plain decoding"}.get(spec.policy)
    if registry.get(spec.method).needs_model:
        return chose or "the fixed policy drafted nothing"
    found = "the lookup found no match in the prompt or the output"
    return f"{chose}, or {found}" if chose else found
