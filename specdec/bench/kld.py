"""`specdec kld`: how far each precision mode's next-token distributions are from float32's, with
llama.cpp on the same GGUF as the anchor.

The shipped corpus (bench/corpus/kld.jsonl: code, prose, chat and Chinese; see make_kld_corpus.py) is
tokenized per kind and cut into chunks of `--ctx` tokens. Each chunk is teacher-forced through float32
(the reference), every other mode, and llama.cpp (its peer venv, every position's logits); per scored
position we keep the statistics of llama.cpp's `perplexity --kl-divergence`: KL(float32 || mode), whether
the top-1 token is the same, Δp (the probability the mode gives the text's next token minus float32's)
and both log-likelihoods. As that tool does, the verdict scores each chunk's second half (`--first`);
every row's figures are reported beside them. Modes run in lockstep per chunk, so only one chunk's logits are in memory.
Then a short greedy decode per mode (interleaved repeats) ranks their speed. With --save the verdict
goes to $SPECDEC_HOME/precision/, where `precision: auto` reads it (quant/criterion.py).
"""
from __future__ import annotations

import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdec.quant.criterion import KLD_MARGIN, TOP1_MARGIN, Measurement, ModeScore
from specdec.extras import require_plotting

CORPUS = Path(__file__).parent / "corpus" / "kld.jsonl"
ANCHOR = "llama.cpp"


