"""What a model file says about its forward is read or refused, never skipped: GGUF metadata keys and
tensors, Hugging Face config keys, and rope scaling (linear, llama3's per-frequency factors, yarn),
each checked against Transformers, and against llama.cpp on the same GGUF where its peer is installed."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from specdec.config import specdec_home
from specdec.core.outputs import ScheduledChunk, SchedulerOutput
from specdec.models.gguf_loader import ModelFileError
from specdec.models.llama import LlamaModel
from specdec.models.loader import load_model
from specdec.models.rope import RopeScaling, llama3_factors
from specdec.runner.model_runner import ModelRunner
from tiny_gguf import write_hf_folder, write_tiny_gguf

BLOCK = 16
THETA = 10000.0
CONTEXT = 512
HEAD_DIM = 16  # write_tiny_gguf's hidden 64 over 4 heads
LLAMA_CPP_RTOL = 3e-4  # llama.cpp's float32 logits against ours, over its largest |logit| (float16 K/V there)
# llama3 over an original context of 64 tokens: wavelengths 6-20k tokens span kept, blended and divided
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """One model cache for the module (files differ by content, so do their caches); the kernels and the
    peers are the user's own (content-addressed and written by rename: safe to share)."""
    real = specdec_home()
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("home")
        for shared in ("kernels", "peers"):
            (real / shared).mkdir(parents=True, exist_ok=True)
            (path / shared).symlink_to(real / shared)
        mp.setenv("SPECDEC_HOME", str(path))
        yield path


def _llama_file(path, **kw):
    return write_tiny_gguf(path, arch="llama", seed=3, context=CONTEXT, qk_scale=12.0, **kw)


@pytest.mark.parametrize("key,value", [
    ("llama.attention.sliding_window", 512), ("llama.final_logit_softcapping", 30.0), ("llama.expert_count", 8),
    ("llama.embedding_scale", 12.0), ("llama.attention.causal", False), ("llama.rope.dimension_count", 8),
    ("llama.some_future_key", 1), ("llama.rope.scaling.type", "longrope"),
])
def test_a_gguf_key_that_changes_the_forward_is_refused_by_name(home, tmp_path, key, value):
    path = _llama_file(tmp_path / "m.gguf", meta={key: value})
    with pytest.raises(ModelFileError, match=re.escape(key)):
        load_model(str(path), progress=False)


def test_neutral_values_and_descriptive_keys_load(home, tmp_path):
    path = _llama_file(tmp_path / "m.gguf", meta={
        "llama.expert_count": 0, "llama.attention.causal": True, "llama.rope.dimension_count": HEAD_DIM,
        "llama.final_logit_softcapping": 0.0, "llama.rope.scaling.type": "none", "quantize.imatrix.file": "x.dat",
        "general.url": "https://example.org", "llama.tensor_data_layout": "Meta AI original pth"})
    assert load_model(str(path), progress=False).config.rope == RopeScaling()
    # 1/sqrt(head_dim) as the file stores it, in float32 (0.17677669...: not the double 32 ** -0.5)
    qwen3 = write_tiny_gguf(tmp_path / "q3.gguf", arch="qwen3", head_dim=32, meta={"qwen3.attention.scale": 32 ** -0.5})
    assert load_model(str(qwen3), progress=False).config.head_dim == 32


@pytest.mark.parametrize("precision", ["float32", "int4"])
def test_a_tensor_the_forward_does_not_read_is_refused_by_name(home, tmp_path, precision):
    path = _llama_file(tmp_path / "m.gguf", extra_tensors={"blk.0.attn_q_norm.weight": np.ones(HEAD_DIM)})
    with pytest.raises(ModelFileError, match=r"blk\.0\.attn_q_norm\.weight"):
        load_model(str(path), precision=precision, progress=False)
    qwen = write_tiny_gguf(tmp_path / "q.gguf", arch="qwen2", extra_tensors={"rope_freqs.weight": np.ones(8)})
    with pytest.raises(ModelFileError, match=r"rope_freqs\.weight"):  # llama.cpp reads it for llama files only
        load_model(str(qwen), precision=precision, progress=False)


@pytest.mark.parametrize("key,value", [
    ("sliding_window", None), ("hidden_act", "gelu_pytorch_tanh"), ("final_logit_softcapping", 30.0),
    ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}), ("rope_scaling", {"rope_type": "yarn", "factor": 2.0,
                                                                               "original_max_position_embeddings": 64,
                                                                               "mscale_all_dim": 1.0}),
    ("layer_types", ["full_attention", "sliding_attention"]),
])
def test_a_config_key_that_changes_the_forward_is_refused_by_name(home, tmp_path, key, value):
    src = load_model(str(_llama_file(tmp_path / "m.gguf")), progress=False)
    extra = {"use_sliding_window": True, "sliding_window": 64} if key == "sliding_window" else {key: value}
    folder = write_hf_folder(src, tmp_path / "hf", **extra)
    name = "use_sliding_window" if key == "sliding_window" else key
    with pytest.raises(ModelFileError, match=name if key != "rope_scaling" else "dynamic|mscale_all_dim"):
        load_model(str(folder), progress=False)


