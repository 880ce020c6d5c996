"""The OpenVINO GenAI peers without OpenVINO: the Q5_0 -> Q8_0 rewrite on tiny GGUF files, the
exported-folder cache, the real worker over its pipe with fake `openvino` / `openvino_genai` modules,
and peers that fail to install, load or run being recorded as failed while the bench goes on."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest

from specdec.bench import llama_cpp_peer, openvino_gguf, openvino_peer, peers, spec_bench
from specdec.cli import main

Q = gguf.GGMLQuantizationType

FAKE_OPENVINO = '''
class Tensor:
    def __init__(self, array):
        self.data = array
'''
FAKE_OPENVINO_GENAI = '''
import json, os
from pathlib import Path
import gguf

__version__ = "0.0-fake"


def _log(**event):
    with open(os.environ["FAKE_OV_LOG"], "a") as f:
        f.write(json.dumps(event) + "\\n")


class StreamingStatus:
    RUNNING = 0


class StreamerBase:
    def __init__(self):
        pass


class GenerationConfig:
    def __init__(self):  # a GGUF's defaults that the worker must override
        self.max_new_tokens, self.ignore_eos, self.stop_strings = 100, False, {"</s>"}
        self.do_sample, self.num_beams, self.repetition_penalty = True, 1, 1.1
        self.num_assistant_tokens, self.max_ngram_size = 0, 0


def draft_model(path, device, **props):
    assert (Path(path) / "openvino_model.xml").exists(), "draft_model takes an exported folder"
    return {"draft_folder": str(path), "device": device, **props}


class _Results:
    def __init__(self, tokens):
        self.tokens = [tokens]


class LLMPipeline:
    def __init__(self, path, device, **props):
        if not os.path.exists(path):
            raise RuntimeError(f"no model {path}")
        if props.pop("enable_save_ov_model", False):  # writes beside the .gguf, as the real one
            types = sorted({t.tensor_type.name for t in gguf.GGUFReader(path).tensors})
            Path(path).with_name("openvino_model.xml").write_text("<net/>")
            _log(event="export", path=str(path), types=types)
        _log(event="load", path=str(path), device=device, props=props)

    def get_generation_config(self):
        return GenerationConfig()

    def generate(self, ids, cfg, streamer):
        prompt = ids.data.tolist()[0]
        settings = {k: sorted(v) if isinstance(v, set) else v for k, v in vars(cfg).items()}
        _log(event="generate", prompt=prompt, dtype=str(ids.data.dtype), cfg=settings)
        out = [(sum(prompt) + i) % 50 for i in range(cfg.max_new_tokens)]
        for token in out:
            streamer.write(token)
        streamer.end()
        return _Results(out)
'''


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, Q]]) -> Path:
    """A GGUF with a few keys of each kind and the given float32 tensors stored as the given types."""
    w = gguf.GGUFWriter(path, arch="qwen2")
    w.add_name("tiny")
    w.add_block_count(1)
    w.add_token_list(["a", "b", "<|im_end|>"])
    w.add_array("test.floats", [1.5, -2.5])
    for name, (weights, qtype) in tensors.items():
        data = weights if qtype == Q.F32 else gguf.quants.quantize(weights, qtype)
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"blk.0.ffn_up.weight": rng.normal(0, 0.05, (8, 64)).astype(np.float32),
            "blk.0.attn_q.weight": rng.normal(0, 0.05, (4, 64)).astype(np.float32),
            "blk.0.attn_norm.weight": rng.normal(1, 0.1, (64,)).astype(np.float32)}


@pytest.fixture
def draft_gguf(tmp_path, weights) -> Path:
    """The 0.5B draft's situation: Q5_0 weights beside types OpenVINO reads."""
    return write_gguf(tmp_path / "draft.gguf", {"blk.0.ffn_up.weight": (weights["blk.0.ffn_up.weight"], Q.Q5_0),
                                                "blk.0.attn_q.weight": (weights["blk.0.attn_q.weight"], Q.Q4_0),
                                                "blk.0.attn_norm.weight": (weights["blk.0.attn_norm.weight"], Q.F32)})


@pytest.fixture
def target_gguf(tmp_path, weights) -> Path:
    return write_gguf(tmp_path / "target.gguf", {"blk.0.attn_q.weight": (weights["blk.0.attn_q.weight"], Q.Q8_0),
                                                 "blk.0.attn_norm.weight": (weights["blk.0.attn_norm.weight"], Q.F32)})


