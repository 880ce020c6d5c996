"""Peer arms of `specdec bench` without installing any peer: a fake transformers peer, the real
llama.cpp worker over its pipe with a fake `llama_cpp` module, the bandwidth ceiling, the flags."""
from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from specdec.bench import bandwidth, llama_cpp_peer, peers, spec_bench
from specdec.cli import main
from specdec.quant.packed import QuantLinear, QuantTensor

FAKE_LLAMA_CPP = '''
import os, sys
__version__ = "0.0-fake"

class Llama:
    def __init__(self, model_path, n_ctx, n_threads, n_threads_batch, draft_model, seed, verbose):
        if not os.path.exists(model_path):
            raise ValueError(f"no model {model_path}")
        self.draft_model, self.n_threads = draft_model, n_threads
        print("stdout noise from Python")            # must not reach the protocol channel
        os.write(1, b"stdout noise from C\\n")
        self.resets = self.runs = 0

    def reset(self):                                  # the worker forgets the previous KV every time
        self.resets += 1

    def generate(self, tokens, top_k, top_p, min_p, typical_p, temp, repeat_penalty):
        assert (top_k, temp, repeat_penalty) == (1, 0.0, 1.0), "greedy, no penalties"
        self.runs += 1
        assert self.resets == self.runs, "every run starts cold"
        i = 0
        while True:                                   # never stops by itself, like llama.cpp's
            yield (sum(tokens) + i) % 50
            i += 1
'''
FAKE_SPECULATIVE = '''
class LlamaPromptLookupDecoding:
    def __init__(self, num_pred_tokens):
        self.num_pred_tokens = num_pred_tokens
'''


@pytest.fixture
def fake_llama_cpp(tmp_path, monkeypatch):
    """A `llama_cpp` package on PYTHONPATH (subprocesses inherit it); the 'venv' is this python."""
    pkg = tmp_path / "fake" / "llama_cpp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(FAKE_LLAMA_CPP))
    (pkg / "llama_speculative.py").write_text(textwrap.dedent(FAKE_SPECULATIVE))
    monkeypatch.setenv("PYTHONPATH", str(pkg.parent))
    monkeypatch.setattr(llama_cpp_peer, "venv_python", lambda: sys.executable)
    monkeypatch.setattr(llama_cpp_peer, "is_installed", lambda: True)
    return pkg.parent


def test_llama_cpp_worker_protocol(fake_llama_cpp, tiny_qwen):
    requests = [{"model_path": str(tiny_qwen), "n_ctx": 128, "n_threads": 1, "lookup": True, "num_pred_tokens": 3},
                {"prompt_ids": [1, 2, 3], "max_tokens": 5}, {"prompt_ids": [7], "max_tokens": 2}]
    proc = subprocess.run([sys.executable, "-P", str(llama_cpp_peer.WORKER)], capture_output=True, text=True, check=False,
                          input="".join(json.dumps(r) + "\n" for r in requests), timeout=60)
    assert proc.returncode == 0, proc.stderr
    replies = [json.loads(line) for line in proc.stdout.splitlines()]  # the noise went to stderr
    assert replies[0]["version"] == "0.0-fake" and replies[0]["load_seconds"] >= 0
    assert replies[1]["token_ids"] == [6, 7, 8, 9, 10] and replies[2]["token_ids"] == [7, 8]
    assert all(0 < r["ttft_seconds"] <= r["seconds"] for r in replies[1:])
    assert "stdout noise from C" in proc.stderr


def test_llama_cpp_worker_reports_a_failed_load_and_exits(fake_llama_cpp, tmp_path):
    req = {"model_path": str(tmp_path / "missing.gguf"), "n_ctx": 64, "n_threads": 1, "lookup": False,
           "num_pred_tokens": 4}
    proc = subprocess.run([sys.executable, "-P", str(llama_cpp_peer.WORKER)], capture_output=True, text=True, check=False,
                          input=json.dumps(req) + "\n", timeout=60)
    assert proc.returncode == 1
    assert "no model" in json.loads(proc.stdout)["error"]
    with pytest.raises(peers.PeerError, match="no model"):
        llama_cpp_peer.LlamaCppPeer("llama.cpp", tmp_path / "missing.gguf", 1, 64)