def test_a_safetensors_tensor_the_forward_does_not_read_is_refused(home, tmp_path):
    from safetensors.torch import load_file, save_file
    src = load_model(str(_llama_file(tmp_path / "m.gguf")), progress=False)
    folder = write_hf_folder(src, tmp_path / "hf")
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({**tensors, "model.layers.0.self_attn.q_norm.weight": torch.ones(HEAD_DIM)},
              str(folder / "model.safetensors"))
    with pytest.raises(ModelFileError, match=r"q_norm\.weight"):
        load_model(str(folder), progress=False)


def test_llama3_factors_follow_the_llama3_rule():
    f = llama3_factors(HEAD_DIM, THETA, 8.0, 1.0, 4.0, 64)
    wavelengths = [2 * math.pi * THETA ** (2 * i / HEAD_DIM) for i in range(HEAD_DIM // 2)]
    for wl, factor in zip(wavelengths, f):
        if wl < 16:        # shorter than original / high_freq_factor: kept
            assert factor == 1.0
        elif wl > 64:      # longer than original / low_freq_factor: divided by the whole factor
            assert factor == 8.0
        else:
            assert 1.0 < factor < 8.0
    assert 1.0 in f and 8.0 in f and any(1 < x < 8 for x in f)


# (GGUF metadata, GGUF extra tensors, the same scaling as a Hugging Face rope_scaling)
CASES = {
    "linear": ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}, {},
               {"rope_type": "linear", "factor": 2.0}),
    "llama3": ({}, {"rope_freqs.weight": np.array(llama3_factors(HEAD_DIM, THETA, 8.0, 1.0, 4.0, 64))}, LLAMA3),
    "yarn": ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
              "llama.rope.scaling.original_context_length": 64}, {},
             {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
}


