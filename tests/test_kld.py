"""`specdec kld` and the precision criterion behind `precision: auto`: the statistics against hand
computations, the corpus chunks, the verdict's margins and where it is read, and the command end to end
on a tiny model with a fake llama.cpp anchor (the real worker over its pipe)."""
from __future__ import annotations

import json
import math
import sys
import textwrap
from dataclasses import replace

import pytest
import torch

from specdec.bench import kld, llama_cpp_peer
from specdec.cli import main
from specdec.config import CacheConfig, EngineConfig, ModelConfig, SpeculativeConfig
from specdec.precision import resolve_kv_cache, resolve_precision
from specdec.models.tokenizer import Tokenizer
from specdec.quant import criterion, kernel
from specdec.quant.criterion import Measurement, ModeScore

FAKE_LLAMA_CPP = '''
import numpy as np
__version__ = "0.0-fake"

class Llama:
    def __init__(self, model_path, n_ctx, n_threads, n_threads_batch, draft_model, seed, verbose, logits_all=False):
        assert logits_all, "scoring needs every position's logits"

        self.n_tokens, self.input_ids, self.evaluated = 0, np.zeros(4096, dtype=np.intc), []

    def reset(self):
        self.n_tokens = 0

    def eval(self, tokens):                      # a made-up distribution: far from any real mode
        rng = np.random.default_rng(len(tokens))
        self.scores = rng.standard_normal((self.n_tokens + len(tokens), 1024)).astype(np.float32)
        self.input_ids[self.n_tokens:self.n_tokens + len(tokens)] = tokens
        self.n_tokens += len(tokens)
        self.evaluated.append(len(tokens))
        print("evaluated", self.evaluated, file=__import__("sys").stderr)

    def n_vocab(self):
        return 1024
'''


def test_divergence_matches_a_hand_computation():
    ref = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]])   # p = (1/4, 3/4), (1/2, 1/2)
    mode = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])  # q = (1/2, 1/2), (3/4, 1/4)
    d = kld.Divergence()
    d.add(ref, mode, torch.tensor([1, 0]))
    s = d.summary()
    kl1 = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    kl2 = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    assert s["tokens"] == 2 and s["mean_kld"] == pytest.approx((kl1 + kl2) / 2)
    assert s["max_kld"] == pytest.approx(max(kl1, kl2)) and s["p99_kld"] == s["max_kld"]
    assert s["same_top1"] == 0.5                       # row 1: both pick 1 (ties go to the first)
    dp = [0.5 - 0.75, 0.75 - 0.5]
    assert s["rms_dp"] == pytest.approx(math.sqrt(sum(x * x for x in dp) / 2))
    assert s["ppl_ratio"] == pytest.approx(math.exp((-math.log(0.5 * 0.75) + math.log(0.75 * 0.5)) / 2))
    same = kld.Divergence()
    same.add(ref, ref.clone(), torch.tensor([1, 0]))
    assert same.summary()["mean_kld"] == 0 and same.summary()["same_top1"] == 1 and same.summary()["ppl_ratio"] == 1


def test_chunks_cut_each_kind_and_interleave_them(tiny_qwen):
    tok = Tokenizer.from_gguf(tiny_qwen)
    rows = [{"kind": "code", "text": "def f(x):\n    return x\n" * 40}, {"kind": "zh", "text": "你好，世界。" * 60},
            {"kind": "code", "text": "print(1)\n" * 30}]
    out = kld.chunks(tok, rows, 100)
    assert [k for k, _ in out[:2]] == ["code", "zh"]
    assert all(64 <= len(ids) <= 100 for _, ids in out)
    code = tok.encode("\n\n".join(r["text"] for r in rows if r["kind"] == "code"), add_special_tokens=False)
    assert sum((ids for k, ids in out if k == "code"), []) == code[:len(code) // 100 * 100 + (
        len(code) % 100 if len(code) % 100 >= 64 else 0)]
    limited = kld.chunks(tok, rows, 100, max_tokens=150)
    assert sum(len(ids) - 1 for _, ids in limited) >= 150 > sum(len(ids) - 1 for _, ids in limited[:-1])


def test_the_shipped_corpus_names_its_sources_and_covers_every_kind():
    rows = kld.read_corpus()
    assert {r["kind"] for r in rows} == {"code", "prose", "chat", "zh"}
    assert all(r["source"] and r["text"].strip() for r in rows)
    assert sum(len(r["text"]) for r in rows) > 80_000  # about 25k tokens of the Qwen tokenizer