def test_llama_cpp_peer_client(fake_llama_cpp, tiny_qwen):
    peer = llama_cpp_peer.LlamaCppPeer("llama.cpp_lookup", tiny_qwen, 1, 128, lookup=True, num_pred_tokens=2)
    try:
        r = peer.generate([4, 5], 3)
        assert r.token_ids == [9, 10, 11] and r.generated_tokens == 3
        assert r.tokens_per_second == pytest.approx(3 / r.seconds) and peer.version == "0.0-fake"
    finally:
        peer.close()
    assert peer.proc.returncode == 0


def test_install_step_failure_names_the_step():
    log = io.StringIO()
    with pytest.raises(peers.PeerError, match=r"pip install failed \(exit 3\):\n.*boom"):
        llama_cpp_peer._step([sys.executable, "-c", "print('boom'); raise SystemExit(3)"], "pip install", log)
    assert "boom" in log.getvalue()  # streamed as it ran


def test_llama_cpp_build_leaves_amx_out_where_the_cpu_has_it(tmp_path, monkeypatch):
    """-march=native everywhere but on AMX CPUs, whose llama.cpp AMX path crashes on batches: there every
    instruction set the CPU has is named and AMX is off; a marker of other flags means a rebuild."""
    assert llama_cpp_peer.cmake_args({"avx2", "fma"}).startswith("-DGGML_NATIVE=ON ")
    amx = llama_cpp_peer.cmake_args({"avx2", "fma", "avx512f", "avx512_vnni", "amx_int8", "amx_tile"})
    assert "-DGGML_NATIVE=OFF" in amx and "-DGGML_AMX_INT8=OFF" in amx
    assert "-DGGML_AVX512=ON" in amx and "-DGGML_AVX512_VNNI=ON" in amx and "-DGGML_AVX512_BF16=OFF" in amx
    monkeypatch.setattr(llama_cpp_peer, "venv_dir", lambda: tmp_path)
    monkeypatch.setattr(llama_cpp_peer, "venv_python", lambda: tmp_path / "python")
    (tmp_path / "python").write_text("")
    (tmp_path / "installed.json").write_text(json.dumps({"version": llama_cpp_peer.VERSION, "cmake_args": "old"}))
    assert not llama_cpp_peer.is_installed()
    (tmp_path / "installed.json").write_text(json.dumps({"version": llama_cpp_peer.VERSION,
                                                         "cmake_args": llama_cpp_peer.cmake_args()}))
    assert llama_cpp_peer.is_installed()


class FakeTransformersPeer:
    """Our own float32 engine on the same file: a peer whose greedy tokens equal our plain arm's."""

    def __init__(self, name, model_path, num_threads, draft_path=None):
        from specdec.llm import LLM
        self.name, self.load_seconds = name, 0.5
        self.llm = LLM(model=str(model_path), precision="float32", num_threads=num_threads, progress=False)

    def generate(self, prompt_ids, max_tokens):
        from specdec.sampling_params import SamplingParams
        out = self.llm.generate([prompt_ids], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]
        return peers.PeerResult.of(out.token_ids, out.stats.seconds, out.stats.ttft_seconds)

    def close(self):
        self.llm = None


