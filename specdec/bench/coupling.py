"""Gumbel coupling against rejection sampling on the default pair: `python -m specdec.bench.coupling`.

Two measurements, one run:
  * acceptance: on every shipped set, at each temperature, the same seeded requests (chat-templated,
    k fixed) verified both ways; the draft tokens accepted over those drafted, and the tokens per
    target forward, for each mode;
  * exactness: hold-out prompts (the sets' last ones, not used above), seeded at one temperature,
    decoded plainly and with each proposer under coupling; how many texts equal the plain one token
    for token.
JSON out, with a PNG of acceptance by set and mode.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import replace
from pathlib import Path

from specdec.extras import require_plotting
from specdec.fileio import atomic_write_text
from specdec.prompts import SETS, read_set

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def _chat_ids(tok, prompts: list[str]) -> list[list[int]]:
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
            for p in prompts]


def _engines(k: int, methods: tuple[str, ...]):
    """{name: LLM} sharing one copy of each model: plain, and each (method, coupling)."""
    from specdec.config import ControllerConfig, EngineConfig, ModelConfig, SamplingConfig, SpeculativeConfig
    from specdec.llm import LLM
    plain = LLM(config=EngineConfig(model=ModelConfig(model=TARGET)), progress=False)
    engines, draft = {"plain": plain}, None
    for method in methods:
        for coupling in ("gumbel", "rejection"):
            spec = SpeculativeConfig(method=method, draft_model=DRAFT if method == "draft_model" else None,
                                     num_speculative_tokens=k, policy="fixed",
                                     controller=ControllerConfig(acceptance_threshold=0.0))
            config = EngineConfig(model=ModelConfig(model=TARGET, precision=plain.engine.precision),
                                  speculative=spec, sampling=SamplingConfig(coupling))
            llm = LLM(config=config, loaded=plain.engine.loaded, progress=False,
                      draft_loaded=draft if method == "draft_model" else None)
            if method == "draft_model" and draft is None:   # loaded once, in the precision auto picks for it
                sp = llm.engine.speculator
                draft = sp.proposers[sp.default_id].loaded
            engines[f"{method}/{coupling}"] = llm
    return engines


def _params(n: int, temperature: float, max_tokens: int, seed: int):
    from specdec.sampling_params import SamplingParams
    base = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
    return [replace(base, seed=seed + i) for i in range(n)]


def acceptance(engines: dict, tok, sets: list[str], per_set: int, temperatures: list[float], max_tokens: int,
               bar) -> list[dict]:
    rows = []
    for name in sets:
        ids = _chat_ids(tok, read_set(name)[:per_set])
        for t in temperatures:
            row = {"set": name, "temperature": t}
            for coupling in ("gumbel", "rejection"):
                outs = engines[f"draft_model/{coupling}"].generate(ids, _params(len(ids), t, max_tokens, 1000))
                drafted = sum(o.stats.drafted_tokens for o in outs)
                accepted = sum(o.stats.accepted_tokens for o in outs)
                forwards = sum(o.stats.generated_tokens / o.stats.mean_accepted_length for o in outs)
                row[coupling] = {"drafted": drafted, "accepted": accepted,
                                 "acceptance": accepted / drafted if drafted else None,
                                 "tokens_per_forward": sum(o.stats.generated_tokens for o in outs) / forwards}
                bar.update()
            g, r = row["gumbel"]["acceptance"], row["rejection"]["acceptance"]
            row["gumbel_over_rejection"] = g / r if g is not None and r else None
            rows.append(row)
    return rows


def exactness(engines: dict, tok, sets: list[str], holdout: int, temperature: float, max_tokens: int,
              methods: tuple[str, ...], bar) -> dict:
    prompts = [p for name in sets for p in read_set(name)[-holdout:]]
    ids = _chat_ids(tok, prompts)
    params = _params(len(ids), temperature, max_tokens, 7000)
    ref = [o.token_ids for o in engines["plain"].generate(ids, params)]
    out = {"prompts": len(ids), "temperature": temperature, "max_tokens": max_tokens, "by_method": {}}
    for method in methods:
        got = engines[f"{method}/gumbel"].generate(ids, params)
        equal = [o.token_ids == r for o, r in zip(got, ref)]
        out["by_method"][method] = {"equal": sum(equal), "of": len(equal),
                                    "drafted": sum(o.stats.drafted_tokens for o in got),
                                    "accepted": sum(o.stats.accepted_tokens for o in got),
                                    "first_mismatch": next((i for i, e in enumerate(equal) if not e), None)}
        bar.update()
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{r['set']}\nT={r['temperature']:g}" for r in rows]
    xs = range(len(rows))
    for offset, coupling in ((-0.2, "gumbel"), (0.2, "rejection")):
        ax.bar([x + offset for x in xs], [r[coupling]["acceptance"] or 0 for r in rows], width=0.4, label=coupling)
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("draft tokens accepted / drafted")
    ax.set_title("0.5B draft for the 1.5B target: Gumbel coupling vs rejection sampling")
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec.bench.coupling", description=__doc__.splitlines()[0])
    p.add_argument("--sets", default=",".join(SETS))
    p.add_argument("--per-set", type=int, default=4, help="prompts per set for acceptance")
    p.add_argument("--temperatures", default="0.7,1.0")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--holdout", type=int, default=2, help="hold-out prompts per set for exactness")
    p.add_argument("--exact-temperature", type=float, default=0.8)
    p.add_argument("--machine", required=True, help="the machine, named in the report (e.g. xeon)")
    p.add_argument("--out", default=None, help="JSON path (default docs/results/bench-coupling-MACHINE.json)")
    a = p.parse_args(argv)
    require_plotting("png", "python -m specdec.bench.coupling")   # before minutes of decoding, not after
    from tqdm import tqdm
    sets, temps = a.sets.split(","), [float(t) for t in a.temperatures.split(",")]
    methods = ("draft_model", "suffix")
    engines = _engines(a.k, methods)
    tok = engines["plain"].tokenizer
    with tqdm(total=len(sets) * len(temps) * 2 + len(methods), desc="coupling", file=sys.stderr) as bar:
        rows = acceptance(engines, tok, sets, a.per_set, temps, a.max_tokens, bar)
        exact = exactness(engines, tok, sets, a.holdout, a.exact_temperature, a.max_tokens, methods, bar)
    out = Path(a.out or f"docs/results/bench-coupling-{a.machine}.json")
    report = {"bench": "coupling", "command": "python -m specdec.bench.coupling " + " ".join(argv or sys.argv[1:]),
              "machine": a.machine, "python": platform.python_version(), "target": TARGET, "draft": DRAFT,
              "precision": engines["plain"].engine.precision, "k": a.k, "max_tokens": a.max_tokens,
              "acceptance": rows, "exactness": exact}
    atomic_write_text(out, json.dumps(report, indent=2) + "\n")
    plot(rows, out.with_suffix(".png"))
    for r in rows:
        g, rj = r["gumbel"]["acceptance"], r["rejection"]["acceptance"]
        print(f"{r['set']:10s} T={r['temperature']:<4g} gumbel {g:.3f}  rejection {rj:.3f}  "
              f"ratio {r['gumbel_over_rejection']:.3f}")
    for m, e in exact["by_method"].items():
        print(f"exact {m}: {e['equal']}/{e['of']} seeded texts equal plain (T={exact['temperature']})")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