def _our_logits(loaded, ids: list[int]) -> torch.Tensor:
    model = LlamaModel(loaded.config, loaded.weights, len(ids), torch.device("cpu"))
    runner = ModelRunner(model, -(-len(ids) // BLOCK), BLOCK, torch.device("cpu"))
    chunk = ScheduledChunk("rope", ids, 0, list(range(-(-len(ids) // BLOCK))), num_logits=len(ids))
    return runner.execute(SchedulerOutput(chunks=[chunk], num_batched_tokens=len(ids))).logits


def _transformers_logits(folder, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def ids() -> list[int]:
    return [int(x) for x in np.random.default_rng(7).integers(0, 256, 300)]  # byte tokens, past 4x the original


@pytest.mark.parametrize("case", list(CASES))
def test_rope_scaling_matches_transformers_from_gguf_and_from_a_folder(home, tmp_path, case, ids):
    """The GGUF's scaling (as llama.cpp reads it) and the folder's `rope_scaling` (as Transformers reads
    it) give the same model, whose logits at every position are Transformers' within 1e-4, and unscaled
    rope would not be."""
    meta, tensors, hf_rope = CASES[case]
    ours = load_model(str(_llama_file(tmp_path / "m.gguf", meta=meta, extra_tensors=tensors)), progress=False)
    assert ours.config.rope.kind == case
    folder = write_hf_folder(ours, tmp_path / "hf", rope_scaling=hf_rope)
    from_folder = load_model(str(folder), progress=False)
    assert from_folder.config.rope.kind == case
    ref = _transformers_logits(folder, ids)
    for loaded in (ours, from_folder):
        delta = (_our_logits(loaded, ids) - ref).abs().max().item()
        assert delta < 1e-4, f"{case}: max |delta| {delta:.3g} against Transformers"
    plain = write_hf_folder(ours, tmp_path / "plain")
    unscaled = (_transformers_logits(plain, ids) - ref).abs().max().item()
    assert unscaled > 100 * delta and unscaled > 1e-2, f"{case}: the scaling changes logits by only {unscaled:.3g}"


def test_rope_scaling_survives_the_weight_cache(home, tmp_path):
    meta, tensors, _ = CASES["llama3"]
    path = _llama_file(tmp_path / "m.gguf", meta=meta, extra_tensors=tensors)
    for precision in ("float32", "int4"):
        cold = load_model(str(path), precision=precision, progress=False)
        warm = load_model(str(path), precision=precision, progress=False)
        assert warm.cache_hit and warm.config == cold.config and warm.config.rope.kind == "llama3"


def _max_delta_from_llama_cpp(path, ids: list[int], scratch) -> float:
    """The largest |logit| difference between our float32 and llama.cpp on the same GGUF, at every position,
    over llama.cpp's largest |logit| (skips where the llama.cpp peer is not installed)."""
    from specdec.bench import llama_cpp_peer
    if not llama_cpp_peer.is_installed():
        pytest.skip(f"the llama.cpp peer is not installed ({llama_cpp_peer.install_hint()})")
    ours = _our_logits(load_model(str(path), progress=False), ids)
    peer = llama_cpp_peer.LlamaCppPeer("llama.cpp", path, 1, len(ids), logits_all=True)
    try:
        theirs = torch.from_numpy(peer.score(ids, scratch)[0]).float()
    finally:
        peer.close()
    return (ours - theirs).abs().max().item() / theirs.abs().max().item()


@pytest.mark.parametrize("case", list(CASES))
def test_rope_scaling_matches_llama_cpp(home, tmp_path, case, ids):
    """llama.cpp itself on the same GGUF: our float32 logits equal its within its own rounding (its K/V
    cache holds float16: measured 4e-5 to 1.3e-4 of the largest logit over these files)."""
    meta, tensors, _ = CASES[case]
    path = _llama_file(tmp_path / "m.gguf", meta=meta, extra_tensors=tensors, quantized=False)
    assert _max_delta_from_llama_cpp(path, ids, tmp_path) < LLAMA_CPP_RTOL


# each new family's random file: (write_tiny_gguf's arguments); its differences in families.py
FAMILY_FILES = {
    "qwen3": {"seed": 5, "head_dim": 32, "qk_scale": 4.0},  # q|k|v wider than a row, per-head norms
    "smollm3": {"seed": 6, "num_layers": 4, "qk_scale": 12.0},  # layer 3 without rotary embeddings
    "olmo2": {"seed": 8, "qk_scale": 3.0},  # norms after attention and the MLP; q/k norms over the projection
}


def _family_file(path, arch: str, quantized: bool = True):
    return write_tiny_gguf(path, arch=arch, context=CONTEXT, logit_scale=20.0, quantized=quantized,
                           **FAMILY_FILES[arch])


@pytest.mark.parametrize("precision", ["float32", "int4-a8"])
@pytest.mark.parametrize("arch", list(FAMILY_FILES))
def test_family_matches_transformers_from_gguf_and_from_a_folder(home, tmp_path, ids, arch, precision):
    """Our GGUF and folder loads give Transformers' logits for the family (float32: within 1e-4; the
    integer path within its quantization)."""
    gguf = _family_file(tmp_path / "m.gguf", arch)
    ours = load_model(str(gguf), progress=False)
    assert ours.config.architecture == arch
    folder = write_hf_folder(ours, tmp_path / "hf")
    ref = _transformers_logits(folder, ids)
    if precision == "float32":
        from_folder = load_model(str(folder), progress=False)
        assert from_folder.config == ours.config
        for loaded in (ours, from_folder):
            assert (_our_logits(loaded, ids) - ref).abs().max().item() < 1e-4
        return
    fast = _our_logits(load_model(str(gguf), precision=precision, progress=False), ids)
    assert (fast.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    assert (fast - ref).abs().max().item() < 0.1 * ref.abs().max().item()


def test_family_declarations():
    from specdec.models.families import family
    q3, s3, o2 = family("qwen3"), family("smollm3"), family("olmo2")
    assert q3.qk_norm == "head" and q3.qkv_bias == "never" and not q3.interleaved_qk
    assert o2.qk_norm == "projection" and o2.norms == "post" and q3.norms == "pre"
    assert s3.no_rope_layers(8) == (3, 7) and s3.interleaved_qk and family("llama").no_rope_layers(8) == ()
    runs = "specdec runs llama, qwen2, qwen3, olmo2, smollm3"
    with pytest.raises(ValueError, match=f"unknown architecture 'gemma3': {runs}"):
        family("gemma3")


@pytest.mark.parametrize("arch", list(FAMILY_FILES))
def test_family_greedy_speculation_equals_plain(home, tmp_path, arch):
    from specdec import LLM, SamplingParams, SpeculativeConfig
    gguf = str(_family_file(tmp_path / "m.gguf", arch))
    prompts = ["the cat sat on the mat and the cat", "hello there, hello there, hello"]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = [o.token_ids for o in LLM(model=gguf, precision="int4-a8", progress=False).generate(prompts, params)]
    spec = LLM(model=gguf, precision="int4-a8", progress=False,
               speculative=SpeculativeConfig(method="draft_model", draft_model=gguf, num_speculative_tokens=3,
                                             policy="fixed"))
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == plain
    assert sum(o.stats.accepted_tokens for o in outs) > 0


@pytest.mark.parametrize("arch", list(FAMILY_FILES))
def test_family_matches_llama_cpp(home, tmp_path, ids, arch):
    path = _family_file(tmp_path / "m.gguf", arch, quantized=False)
    assert _max_delta_from_llama_cpp(path, ids, tmp_path) < LLAMA_CPP_RTOL