def test_requantize_rewrites_q5_0_as_q8_0_and_copies_the_rest(draft_gguf, tmp_path):
    assert openvino_gguf.unreadable_tensors(draft_gguf) == {"blk.0.ffn_up.weight": "Q5_0"}
    out = tmp_path / "out" / "draft-q8.gguf"
    out.parent.mkdir()
    assert openvino_gguf.requantize(draft_gguf, out) == 1
    assert [p.name for p in out.parent.iterdir()] == ["draft-q8.gguf"]  # no temporary file left
    src, dst = gguf.GGUFReader(draft_gguf), gguf.GGUFReader(out)
    assert openvino_gguf.unreadable_tensors(out) == {}
    for name in ("test.floats", "tokenizer.ggml.tokens", "general.name", "qwen2.block_count", "general.architecture"):
        assert dst.fields[name].contents() == src.fields[name].contents()
    before, after = ({t.name: t for t in r.tensors} for r in (src, dst))
    assert after["blk.0.ffn_up.weight"].tensor_type == Q.Q8_0
    assert list(after["blk.0.ffn_up.weight"].shape) == list(before["blk.0.ffn_up.weight"].shape)
    for name in ("blk.0.attn_q.weight", "blk.0.attn_norm.weight"):  # readable: the same bytes
        assert after[name].tensor_type == before[name].tensor_type
        assert np.array_equal(after[name].data, before[name].data)
    q5 = gguf.quants.dequantize(before["blk.0.ffn_up.weight"].data, Q.Q5_0)  # [8, 64]
    q8 = gguf.quants.dequantize(after["blk.0.ffn_up.weight"].data, Q.Q8_0)
    assert q8.shape == q5.shape == (8, 64)
    # Q8_0 keeps every value to within one step of its 32-weight block (amax / 127; half a step
    # plus the float16 scale's rounding)
    step = np.abs(q5).reshape(-1, 32).max(axis=1, keepdims=True) / 127
    assert np.all(np.abs(q8 - q5).reshape(-1, 32) <= step)
    assert 0 < np.abs(q8 - q5).max()


def test_model_folder_exports_once_per_source_file(draft_gguf, tmp_path, monkeypatch):
    exported = []

    def fake_export(staged: Path, properties: dict) -> None:
        exported.append((openvino_gguf.unreadable_tensors(staged), properties))
        (staged.parent / openvino_gguf.OV_MODEL).write_text("<net/>")

    monkeypatch.setattr(openvino_gguf, "export_folder", fake_export)
    cache = tmp_path / "models"
    folder = openvino_gguf.model_folder(draft_gguf, cache, {"INFERENCE_NUM_THREADS": 2})
    assert folder == cache / f"draft-{draft_gguf.stat().st_size}"
    assert openvino_gguf.model_folder(draft_gguf, cache, {"INFERENCE_NUM_THREADS": 2}) == folder
    assert exported == [({}, {"INFERENCE_NUM_THREADS": 2})]  # once, from the Q8_0 copy
    assert sorted(p.name for p in folder.iterdir()) == [openvino_gguf.OV_MODEL]  # the staged .gguf went
    assert [p.name for p in cache.iterdir()] == [folder.name]  # no temporary folder left


def test_model_folder_leaves_nothing_when_the_export_fails(draft_gguf, tmp_path, monkeypatch):
    def failing_export(staged: Path, properties: dict) -> None:
        raise RuntimeError("cannot read")

    monkeypatch.setattr(openvino_gguf, "export_folder", failing_export)
    with pytest.raises(RuntimeError, match="cannot read"):
        openvino_gguf.model_folder(draft_gguf, tmp_path / "models", {})
    assert list((tmp_path / "models").iterdir()) == []


@pytest.fixture
def fake_openvino(tmp_path, monkeypatch) -> Path:
    """`openvino` and `openvino_genai` on PYTHONPATH (the worker inherits it); the 'venv' is this
    python; the fake pipeline logs what it was given to the returned file."""
    root = tmp_path / "fake"
    for name, text in (("openvino", FAKE_OPENVINO), ("openvino_genai", FAKE_OPENVINO_GENAI)):
        (root / name).mkdir(parents=True)
        (root / name / "__init__.py").write_text(textwrap.dedent(text))
    log = tmp_path / "ov-log.jsonl"
    monkeypatch.setenv("PYTHONPATH", str(root))
    monkeypatch.setenv("FAKE_OV_LOG", str(log))
    monkeypatch.setattr(openvino_peer, "venv_python", lambda: sys.executable)
    monkeypatch.setattr(openvino_peer, "is_installed", lambda: True)
    return log


def events(log: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, log.read_text().splitlines()) if e["event"] == kind]


