"""`specdec bench steps`: what one forward costs by its number of new rows, on any device.

Random weights of a model's real shapes (the registry models' hyperparameters, below), so that it
runs where the model files are not, such as a GPU machine; the integer CPU modes (int4, int4-a16,
int4-a8) pack a real file's blocks, so they load the registry model. For each model and precision: a forward
of n new rows of one sequence after a context of `--context` tokens, logits at every row included,
through the engine's own ModelRunner (1 row: a decode step; k + 1: verifying k drafts; more: a
prefill chunk); median with min-max of `--repeats` rounds, every setting loaded at once and timed
interleaved within each round (`time_settings`). Reports milliseconds, the verification ratio
t(n) / t(1), each setting's per-round ratio to the first precision listed for its model, and
c = t_draft(1) / t_target(1) for each draft / target pair: the numbers the cost-model controller
learns. With several models, a setting only drafts run (requantized, or a sub-vocabulary) times the
first model (the draft) alone. On the CPU, each forward is also stated against its bound on this
machine: the larger of its memory time (the weights and the context's keys and values read once at the
measured read bandwidth) and its compute time (n rows' multiply-adds at the int8 peak the kernels' own instructions reach,
`kernel.int8_peak`). JSON and a PNG.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from specdec.bench.bandwidth import measure_read_bandwidth, weight_bytes_per_token
from specdec.config import KV_CACHE_DTYPES, split_kv
from specdec.core.outputs import ScheduledChunk, SchedulerOutput
from specdec.extras import require_plotting
from specdec.fileio import atomic_write_text
from specdec.models.gguf_packed import REQUANT
from specdec.models.llama import LlamaConfig, LlamaModel, param_shapes
from specdec.quant import kv_format
from specdec.runner.model_runner import ModelRunner, kv_cache_dtype


def _qwen(hidden: int, intermediate: int, layers: int, heads: int, head_dim: int) -> LlamaConfig:
    return LlamaConfig("qwen2", 151936, hidden, intermediate, layers, heads, 2, head_dim, 1e6, 1e-6, 32768,
                       attention_bias=True, tie_embeddings=False)


# from the GGUF files' metadata (the registry's sha256s); the draft first, then its target
SHAPES = {
    "qwen2.5-coder-0.5b-instruct": _qwen(896, 4864, 24, 14, 64),
    "qwen2.5-coder-1.5b-instruct": _qwen(1536, 8960, 28, 12, 128),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
INT_MODES = ("int4", "int4-a16", "int4-a8")  # the real files' weights, on the CPU
PEER = "llama.cpp"  # the same file through llama.cpp (its peer venv), logits at every row as ours


def random_weights(cfg: LlamaConfig, dtype: torch.dtype, device: torch.device,
                   seed: int = 0) -> dict[str, torch.Tensor]:
    """Every parameter at its real shape: matrices ~ N(0, 1/fan_in), norm weights 1."""
    g = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, shape in param_shapes(cfg).items():
        if len(shape) == 1:
            weights[name] = torch.ones(shape, dtype=dtype, device=device)
        else:
            w = torch.randn(shape, generator=g, device=device, dtype=torch.float32) / shape[-1] ** 0.5
            weights[name] = w.to(dtype)
    return weights


def _weights(name: str, precision: str, device: torch.device) -> tuple[LlamaConfig, dict]:
    """Random weights of the real shapes for the dense modes; the integer modes pack a real GGUF file's
    blocks, so they take the registry model's own weights (on the CPU: the kernels' modes)."""
    if precision in DTYPES:
        return SHAPES[name], random_weights(SHAPES[name], DTYPES[precision], device)
    if device.type != "cpu":
        raise ValueError(f"precision {precision} runs on the CPU only")
    from specdec.models.loader import load_model
    mode, requant, _, _ = _options(precision)
    loaded = load_model(name, mode, "cpu", progress=False, pull=True, requant=requant)
    return loaded.config, loaded.weights


def _options(precision: str) -> tuple[str, str | None, str, int | None]:
    """'int4-a8', 'int4-a8:q4_64' (requantized at pack time, as drafts may be: gguf_packed.REQUANT), then
    ':vocab=N' (an output layer of N rows, as a draft's sub-vocabulary), then ':kv=float32|float16|int8' (a K/V cache
    format other than auto's) -> (mode, requant or None, kv choice, vocab rows: None for all, -1 if bad)."""
    rest, kv = split_kv(precision)
    rest, found, vocab = rest.partition(":vocab=")
    mode, _, requant = rest.partition(":")
    rows = None if not found else int(vocab) if vocab.isdigit() and int(vocab) > 0 else -1
    return mode, requant or None, kv, rows


def _draft_only(precision: str) -> bool:
    """A setting only a draft runs (requantized, or a sub-vocabulary): with several models, the first
    (the draft) is timed with it and the rest are not."""
    _, requant, _, vocab = _options(precision)
    return requant is not None or vocab is not None


def _target_setting(precision: str) -> str:
    """The target's setting to price a draft setting against: without the draft-only options."""
    mode, _, kv, _ = _options(precision)
    return f"{mode}:kv={kv}" if ":kv=" in precision else mode


def _int_mode(precision: str) -> bool:
    """An integer CPU mode, possibly requantized, with a sub-vocabulary or with its K/V cache format set."""
    mode, requant, kv, vocab = _options(precision)
    return (mode in INT_MODES and (requant is None or requant in REQUANT) and kv in KV_CACHE_DTYPES
            and (vocab is None or vocab > 0))


def _kernel_available() -> bool:
    from specdec.quant import kernel
    return kernel.available()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def work_per_step(cfg: LlamaConfig, weights: dict, context: int, kv_bytes_per_value: float = 4) -> dict:
    """What one forward must do at least: bytes read (every weight as held, and the context's keys and
    values as cached, each once; `bandwidth.py`) and multiply-adds per row (every matrix but the
    embedding table, and attention's two products over the context)."""
    macs = sum(math.prod(w.shape) for name, w in weights.items()
               if name != "embed" and len(w.shape) == 2 and not name.endswith("_bias"))
    macs += 2 * context * cfg.num_heads * cfg.head_dim * cfg.num_layers
    kv_bytes = round(2 * context * cfg.num_kv_heads * cfg.head_dim * kv_bytes_per_value * cfg.num_layers)
    return {"bytes": weight_bytes_per_token(weights, cfg.tie_embeddings) + kv_bytes, "kv_bytes": kv_bytes,
            "macs_per_row": macs}


def bound_ms(work: dict, rows: int, peaks: dict) -> float:
    """The larger of the step's bytes' read time and `rows` rows' multiply-adds at the int8 peak."""
    memory = work["bytes"] / (peaks["read_gb_s"] * 1e9)
    compute = rows * work["macs_per_row"] / peaks["int8_macs_per_s"]
    return 1e3 * max(memory, compute)


def measure_peaks(threads: int) -> dict:
    """This machine's read bandwidth and int8 multiply-add rate (on 1 and on `threads` threads), with
    the instruction set the integer kernels use."""
    from specdec.quant import kernel
    by_threads = {t: kernel.int8_peak(t) for t in sorted({1, threads})}
    peaks = {"read_gb_s": measure_read_bandwidth(num_threads=threads), "isa": kernel.isa(),
             "int8_macs_per_s": by_threads[threads], "int8_macs_per_s_by_threads": by_threads}
    print(f"steps: peaks: read {peaks['read_gb_s']:.1f} GB/s; int8 {peaks['isa']} "
          + ", ".join(f"{r / 1e9:.0f} G multiply-adds/s on {t} thread{'s' * (t > 1)}" for t, r in by_threads.items()),
          file=sys.stderr, flush=True)
    return peaks


class EngineRows:
    """Forwards of n new rows of one sequence after `context` tokens, through the engine's ModelRunner."""

    def __init__(self, cfg: LlamaConfig, weights: dict, device: torch.device, rows: list[int], context: int,
                 kv_dtype: torch.dtype | None = None, vocab: int | None = None) -> None:
        """`vocab`: score only the first this many tokens (the price of a draft's sub-vocabulary)."""
        block_size = 16
        blocks = -(-(context + max(rows)) // block_size)
        self.device, self.context = device, context
        model = LlamaModel(cfg, weights, context + max(rows) + 1, device)
        self.sub_vocab = vocab is not None and vocab < cfg.vocab_size  # its columns only, as greedy drafts run
        if self.sub_vocab:  # the embedding table, if tied, is then looked up only
            model.restrict_vocab(torch.arange(vocab))
            weights, cfg = {**weights, "lm_head": model.lm_head}, dataclasses.replace(cfg, tie_embeddings=False)
        self.runner = ModelRunner(model, blocks, block_size, device, kv_dtype=kv_dtype)
        kv = self.runner.kv_dtype
        per_value = kv_format.row_width(kv, cfg.head_dim) * kv.itemsize / cfg.head_dim  # an int8 row holds its scale
        self.work = work_per_step(cfg, weights, context, per_value)
        self.table = list(range(blocks))
        self.tokens = _tokens(cfg.vocab_size, context + max(rows))
        step = 256  # the context in prefill chunks, as the scheduler would
        for start in range(0, context, step):
            chunk = self.tokens[start:min(start + step, context)]
            self.runner.execute(SchedulerOutput([ScheduledChunk("ctx", chunk, start, self.table, 1)], len(chunk)))

    def seconds(self, n: int) -> float:
        sched = SchedulerOutput([ScheduledChunk("ctx", self.tokens[self.context:self.context + n], self.context,
                                                self.table, n)], n)
        _sync(self.device)
        t0 = time.perf_counter()
        self.runner.execute(sched, sub_vocab=self.sub_vocab)
        _sync(self.device)
        return time.perf_counter() - t0

    def close(self) -> None:
        del self.runner
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


class LlamaCppRows:
    """`EngineRows` through llama.cpp on the registry model's own file: the same token ids, logits at
    every new row (as a verification needs)."""

    def __init__(self, name: str, rows: list[int], context: int) -> None:
        from specdec.bench.llama_cpp_peer import LlamaCppPeer, is_installed
        from specdec.models.loader import resolve
        if not is_installed():
            raise ValueError("steps: the llama.cpp peer is not installed "
                             "(specdec bench --peers llama.cpp --install-peers)")
        self.work = None  # llama.cpp's own layouts: its bytes are not ours to count
        self.context, self.tokens = context, _tokens(SHAPES[name].vocab_size, context + max(rows))
        self.peer = LlamaCppPeer(PEER, resolve(name)[1], torch.get_num_threads(), context + max(rows) + 1,
                                 logits_all=True)

    def seconds(self, n: int) -> float:
        return self.peer.step(self.tokens[:self.context + n], self.context)

    def close(self) -> None:
        self.peer.close()


def _tokens(vocab_size: int, n: int) -> list[int]:
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(1)).tolist()


def _setting(name: str, precision: str, device: torch.device, rows: list[int], context: int):
    if precision == PEER:
        return LlamaCppRows(name, rows, context)
    cfg, weights = _weights(name, precision, device)
    mode, _, kv, vocab = _options(precision)
    if kv == "auto" and _int_mode(precision):  # as the engine resolves it: the format measured for the mode
        from specdec.models.loader import gguf_identity
        from specdec.quant.criterion import auto_kv_choice
        kv = (auto_kv_choice(gguf_identity(name), mode) or ("auto",))[0]
    return EngineRows(cfg, weights, device, rows, context, kv_cache_dtype(kv), vocab)


def time_settings(settings: dict, rows: list[int], repeats: int) -> dict:
    """Seconds per (setting, n): every round runs each setting once at each row count, so the settings
    share the machine's slow and fast moments (the first round warms up: kernel choice, allocator), each
    setting's row counts after one untimed forward of its own."""
    times = {key: {n: [] for n in rows} for key in settings}
    from tqdm import tqdm
    for r in tqdm(range(repeats + 1), desc="steps: rounds", unit="round", file=sys.stderr):
        for key, setting in settings.items():
            # untimed: a forward right after another setting's prompt-sized one ran at up to 1.7x its time
            setting.seconds(rows[0])
            for n in rows:
                seconds = setting.seconds(n)
                if r:
                    times[key][n].append(seconds)
    return times


def run(models: list[str], precisions: list[str], device: str, rows: list[int], context: int, repeats: int,
        out: str, plot: str | None) -> dict:
    """All (precision, model) settings are loaded at once and timed interleaved; each row count's
    ratio to the model's first precision is taken per round (median with min-max)."""
    dev = torch.device(device)
    unknown = [m for m in models if m not in SHAPES]
    if unknown:
        raise ValueError(f"no shapes for {unknown}; known: {', '.join(SHAPES)}")
    settings = {}
    with_bounds = dev.type == "cpu" and any(_int_mode(p) for p in precisions) and _kernel_available()
    peaks = measure_peaks(torch.get_num_threads()) if with_bounds else None
    if len(models) > 1:  # a draft-only setting is priced against the target's own, timed too
        precisions = list(dict.fromkeys(precisions + [_target_setting(p) for p in precisions if _draft_only(p)]))
    timed = [(precision, name) for precision in precisions for name in models
             if name == models[0] or len(models) == 1 or not _draft_only(precision)]
    try:
        for precision, name in timed:
            print(f"steps: loading {name} {precision} on {device} ...", file=sys.stderr, flush=True)
            settings[(precision, name)] = _setting(name, precision, dev, rows, context)
        times = time_settings(settings, rows, repeats)
        works = {key: setting.work for key, setting in settings.items()}
        if peaks:  # this VM's bandwidth drifts by a fifth within minutes: the best of before and after
            peaks["read_gb_s"] = max(peaks["read_gb_s"], measure_read_bandwidth(num_threads=torch.get_num_threads()))
    finally:
        for setting in settings.values():
            setting.close()
    first = {name: next(p for p, m in timed if m == name) for name in models}  # each model's first setting
    results = [_result(name, precision, n, times[(precision, name)], times[(first[name], name)], rows[0])
               for precision, name in timed for n in rows]
    for r in results:
        work = works.get((r["precision"], r["model"]))
        if peaks and work and _int_mode(r["precision"]):
            r["bound_ms"] = bound_ms(work, r["rows"], peaks)
            r["x_bound"] = r["ms"] / r["bound_ms"]
        price = f" (r {r['r']:.3f})" if r["r"] is not None else ""
        bound = f"  bound {r['bound_ms']:7.2f} ms ({100 / r['x_bound']:3.0f} %)" if "bound_ms" in r else ""
        print(f"  {r['model']} {r['precision']} {r['rows']:4d} rows: {r['ms']:9.2f} ms [{r['ms_min']:.2f}-"
              f"{r['ms_max']:.2f}]  {r['vs_first_row_count']:.2f}x one row{price}{bound}", file=sys.stderr, flush=True)
    cost_ratios = {}
    one_row = {(r["precision"], r["model"]): r["ms"] for r in results if r["rows"] == rows[0]}
    for precision in precisions:
        if len(models) > 1:  # a requantized or sub-vocabulary draft against the target as it runs
            draft, target = models[0], models[-1]
            priced = _target_setting(precision) if (_target_setting(precision), target) in one_row else precision
            cost_ratios[precision] = {"draft": draft, "target": target, "target_precision": priced,
                                      "c": one_row[(precision, draft)] / one_row[(priced, target)]}
    report = {"device": device, "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "torch": torch.__version__, "threads": torch.get_num_threads(), "context": context, "repeats": repeats,
              "weights": "the real files" if all(_int_mode(p) or p == PEER for p in precisions)
              else "random, real shapes",
              "interleaved": True, "peaks": peaks,
              "work_per_step": {f"{m} {p}": w for (p, m), w in works.items() if w}, "results": results,
              "draft_cost_ratio": cost_ratios}
    atomic_write_text(Path(out), json.dumps(report, indent=1))
    if plot:
        _plot(report, plot)
    return report


def _result(name: str, precision: str, n: int, times: dict, first: dict, one_row: int) -> dict:
    """One (model, precision, rows) cell: ms, the ratio to one row, and the per-round ratio to the first
    precision's time at the same rows."""
    ms = [t * 1e3 for t in times[n]]
    vs_first = [a / b for a, b in zip(times[n], first[n])]
    return {"model": name, "precision": precision, "rows": n, "ms": statistics.median(ms), "ms_min": min(ms),
            "ms_max": max(ms), "vs_first_row_count": statistics.median(times[n]) / statistics.median(times[one_row]),
            # r: what each row past the first costs, as a fraction of a one-row step (the cost model's price)
            "r": (statistics.median(times[n]) / statistics.median(times[one_row]) - 1) / (n - one_row)
            if n > one_row else None,
            "vs_first_precision": {"median": statistics.median(vs_first), "min": min(vs_first),
                                   "max": max(vs_first)}}


def _plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = sorted({(r["model"], r["precision"]) for r in report["results"]})
    for model, precision in series:
        pts = [(r["rows"], r["ms"]) for r in report["results"] if (r["model"], r["precision"]) == (model, precision)]
        ax.plot(*zip(*pts), marker="o", label=f"{model.removeprefix('qwen2.5-coder-')} {precision}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("new rows in the forward (1 = decode, k + 1 = verification)")
    ax.set_ylabel("ms per forward (logits at every row)")
    ax.set_title(f"forward cost by rows, {report['device_name']}, context {report['context']}, "
                 f"{report['weights']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = Path(path).with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)
    plt.close(fig)


def run_steps_bench(a) -> dict:
    """From `specdec bench steps`'s arguments."""
    precisions = (a.precisions or "float32,bfloat16").split(",")
    bad = [p for p in precisions if p not in (*DTYPES, PEER) and not _int_mode(p)]
    rows = [int(n) for n in a.rows.split(",")]
    threads = getattr(a, "threads", None)
    if bad or a.context < 1 or a.repeats < 1 or min(rows) < 1 or (threads is not None and threads < 1):
        raise ValueError(f"steps: precisions from {', '.join((*DTYPES, *INT_MODES, PEER))} (an int4 mode may add "
                         f":{'|'.join(REQUANT)}, requantized as a draft may be, :vocab=N, a sub-vocabulary's "
                         "output layer, and :kv=float32|float16|int8), "
                         "--context, --repeats, --rows and --threads >= 1")
    require_plotting(a.plot, "specdec bench steps")
    before = torch.get_num_threads()
    if threads is not None:  # every forward, the peaks and the peer run on this many threads
        torch.set_num_threads(threads)
    try:
        return run(a.shapes.split(","), precisions, a.device, rows, a.context, a.repeats, a.out, a.plot or None)
    finally:
        torch.set_num_threads(before)