def _measurement(**modes) -> Measurement:
    return Measurement("m", 123, ModeScore(0.010, 0.95), {k: ModeScore(*v) for k, v in modes.items()})


def test_criterion_margins_and_the_fastest_passing_mode():
    m = _measurement(**{"int4-a8": (0.0104, 0.949, 30.0), "int4-a16": (0.001, 0.99, 20.0),
                        "int4": (0.0006, 0.995, 15.0), "float32": (0.0, 1.0, 5.0)})
    assert m.meets("int4-a8")                   # 4 % above the anchor's KLD, 0.1 point below its top-1
    assert m.choose(criterion.CPU_MODES) == "int4-a8"
    worse = _measurement(**{"int4-a8": (0.0106, 0.96, 30.0), "int4-a16": (0.001, 0.99, 20.0)})
    assert not worse.meets("int4-a8") and worse.choose(criterion.CPU_MODES) == "int4-a16"  # KLD 6 % above
    flips = _measurement(**{"int4-a8": (0.005, 0.947, 30.0), "int4-a16": (0.001, 0.99, 20.0)})
    assert flips.choose(criterion.CPU_MODES) == "int4-a16"                                # top-1 0.3 point below
    assert Measurement.from_json(m.to_json()) == m


def test_auto_reads_the_saved_verdict_of_that_file_only(tiny_kquant, tmp_path, monkeypatch):
    if not kernel.available():
        pytest.skip(f"kernel unavailable: {kernel.unavailable_reason()}")
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    cfg = EngineConfig(model=ModelConfig(model=str(tiny_kquant)),
                       speculative=SpeculativeConfig(method="draft_model", draft_model=str(tiny_kquant)))
    assert resolve_precision(cfg)[0].model.precision == "int4-a16"     # no verdict: the near-lossless default
    m = _measurement(**{"int4-a8": (0.009, 0.96, 30.0), "int4-a16": (0.001, 0.99, 20.0)})
    m.file_bytes = tiny_kquant.stat().st_size
    path = criterion.saved_path(tiny_kquant.stem)
    path.parent.mkdir(parents=True)
    path.write_text(m.to_json())
    chosen, why = resolve_precision(cfg)
    assert chosen.model.precision == "int4-a8" and "llama.cpp" in why
    assert chosen.speculative.draft.precision == "int4-a8"
    m.file_bytes += 1                                                   # another file with the same name
    path.write_text(m.to_json())
    assert resolve_precision(cfg)[0].model.precision == "int4-a16"


def test_auto_holds_kv_in_the_smallest_format_measured_close_enough(tiny_kquant, tmp_path, monkeypatch):
    """kv_cache_dtype auto: the smallest format scored under the running mode ('MODE:kv=FORMAT') that
    meets the criterion; the model's dtype where none does or none was scored; a set format is kept."""
    if not kernel.available():
        pytest.skip(f"kernel unavailable: {kernel.unavailable_reason()}")
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    cfg = EngineConfig(model=ModelConfig(model=str(tiny_kquant), precision="int4-a8"))
    assert resolve_kv_cache(cfg) is None                                # no measurement
    path = criterion.saved_path(tiny_kquant.stem)
    path.parent.mkdir(parents=True)

    def save(**modes):
        m = _measurement(**{"int4-a8": (0.009, 0.96, 30.0), **modes})
        m.file_bytes = tiny_kquant.stat().st_size
        path.write_text(m.to_json())

    save(**{"int4-a8:kv=float16": (0.0095, 0.959, None), "int4-a8:kv=int8": (0.012, 0.95, None)})
    chosen, why = resolve_kv_cache(cfg)
    assert chosen.cache.kv_cache_dtype == "float16" and "llama.cpp" in why   # int8: KLD 20 % above the anchor
    save(**{"int4-a8:kv=float16": (0.0095, 0.959, None), "int4-a8:kv=int8": (0.0099, 0.959, None)})
    assert resolve_kv_cache(cfg)[0].cache.kv_cache_dtype == "int8"
    assert resolve_kv_cache(replace(cfg, model=replace(cfg.model, precision="int4-a16"))) is None  # not scored
    assert resolve_kv_cache(replace(cfg, cache=CacheConfig(kv_cache_dtype="float32"))) is None


@pytest.fixture
def fake_anchor(tmp_path, monkeypatch):
    pkg = tmp_path / "fake" / "llama_cpp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(FAKE_LLAMA_CPP))
    (pkg / "llama_speculative.py").write_text("class LlamaPromptLookupDecoding:\n    pass\n")
    monkeypatch.setenv("PYTHONPATH", str(pkg.parent))
    monkeypatch.setattr(llama_cpp_peer, "venv_python", lambda: sys.executable)
    monkeypatch.setattr(llama_cpp_peer, "is_installed", lambda: True)