def test_openvino_spec_worker_exports_the_draft_and_decodes_greedily(fake_openvino, draft_gguf, target_gguf, tmp_path):
    models = tmp_path / "models"
    peer = openvino_peer.OpenVinoPeer("openvino_spec", target_gguf, 3, draft_gguf, num_assistant_tokens=5,
                                      models=models)
    try:
        assert peer.version == "0.0-fake" and peer.load_seconds >= 0
        assert peer.draft_folder == str(models / f"draft-{draft_gguf.stat().st_size}")
        r = peer.generate([1, 2, 3], 4)
        assert r.token_ids == [6, 7, 8, 9] and r.generated_tokens == 4
        assert 0 < r.ttft_seconds <= r.seconds and r.tokens_per_second == pytest.approx(4 / r.seconds)
    finally:
        peer.close()
    assert peer.worker.proc.returncode == 0
    [export] = events(fake_openvino, "export")
    assert export["types"] == ["F32", "Q4_0", "Q8_0"]  # the Q5_0 weights came as Q8_0
    [load] = events(fake_openvino, "load")[1:]  # after the export's pipeline
    assert load["path"] == str(target_gguf) and load["device"] == "CPU"  # readable: the .gguf itself
    assert load["props"] == {"INFERENCE_NUM_THREADS": 3,
                             "draft_model": {"draft_folder": peer.draft_folder, "device": "CPU",
                                             "INFERENCE_NUM_THREADS": 3}}
    warmup, run = events(fake_openvino, "generate")
    assert warmup["cfg"]["max_new_tokens"] == 2  # at load, before any measured run
    assert run["prompt"] == [1, 2, 3] and run["dtype"] == "int64"  # token ids, not text
    assert run["cfg"] == {"max_new_tokens": 4, "ignore_eos": True, "stop_strings": [], "do_sample": False,
                          "num_beams": 1, "repetition_penalty": 1.0, "num_assistant_tokens": 5, "max_ngram_size": 0}


def test_openvino_lookup_and_plain_workers(fake_openvino, target_gguf, tmp_path):
    for name in ("openvino_lookup", "openvino"):
        peer = openvino_peer.OpenVinoPeer(name, target_gguf, 2, num_assistant_tokens=3, max_ngram_size=4,
                                          models=tmp_path / "models")
        try:
            assert peer.generate([5], 2).token_ids == [5, 6] and peer.draft_folder is None
        finally:
            peer.close()
    lookup, plain = events(fake_openvino, "load")
    assert lookup["props"] == {"INFERENCE_NUM_THREADS": 2, "prompt_lookup": True}
    assert plain["props"] == {"INFERENCE_NUM_THREADS": 2}
    runs = events(fake_openvino, "generate")[1::2]  # every other one is a warm-up
    assert (runs[0]["cfg"]["num_assistant_tokens"], runs[0]["cfg"]["max_ngram_size"]) == (3, 4)
    assert (runs[1]["cfg"]["num_assistant_tokens"], runs[1]["cfg"]["max_ngram_size"]) == (0, 0)
    assert not (tmp_path / "models").exists()  # no draft, a readable target: nothing exported


def test_a_worker_that_cannot_load_replies_the_error_and_exits(fake_openvino, tmp_path):
    req = {"model_path": str(tmp_path / "missing.gguf"), "mode": "plain", "draft_path": None,
           "models_dir": str(tmp_path / "models"), "num_threads": 1, "num_assistant_tokens": 4, "max_ngram_size": 4}
    proc = subprocess.run([sys.executable, "-P", str(openvino_peer.WORKER)], capture_output=True, text=True,
                          check=False, input=json.dumps(req) + "\n", timeout=60)
    assert proc.returncode == 1
    assert json.loads(proc.stdout)["error"].startswith("FileNotFoundError: ")
    with pytest.raises(peers.PeerError, match="openvino worker: FileNotFoundError: .*missing.gguf"):
        openvino_peer.OpenVinoPeer("openvino", tmp_path / "missing.gguf", 1)
    with pytest.raises(peers.PeerError, match="needs a draft model"):
        openvino_peer.OpenVinoPeer("openvino_spec", tmp_path / "missing.gguf", 1)