@dataclass
class Divergence:
    """Running per-position statistics of one mode against the reference."""
    kld: list[float] = field(default_factory=list)
    dp: list[float] = field(default_factory=list)
    same_top1: int = 0
    nll_ref: float = 0.0
    nll: float = 0.0

    def add(self, ref: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, rows: int = 64) -> None:
        """ref, logits: [n, vocab] over the same support (finite columns of the reference);
        targets: [n], the text's next tokens. In float64, `rows` at a time (bounded memory)."""
        for i in range(0, len(targets), rows):
            self._add(ref[i:i + rows], logits[i:i + rows], targets[i:i + rows])

    def _add(self, ref: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> None:
        ref_lp, lp = torch.log_softmax(ref.double(), -1), torch.log_softmax(logits.double(), -1)
        self.kld += (ref_lp.exp() * (ref_lp - lp)).sum(-1).clamp_min(0).tolist()
        self.same_top1 += int((ref.argmax(-1) == logits.argmax(-1)).sum())
        t_ref, t = ref_lp.gather(1, targets[:, None])[:, 0], lp.gather(1, targets[:, None])[:, 0]
        self.dp += (t.exp() - t_ref.exp()).tolist()
        self.nll_ref -= float(t_ref.sum())
        self.nll -= float(t.sum())

    def extend(self, other: Divergence) -> None:
        """Take in another run's positions (a chunk scored once counts toward several summaries)."""
        self.kld += other.kld
        self.dp += other.dp
        self.same_top1 += other.same_top1
        self.nll_ref += other.nll_ref
        self.nll += other.nll

    def summary(self) -> dict:
        n = len(self.kld)
        if not n:
            return {"tokens": 0}
        ordered = sorted(self.kld)
        return {"tokens": n, "mean_kld": sum(self.kld) / n, "median_kld": ordered[n // 2],
                "p99_kld": ordered[min(n - 1, math.ceil(0.99 * n) - 1)], "max_kld": ordered[-1],
                "same_top1": self.same_top1 / n, "rms_dp": math.sqrt(sum(d * d for d in self.dp) / n),
                "ppl": math.exp(self.nll / n), "ppl_ref": math.exp(self.nll_ref / n),
                "ppl_ratio": math.exp((self.nll - self.nll_ref) / n)}


def read_corpus(path: Path = CORPUS) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def chunks(tokenizer, rows: list[dict], ctx: int, max_tokens: int | None = None) -> list[tuple[str, list[int]]]:
    """Each kind's documents joined by blank lines, tokenized, cut into chunks of `ctx` tokens (the last
    one only if at least 64 long); kinds interleaved so that a token limit still samples every kind."""
    per_kind: dict[str, list[list[int]]] = {}
    for kind in dict.fromkeys(r["kind"] for r in rows):
        ids = tokenizer.encode("\n\n".join(r["text"] for r in rows if r["kind"] == kind), add_special_tokens=False)
        per_kind[kind] = [ids[i:i + ctx] for i in range(0, len(ids), ctx) if len(ids[i:i + ctx]) >= 64]
    out, scored = [], 0
    for i in range(max(len(c) for c in per_kind.values())):
        for kind, cs in per_kind.items():
            if i < len(cs) and (max_tokens is None or scored < max_tokens):
                out.append((kind, cs[i]))
                scored += len(cs[i]) - 1
    return out


def _decode_speed(llms: dict, prompt: list[int], tokens: int, repeats: int) -> dict[str, float]:
    """Median batch-1 greedy decode tokens/s per mode, modes interleaved per repeat."""
    from specdec.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    runs: dict[str, list[float]] = {m: [] for m in llms}
    for _ in range(repeats + 1):  # the first round warms each mode up (thread tuner, caches)
        for m, llm in llms.items():
            runs[m].append(llm.generate([prompt], params)[0].stats.decode_tokens_per_second)
    return {m: statistics.median(r[1:]) for m, r in runs.items()}


@dataclass
class Scores:
    """Each mode's divergence per (scope, kind): scope "scored" counts the rows from --first on (llama.cpp's
    `--kl-divergence` scores the second half of each window: a row's first few positions are predicted
    from a few tokens of context, where every quantized mode is far off), "positions" every row."""
    names: list[str]
    by: dict[tuple[str, str, str], Divergence] = field(default_factory=dict)

    def add(self, mode: str, kind: str, scope: str, chunk: Divergence) -> None:
        for k in ("all", kind):
            self.by.setdefault((mode, scope, k), Divergence()).extend(chunk)

    def summary(self, mode: str, scope: str, kind: str = "all") -> dict:
        return self.by.get((mode, scope, kind), Divergence()).summary()


def _engines(a, modes: list[str]) -> dict:
    """An engine per mode: a precision, with `:kv=DTYPE` a K/V cache format other than its auto one."""
    from specdec.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, split_kv
    from specdec.llm import LLM

    def config(mode: str) -> EngineConfig:
        precision, kv = split_kv(mode)
        return EngineConfig(model=ModelConfig(model=a.model, precision=precision, num_threads=a.threads),
                            cache=CacheConfig(target_cache_blocks=a.ctx // 16 + 8, enable_prefix_caching=False,
                                              kv_cache_dtype=kv),
                            scheduler=SchedulerConfig(max_num_batched_tokens=a.ctx))
    return {m: LLM(config=config(m), progress=False) for m in modes}


def _chunk_logits(engines: dict, peer, ids: list[int], never: torch.Tensor, scratch: Path,
                  seconds: dict[str, float]) -> dict[str, torch.Tensor]:
    """Every mode's (and the anchor's) logits at each row of one chunk: [len(ids) - 1, vocab]."""
    logits = {}
    for m, eng in engines.items():
        t0 = time.perf_counter()
        logits[m] = eng.teacher_logits(ids[:1], ids[1:])
        seconds[m] += time.perf_counter() - t0
    if peer:
        out, s = peer.score(ids, scratch)
        seconds[ANCHOR] += s
        peer_logits = torch.from_numpy(out[:-1, : logits["float32"].shape[1]]).clone()
        peer_logits[:, never[never < peer_logits.shape[1]]] = -math.inf  # the same support as ours
        logits[ANCHOR] = peer_logits
    return logits


def _score_chunk(scores: Scores, kind: str, ids: list[int], logits: dict[str, torch.Tensor], first: int) -> None:
    """Adds one chunk's rows to every mode's statistics: all rows to "positions", rows >= first to "scored".
    Each row is scored once: the early rows' and the late rows' statistics, both counting toward "positions"."""
    targets = torch.tensor(ids[1:])
    support = logits["float32"][0].isfinite()
    keep = support[targets]  # a never-sample token in the text is not scored
    late = torch.arange(len(targets)) >= first
    for scopes, rows in ((("positions",), keep & ~late), (("positions", "scored"), keep & late)):
        if not rows.any():
            continue
        ref, cols = logits["float32"][rows][:, support], _remap(targets[rows], support)
        for m in scores.names:
            chunk = Divergence()
            chunk.add(ref, logits[m][rows][:, support], cols)
            for scope in scopes:
                scores.add(m, kind, scope, chunk)


def run_kld(a) -> dict:
    from tqdm import tqdm

    from specdec.bench import llama_cpp_peer
    from specdec.models.loader import resolve

    modes = ["float32"] + [m for m in a.modes.split(",") if m != "float32"]
    _, gguf = resolve(a.model, pull=True)  # the CLI pulls on first use
    llms = _engines(a, modes)
    engines = {m: llm.engine for m, llm in llms.items()}
    tok = llms["float32"].tokenizer
    work = chunks(tok, read_corpus(Path(a.corpus)), a.ctx, a.max_tokens)
    peer = None
    if a.llama_cpp:
        if not llama_cpp_peer.is_installed():
            raise ValueError("the llama.cpp anchor is not installed: add --install-peer (builds it, about 9 minutes) "
                             "or pass --no-llama-cpp")
        peer = llama_cpp_peer.LlamaCppPeer(ANCHOR, gguf, a.threads or 2, a.ctx, logits_all=True)
    scores = Scores(modes[1:] + ([ANCHOR] if peer else []))
    seconds = {m: 0.0 for m in modes + ([ANCHOR] if peer else [])}
    never = torch.tensor(sorted(tok.never_sample_ids), dtype=torch.long)
    with tempfile.TemporaryDirectory(prefix="specdec-kld-") as scratch:
        for kind, ids in tqdm(work, desc="specdec kld", unit="chunk", file=sys.stderr):
            _score_chunk(scores, kind, ids, _chunk_logits(engines, peer, ids, never, Path(scratch), seconds), a.first)
    if peer:
        peer.close()
    speed = _decode_speed(llms, work[0][1][:128], a.decode_tokens, a.repeats) if a.decode_tokens else {}
    forwarded = sum(len(ids) - 1 for _, ids in work)
    result = _result(a, gguf, modes, scores, [k for k, _ in work], speed, forwarded, seconds)
    result["llama_cpp_version"] = peer.version if peer else None
    if peer:
        v = verdict(result)
        result["criterion"] = {"meets": [m for m in v.modes if v.meets(m)], "auto": v.choose(tuple(v.modes))}
    return result


def _result(a, gguf: Path, modes: list[str], scores: Scores, kinds: list[str], speed: dict[str, float],
            forwarded: int, seconds: dict[str, float]) -> dict:
    """The JSON of a run: per mode the "scored" rows' statistics overall (`all`) and per kind, and every
    row's (`all_positions`)."""
    kinds = list(dict.fromkeys(kinds))
    lead = scores.names[0] if scores.names else None
    mode_result = lambda m: {  # noqa: E731
        "all": scores.summary(m, "scored"), "all_positions": scores.summary(m, "positions"),
        "by_kind": {k: scores.summary(m, "scored", k) for k in kinds},
        "prompt_tok_s": forwarded / seconds[m] if seconds[m] else None, "decode_tok_s": speed.get(m)}
    return {"mode": "kld", "model": a.model, "gguf": gguf.name, "file_bytes": gguf.stat().st_size,
            "modes_scored": modes[1:], "corpus": a.corpus, "machine": machine(), "threads": a.threads,
            "ctx": a.ctx, "first": a.first, "max_tokens": a.max_tokens,
            "decode_tokens": a.decode_tokens, "repeats": a.repeats,
            "tokens": scores.summary(lead, "scored")["tokens"] if lead else 0,
            "tokens_all_positions": scores.summary(lead, "positions")["tokens"] if lead else 0,
            "kinds": {k: scores.summary(lead, "scored", k)["tokens"] if lead else 0 for k in kinds},
            "modes": {m: mode_result(m) for m in scores.names},
            "float32": {"prompt_tok_s": forwarded / seconds["float32"], "decode_tok_s": speed.get("float32")},
            "margins": {"kld": KLD_MARGIN, "top1": TOP1_MARGIN}}


def machine() -> str:
    """The CPU's model name and logical CPU count, as the results record it."""
    import os
    try:
        name = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform
        name = platform.processor() or platform.machine()
    return f"{name}, {os.cpu_count()} logical CPUs"


def _remap(targets: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """Token ids -> their column among the supported (finite) columns."""
    return (support.long().cumsum(0) - 1)[targets]


def verdict(result: dict) -> Measurement:
    """The criterion's input from a run with the anchor: each mode's mean KLD, same-top-1 and decode speed."""
    def score(d: dict) -> ModeScore:
        return ModeScore(d["all"]["mean_kld"], d["all"]["same_top1"], d.get("decode_tok_s"))
    modes = {m: score(d) for m, d in result["modes"].items() if m != ANCHOR}
    modes["float32"] = ModeScore(0.0, 1.0, result["float32"]["decode_tok_s"])
    return Measurement(result["gguf"].removesuffix(".gguf"), result["file_bytes"], score(result["modes"][ANCHOR]),
                       modes, result.get("machine", ""), result.get("first", 0))


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(result["modes"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    colors = ["tab:orange" if m == ANCHOR else "tab:blue" for m in names]
    ax1.bar(names, [result["modes"][m]["all"]["mean_kld"] for m in names], color=colors)
    ax1.set_yscale("log")
    ax1.set_title("mean KL divergence from float32 (lower is closer)")
    ax2.bar(names, [100 * result["modes"][m]["all"]["same_top1"] for m in names], color=colors)
    ax2.set_ylim(90, 100)
    ax2.set_title("same top-1 token as float32, %")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(f"{result['gguf']}: {result['tokens']} tokens (rows from {result.get('first', 0)} of each "
                 f"{result['ctx']}-token chunk), {result['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(result: dict) -> str:
    """Markdown: each mode's statistics over the rows from `first` on, and its mean KLD and same-top-1
    over every row beside them."""
    first = result.get("first", 0)
    head = (f"| mode | mean KLD | p99 KLD | same top-1 | RMS Δp | PPL ratio | mean KLD, every row | "
            f"same top-1, every row | decode tok/s |\n|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for m, d in result["modes"].items():
        s, e, tps = d["all"], d.get("all_positions", d["all"]), d.get("decode_tok_s")
        lines.append(f"| {m} | {s['mean_kld']:.5f} | {s['p99_kld']:.4f} | {100 * s['same_top1']:.2f} % | "
                     f"{100 * s['rms_dp']:.2f} % | {s['ppl_ratio']:.4f} | {e['mean_kld']:.5f} | "
                     f"{100 * e['same_top1']:.2f} % | {f'{tps:.1f}' if tps else '—'} |")
    return (f"rows from position {first} of each {result['ctx']}-token chunk: {result['tokens']} tokens "
            f"(every row: {result.get('tokens_all_positions', result['tokens'])})\n\n" + head + "\n".join(lines))


def register(sub) -> None:
    from specdec.config import DEFAULT_TARGET
    p = sub.add_parser("kld", help="each precision mode's KL divergence from float32 on a shipped corpus, "
                                   "with llama.cpp on the same GGUF as the anchor; the verdict `precision: auto` uses")
    p.add_argument("--model", default=DEFAULT_TARGET, help="a GGUF model (registry name or path)")
    p.add_argument("--modes", default="bfloat16,int4,int4-a16,int4-a8",
                   help="comma-separated modes to score; MODE:kv=float32|float16|int8 sets its K/V cache format")
    p.add_argument("--corpus", default=str(CORPUS), help="JSON Lines of {kind, source, text}")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk")
    p.add_argument("--first", type=int, default=None, help="the first scored row of each chunk (predicted from "
                   "first + 1 tokens); default ctx / 2, as llama.cpp's --kl-divergence. Every row is reported too")
    p.add_argument("--max-tokens", type=int, default=None, help="score at most about this many tokens")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false", help="no anchor (and no verdict)")
    p.add_argument("--install-peer", action="store_true", help="build the llama.cpp anchor first if missing")
    p.add_argument("--decode-tokens", type=int, default=48, help="tokens of the decode-speed runs (0: none)")
    p.add_argument("--repeats", type=int, default=3, help="decode-speed repeats per mode")
    p.add_argument("--save", action="store_true", help="save the verdict for `precision: auto` "
                                                       "($SPECDEC_HOME/precision/<model>.json)")
    p.add_argument("--out", default="kld.json")
    p.add_argument("--plot", default="kld.png", help="PNG plot; empty for none")
    p.set_defaults(func=cmd_kld)


def cmd_kld(a) -> int:
    from specdec.bench import llama_cpp_peer
    from specdec.fileio import atomic_write_text
    from specdec.quant.criterion import saved_path

    if a.ctx < 65:
        raise ValueError(f"--ctx must be at least 65 tokens, got {a.ctx}")
    a.first = a.ctx // 2 if a.first is None else a.first
    if not 0 <= a.first <= a.ctx - 2:
        raise ValueError(f"--first must be between 0 and ctx - 2 = {a.ctx - 2}, got {a.first}")
    if a.save and not a.llama_cpp:
        raise ValueError("--save needs the llama.cpp anchor: the verdict compares each mode with it")
    require_plotting(a.plot, "specdec kld")
    if a.llama_cpp and a.install_peer and not llama_cpp_peer.is_installed():
        llama_cpp_peer.install()
    result = run_kld(a)
    atomic_write_text(Path(a.out), json.dumps(result, indent=1))
    if a.plot:
        plot(result, a.plot)
    print(table(result))
    if "criterion" in result:
        print(f"auto: {result['criterion']['auto']} (meets the criterion: {', '.join(result['criterion']['meets'])})",
              file=sys.stderr)
    if a.save:
        path = saved_path(result["gguf"].removesuffix(".gguf"))
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, verdict(result).to_json())
        print(f"saved the verdict to {path}", file=sys.stderr)
    return 0