def test_kld_command_end_to_end(fake_anchor, tiny_kquant, tmp_path, monkeypatch, capsys):
    if not kernel.available():
        pytest.skip(f"kernel unavailable: {kernel.unavailable_reason()}")
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"kind": k, "source": "test", "text": t}) + "\n" for k, t in
                              [("code", "def add(a, b):\n    return a + b\n" * 12), ("prose", "The cat sat. " * 60)]))
    out, png = tmp_path / "kld.json", tmp_path / "kld.png"
    args = ["kld", "--model", str(tiny_kquant), "--modes", "int4,int4-a8", "--corpus", str(corpus), "--ctx", "96",
            "--decode-tokens", "4", "--repeats", "1", "--threads", "1", "--out", str(out), "--plot", str(png)]
    assert main(args + ["--save"]) == 0
    r = json.loads(out.read_text())
    assert set(r["modes"]) == {"int4", "int4-a8", "llama.cpp"} and set(r["kinds"]) == {"code", "prose"}
    assert r["tokens"] == sum(r["kinds"].values()) > 0 and png.stat().st_size > 0
    assert r["first"] == 48 and r["tokens"] < r["tokens_all_positions"]    # the second half of each chunk
    assert r["modes"]["int4"]["all_positions"]["tokens"] == r["tokens_all_positions"]
    ours, anchor = r["modes"]["int4"]["all"], r["modes"]["llama.cpp"]["all"]
    assert 0 < ours["mean_kld"] < r["modes"]["int4-a8"]["all"]["mean_kld"] < anchor["mean_kld"]
    assert ours["same_top1"] > 0.9 and ours["p99_kld"] <= ours["max_kld"]
    assert r["modes"]["int4-a8"]["decode_tok_s"] > 0 and r["float32"]["decode_tok_s"] > 0
    assert set(r["criterion"]["meets"]) == {"int4", "int4-a8", "float32"}   # the fake anchor is far off
    assert r["criterion"]["auto"] in r["criterion"]["meets"]
    saved = criterion.measurement_for(tiny_kquant.stem, tiny_kquant.stat().st_size)
    assert saved is not None and saved.choose(criterion.CPU_MODES) == r["criterion"]["auto"]
    captured = capsys.readouterr()   # the table on stdout, the verdict on stderr
    assert "| int4-a8 |" in captured.out
    assert f"auto: {r['criterion']['auto']}" in captured.err
    assert main(args[:-4] + ["--no-llama-cpp", "--save", "--out", str(out), "--plot", ""]) == 2
    assert main(args[:-4] + ["--ctx", "10", "--out", str(out), "--plot", ""]) == 2
    assert main(args[:-4] + ["--first", "95", "--out", str(out), "--plot", ""]) == 2


def test_scored_rows_start_at_first_and_every_row_is_reported_beside_them():
    """Rows before `first` (few tokens of context) count only in the every-row figures; the verdict's
    figures are those of the later rows."""
    vocab, n = 8, 6
    ref = torch.zeros(n, vocab)
    far = ref.clone()
    far[:2, 3] = 9.0                     # rows 0-1 disagree with float32, rows 2-5 agree
    scores = kld.Scores(["m"])
    kld._score_chunk(scores, "code", list(range(n + 1)), {"float32": ref, "m": far}, first=2)
    scored, every = scores.summary("m", "scored"), scores.summary("m", "positions")
    assert scored["tokens"] == 4 and scored["mean_kld"] == 0 and scored["same_top1"] == 1
    assert every["tokens"] == 6 and every["mean_kld"] > 0 and every["same_top1"] == pytest.approx(4 / 6)
    assert scores.summary("m", "scored", "code") == scored


def test_llama_cpp_step_times_new_rows_after_a_kept_context(fake_anchor, tiny_qwen, capfd):
    """`bench steps`' llama.cpp rows: the context is evaluated once and kept while it stays the same;
    each step evaluates only the new rows."""
    peer = llama_cpp_peer.LlamaCppPeer("llama.cpp", tiny_qwen, 1, 64, logits_all=True)
    try:
        ids = list(range(1, 30))
        assert peer.step(ids[:20 + 1], 20) >= 0 and peer.step(ids[:20 + 5], 20) >= 0
        assert peer.step([7] + ids[1:20 + 2], 20) >= 0     # another context: evaluated again
    finally:
        peer.close()
    assert "evaluated [20, 1, 5, 20, 2]" in capfd.readouterr().err