def test_check_peers_names_what_openvino_misses(tiny_qwen, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    assert not openvino_peer.is_installed()
    assert main(["bench", "--model", str(tiny_qwen), "--sets", "code_gen", "--num-prompts", "1", "--arms", "plain",
                 "--peers", "openvino_lookup"]) == 2
    err = capsys.readouterr().err
    assert "peer openvino is not installed" in err and "openvino-genai==2026.4.1.0" in err
    assert "--install-peers" in err and str(tmp_path / "peers" / "openvino") in err
    with pytest.raises(ValueError, match="openvino_spec need a draft model"):
        peers.make_peers(["openvino_spec"], tmp_path / "m.gguf", None, 1, 64, 4, install=True)


def test_failure_reason_is_one_line():
    e = peers.PeerError("openvino peer: pip install failed (exit 1):\nCollecting x\n\n"
                        "ERROR: No matching distribution\n")
    assert peers.failure_reason(e) == "openvino peer: pip install failed (exit 1): ... ERROR: No matching distribution"
    assert len(peers.failure_reason(ValueError("x" * 1000))) == 300


class FlakyPeer:
    """Runs once, then fails: a worker that dies mid-bench."""

    def __init__(self, name: str) -> None:
        self.name, self.load_seconds, self.version, self.calls, self.closed = name, 0.25, "9.9", 0, False

    def generate(self, prompt_ids, max_tokens):
        self.calls += 1
        if self.calls > 1:
            raise peers.PeerError(f"{self.name} worker exited (code -11); see its stderr above")
        return peers.PeerResult.of(list(range(max_tokens)), 0.5, 0.1)

    def close(self):
        self.closed = True


def test_bench_records_failed_peers_and_goes_on(fake_openvino, tiny_qwen, tmp_path, monkeypatch, capsys):
    """openvino fails to install, llama.cpp_lookup to load, llama.cpp dies on its second run: all
    recorded as failed, in the JSON and the table; our arms and the rest run to the end."""
    monkeypatch.setattr(openvino_peer, "is_installed", lambda: False)
    monkeypatch.setattr(llama_cpp_peer, "is_installed", lambda: True)

    def failing_install():
        raise peers.PeerError("openvino peer: pip install failed (exit 1):\nERROR: No matching distribution")

    flaky = FlakyPeer("llama.cpp")

    def make(name, *args):
        if name == "llama.cpp_lookup":
            raise peers.PeerError("llama.cpp_lookup worker: ValueError: draft_model needs logits_all")
        return flaky

    monkeypatch.setattr(openvino_peer, "install", failing_install)
    monkeypatch.setattr(peers, "_make_peer", make)
    monkeypatch.setattr(spec_bench, "measure_read_bandwidth", lambda num_threads: 10.0)
    out = tmp_path / "bench.json"
    names = ["llama.cpp", "llama.cpp_lookup", "openvino", "openvino_spec"]
    assert main(["bench", "--model", str(tiny_qwen), "--precision", "float32", "--sets", "code_gen",
                 "--num-prompts", "2", "--repeats", "1", "--max-tokens", "4", "--threads", "1", "--arms", "plain",
                 "--draft", str(tiny_qwen), "--peers", ",".join(names), "--install-peers", "--out", str(out),
                 "--plot", str(tmp_path / "bench.png")]) == 0
    report = json.loads(out.read_text())
    install_failure = "openvino peer: pip install failed (exit 1): ... ERROR: No matching distribution"
    assert report["peers"]["openvino"] == {"load_seconds": None, "version": None, "failed": install_failure}
    assert report["peers"]["openvino_spec"]["failed"] == install_failure
    load_failure = "llama.cpp_lookup worker: ValueError: draft_model needs logits_all"
    assert report["peers"]["llama.cpp_lookup"]["failed"] == load_failure
    died = "llama.cpp worker exited (code -11); see its stderr above"
    assert report["peers"]["llama.cpp"] == {"load_seconds": 0.25, "version": "9.9", "failed": died}
    assert flaky.closed and flaky.calls == 2  # not retried on later prompts
    rows = {(r["arm"], r["prompt"]): r for r in report["runs"]}
    assert len(rows) == 2 * 5 and all("failed" not in rows["plain", i] for i in range(2))
    assert rows["llama.cpp", 0]["generated_tokens"] == 4 and rows["llama.cpp", 1]["failed"] == died
    assert rows["openvino", 0] == {"set": "code_gen", "prompt": 0, "repeat": 0, "arm": "openvino", "peer": True,
                                   "failed": install_failure, "identical_to_plain": None}
    summary = report["summary"]["code_gen"]
    assert summary["openvino"] == {"failed": install_failure}
    assert summary["llama.cpp"]["failed"] == f"1 of 2 runs: {died}"
    assert summary["llama.cpp"]["tokens_per_second"]["median"] == pytest.approx(8.0)  # the run that worked
    assert summary["plain"]["tokens_per_second"]["median"] > 0
    table = capsys.readouterr().out   # the result table goes to stdout
    assert f"code_gen   openvino              failed: {install_failure}" in table
    assert f"failed 1 of 2 runs: {died}" in table
