"""Tokens/s of a forced tool call, constrained against free: `python -m specdec.bench.tool_speed`.

A named or required call's name, keys and punctuation are forced by its grammar and travel as free
drafts, so a constrained call should decode faster than the same number of unconstrained tokens.
Both run on one engine (the default pair, speculation as configured), alternated over rounds;
the report gives each side's median tokens/s with min-max and the per-round ratio, beside the
machine's plain-decode memory ceiling (read bandwidth over the bytes one target step reads). JSON out.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

from specdec.fileio import atomic_write_text

QUESTION = "What's the weather like in Paris right now, in celsius?"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                             "parameters": {"type": "object", "required": ["city", "unit"],
                                                            "properties": {"city": {"type": "string"},
                                                                           "unit": {"enum": ["celsius", "fahrenheit"]}}}}}


def _round(llm, ids: list[int], grammar) -> dict:
    from specdec.sampling_params import SamplingParams
    forced = llm.generate([ids], SamplingParams(max_tokens=64, structured=grammar))[0]
    n = len(forced.token_ids)
    free = llm.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True))[0]
    return {"tokens": n, "constrained_tok_s": forced.stats.tokens_per_second,
            "free_tok_s": free.stats.tokens_per_second, "ratio": forced.stats.tokens_per_second / free.stats.tokens_per_second,
            "forced_accepted": forced.stats.forced_accepted_tokens,
            "text": forced.text}


def run(rounds: int, machine: str) -> dict:
    from specdec.bench.bandwidth import ceiling, measure_read_bandwidth
    from specdec.llm import LLM
    from specdec.config import EngineConfig, ModelConfig, SpeculativeConfig
    from specdec.server.tool_grammar import call_grammar
    from specdec.server.tools import check_tools
    config = EngineConfig(model=ModelConfig(), speculative=SpeculativeConfig(
        method="draft_model", draft_model="qwen2.5-coder-0.5b-instruct"))
    llm = LLM(config=config, progress=False)
    target = llm.engine.loaded
    roof = ceiling(measure_read_bandwidth(), target.weights, target.config.tie_embeddings, target.path)
    tok = llm.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTION}], tools=[WEATHER]),
                     add_special_tokens=False)
    grammar = call_grammar(check_tools([WEATHER]), "get_weather", True)
    _round(llm, ids, grammar)   # warm-up: kernels, grammar compile, thread choice
    per_round = [_round(llm, ids, grammar) for _ in range(rounds)]

    def stat(key: str) -> dict:
        values = [r[key] for r in per_round]
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return {"bench": "tool_speed", "command": f"python -m specdec.bench.tool_speed --rounds {rounds}", "machine": machine, "python": platform.python_version(),
            "precision": llm.engine.precision,
            "ceiling": roof, "rounds": per_round, "constrained_tok_s": stat("constrained_tok_s"), "free_tok_s": stat("free_tok_s"),
            "ratio": stat("ratio")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec.bench.tool_speed", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--machine", default=platform.processor() or platform.machine(), help="named in the report")
    p.add_argument("--out", default="bench-tool-speed.json")
    a = p.parse_args(argv)
    report = run(a.rounds, a.machine)
    atomic_write_text(Path(a.out), json.dumps(report, indent=1))
    r, c, f = report["ratio"], report["constrained_tok_s"], report["free_tok_s"]
    print(f"named call: constrained {c['median']:.1f} tok/s [{c['min']:.1f}-{c['max']:.1f}], free {f['median']:.1f} "
          f"[{f['min']:.1f}-{f['max']:.1f}], ratio {r['median']:.2f}x [{r['min']:.2f}-{r['max']:.2f}]; plain-decode "
          f"ceiling {report['ceiling']['ceiling_tokens_per_second']:.1f} tok/s ({report['ceiling']['bandwidth_gb_s']:.1f} GB/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