def test_spec_bench_with_peers(fake_llama_cpp, tiny_qwen, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(peers, "TransformersPeer", FakeTransformersPeer)
    monkeypatch.setattr(spec_bench, "measure_read_bandwidth", lambda num_threads: 10.0)
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    assert main(["bench", "--model", str(tiny_qwen), "--precision", "float32", "--sets", "code_gen,chat",
                 "--num-prompts", "1", "--repeats", "2", "--max-tokens", "6", "--threads", "1", "--arms", "plain,ngram",
                 "--peers", "transformers,llama.cpp", "--out", str(out), "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    assert len(report["runs"]) == 2 * 2 * 4
    assert [r["arm"] for r in report["runs"][:4]] == ["plain", "ngram", "transformers", "llama.cpp"]
    assert set(report["peers"]) == {"transformers", "llama.cpp"}
    assert report["peers"]["llama.cpp"]["version"] == "0.0-fake"
    for s in ("code_gen", "chat"):
        e = report["summary"][s]
        assert set(e) == {"plain", "ngram", "transformers", "llama.cpp"}
        assert e["transformers"]["identical_to_plain"] is True   # float32 on both sides
        assert e["llama.cpp"]["identical_to_plain"] is False     # the fake's made-up tokens
        for p in ("transformers", "llama.cpp"):
            for key in ("speedup", "decode_speedup"):
                assert e[p][key]["min"] <= e[p][key]["median"] <= e[p][key]["max"]
            assert e[p]["acceptance_rate"] is None and e[p]["mean_accepted_length"] is None
    rows = [r for r in report["runs"] if r["peer"]]
    assert len(rows) == 8 and all(r["generated_tokens"] == 6 and r["tokens_per_second"] > 0 for r in rows)
    # decode only: 5 tokens after the first, over the time after it
    assert all(r["decode_tokens_per_second"] == pytest.approx(5 / (r["seconds"] - r["ttft_seconds"])) for r in rows)
    held = report["ceiling"]["weight_bytes_per_token"]
    assert report["bandwidth_gb_s"] == 10.0 and report["ceiling_tokens_per_second"] == pytest.approx(10e9 / held)
    captured = capsys.readouterr()   # the table on stdout, the ceiling note on stderr
    assert "llama.cpp " in captured.out and "memory-bandwidth ceiling: 10.0 GB/s" in captured.err
    assert png.stat().st_size > 1000


def test_ceiling_counts_the_weights_a_decode_step_reads(tiny_qwen):
    from specdec.models.loader import load_model
    f32 = load_model(str(tiny_qwen), "float32", progress=False)
    int4 = load_model(str(tiny_qwen), "int4", progress=False)
    assert not f32.config.tie_embeddings  # the lookup table is left out, the output layer counted
    full = sum(w.numel() * 4 for w in f32.weights.values())
    embed = f32.weights["embed"].numel() * 4
    assert bandwidth.weight_bytes_per_token(f32.weights, False) == full - embed
    assert bandwidth.weight_bytes_per_token(f32.weights, True) == full
    # int4 as held: packed parts count their codes + scales + offsets, float32 parts their floats
    down = int4.weights["layers.0.down"].parts[0]
    assert isinstance(down, QuantTensor) and down.bits == 4
    assert bandwidth._nbytes(int4.weights["layers.0.down"]) == (down.codes.numel() + 4 * down.scale.numel()
                                                               + 4 * down.offset.numel())
    assert bandwidth.weight_bytes_per_token(int4.weights, False) < full - embed
    roof = bandwidth.ceiling(20.0, f32.weights, False, tiny_qwen)
    assert roof["ceiling_tokens_per_second"] == pytest.approx(20e9 / (full - embed))
    assert roof["gguf_ceiling_tokens_per_second"] == pytest.approx(20e9 / tiny_qwen.stat().st_size)


def test_ceiling_counts_what_the_integer_kernels_read(tiny_kquant):
    """On K-quant super-blocks the integer paths read int8 group scales and one float per 256 values,
    not the float32 group scales; Q6_K's codes are 6-bit; under int4-a8 Q4_K's offsets are a byte of
    minimum per group and one float per 256 values."""
    from specdec.models.loader import load_model
    a8 = load_model(str(tiny_kquant), "int4-a8", progress=False)
    parts = [t for w in a8.weights.values() if isinstance(w, QuantLinear) for t in zip(w.parts, w.subs, w.mins)]
    six = [t for t in parts if isinstance(t[0], QuantTensor) and t[0].bits == 6]
    four = [t for t in parts if isinstance(t[0], QuantTensor) and t[0].bits == 4]
    assert six and four and all(s is not None for _, s, _ in six + four)
    p, s, m = six[0]
    assert m is None and p.codes.numel() == p.rows * p.cols * 3 // 4
    assert bandwidth._part_bytes(p, s, m) == p.codes.numel() + s.numel() + 4 * p.super_scale.numel()
    p, s, m = four[0]
    assert m is not None and m.dtype == torch.uint8 and m.shape == p.offset.shape
    assert bandwidth._part_bytes(p, s, m) == (p.codes.numel() + s.numel() + m.numel()
                                              + 4 * (p.super_scale.numel() + p.super_min.numel()))


@pytest.mark.parametrize("reader", ["kernel", "torch"])
def test_measure_read_bandwidth_restores_threads(monkeypatch, reader):
    from specdec.quant import kernel
    if reader == "torch":  # where the kernels do not build: sum() reads the buffer
        monkeypatch.setattr(kernel, "available", lambda: False)
    elif not kernel.available():
        pytest.skip(kernel.unavailable_reason())
    before = torch.get_num_threads()
    gb_s = bandwidth.measure_read_bandwidth(num_bytes=8 * 2**20 + 4 * 37, passes=2, num_threads=2)
    assert 0.1 < gb_s < 10_000 and torch.get_num_threads() == before


def bench_args(tiny_qwen, *extra):
    return ["bench", "--model", str(tiny_qwen), "--sets", "code_gen", "--num-prompts", "1", "--repeats", "1",
            "--arms", "plain", *extra]


def test_peers_flag_validation(tiny_qwen, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))  # no llama.cpp peer built here
    assert main(bench_args(tiny_qwen, "--peers", "vllm")) == 2
    assert "unknown peers ['vllm']; choose from transformers, transformers_assisted" in capsys.readouterr().err
    assert main(bench_args(tiny_qwen, "--peers", "llama.cpp_lookup")) == 2
    err = capsys.readouterr().err
    assert "peer llama.cpp is not installed" in err and "--install-peers" in err and str(tmp_path) in err
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails as if not installed
    assert main(bench_args(tiny_qwen, "--peers", "transformers")) == 2
    assert "pip install" in capsys.readouterr().err


def test_make_peers_installs_llama_cpp_only_when_asked(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    built = []
    monkeypatch.setattr(llama_cpp_peer, "install", lambda: built.append(1))
    with pytest.raises(ValueError, match="--install-peers"):
        peers.make_peers(["llama.cpp"], tmp_path / "m.gguf", None, 1, 64, 4, install=False)
    assert built == []
    monkeypatch.setattr(llama_cpp_peer, "LlamaCppPeer", lambda name, *a, **kw: name)
    assert peers.make_peers(["llama.cpp"], tmp_path / "m.gguf", None, 1, 64, 4, install=True) == {
        "llama.cpp": "llama.cpp"}
    assert built == [1]


def test_contention_counts_a_peer_worker_as_the_benchmarks_own(monkeypatch):
    import specdec.contention as c
    busy = iter([100.0, 104.0])   # machine-wide busy CPU seconds at enter / exit
    own = iter([5.0, 6.0])        # this process
    worker = iter([10.0, 12.0])   # the llama.cpp worker it drives
    wall = iter([0.0, 2.0])
    monkeypatch.setattr(c, "_busy_seconds", lambda: next(busy))
    monkeypatch.setattr(c.time, "process_time", lambda: next(own))
    monkeypatch.setattr(c.time, "perf_counter", lambda: next(wall))
    monkeypatch.setattr(c, "_process_seconds", lambda pid: next(worker))
    with c.Contention(helper_pids=(123,)) as run:
        pass
    assert run.cores == 0.5 and not run.noisy  # (4 - 1 - 2) CPU seconds by others over 2 s


def test_decode_bench_uses_the_same_transformers_peer(tiny_qwen, tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "TransformersPeer", FakeTransformersPeer)
    out = tmp_path / "decode.json"
    assert main(["bench", "decode", "--model", str(tiny_qwen), "--num-prompts", "1", "--repeats", "1",
                 "--max-tokens", "4", "--threads", "1", "--peer", "transformers", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["runs"][0]["transformers"]["generated_tokens"] == 4
    assert report["summary"]["transformers_load_seconds"] == 0.5 and report["summary"]["speedup_vs_transformers"] > 0
