"""What each `{arch}.*` key of a GGUF file does to the forward, declared: read, harmless at its neutral
value, or refused by name. A key or tensor specdec does not read is an error, never skipped: a file
whose forward differs from ours must not load and run wrong (a Llama 3 file's `rope_freqs` did)."""
from __future__ import annotations

import math
from typing import Any

from specdec.models.rope import RopeScaling, llama3_factors

# keys the loader reads into LlamaConfig (or checks against it)
READ = frozenset({
    "vocab_size", "context_length", "embedding_length", "block_count", "feed_forward_length",
    "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.dimension_count",
    "rope.scaling.type", "rope.scaling.factor", "rope.scale_linear", "rope.scaling.original_context_length",
    "rope.scaling.attn_factor", "rope.scaling.yarn_ext_factor", "rope.scaling.yarn_beta_fast",
    "rope.scaling.yarn_beta_slow",
    # describe the file, change no arithmetic (llama.cpp reads neither at inference)
    "rope.scaling.finetuned", "tensor_data_layout",
})

# keys that change the forward unless they hold one of these values (llama.cpp's "off")
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "expert_count": (0,), "expert_used_count": (0,), "expert_shared_count": (0,),
    "attention.causal": (True,), "use_parallel_residual": (False,),
    "logit_scale": (1.0,), "embedding_scale": (1.0,), "residual_scale": (1.0,),
    "attn_logit_softcapping": (0.0,), "final_logit_softcapping": (0.0,),
    "attention.sliding_window": (0,), "attention.clamp_kqv": (0.0,), "attention.max_alibi_bias": (0.0,),
    "rope.scaling.yarn_log_multiplier": (0.0,), "rope.scaling.yarn_attn_factor": (1.0,),
}

# tensors specdec reads beyond the layers' own (models/gguf_loader.py `_gguf_sources`)
ROPE_FREQS = "rope_freqs.weight"


def check_keys(meta: dict[str, Any], arch: str, head_dim: int) -> None:
    """Raise ValueError naming the first `{arch}.*` key that changes the forward in a way specdec does
    not implement, or that specdec does not know."""
    prefix = f"{arch}."
    for key, value in meta.items():
        if not key.startswith(prefix):
            continue  # general.*, tokenizer.*, quantize.*: describe the file, not the forward
        name = key[len(prefix):]
        if name in READ:
            continue
        neutral = NEUTRAL.get(name)
        if name == "attention.scale":  # 0 is llama.cpp's "1/sqrt(head_dim)", the scale every family here uses
            neutral = (0.0, 1.0 / math.sqrt(head_dim))
        if neutral is not None:
            if _neutral(value, neutral):
                continue
            raise ValueError(f"metadata {key} = {value!r} changes the forward in a way specdec does not implement")
        raise ValueError(f"metadata {key} = {_short(value)} is a key specdec does not read; it may change the "
                         "forward, so the file is refused rather than run without it")
    dims = meta.get(prefix + "rope.dimension_count", head_dim)
    if int(dims) != head_dim:
        raise ValueError(f"metadata {prefix}rope.dimension_count = {dims}: rotary embeddings over part of a head "
                         f"({head_dim}) are not implemented")
    value_dim = meta.get(prefix + "attention.value_length", head_dim)
    if int(value_dim) != head_dim:
        raise ValueError(f"metadata {prefix}attention.value_length = {value_dim} differs from the key length "
                         f"{head_dim}: not implemented")


def rope_scaling(meta: dict[str, Any], arch: str, freq_factors: tuple[float, ...] | None) -> RopeScaling:
    """The file's rope scaling, as llama.cpp reads it (`llama_model::load_hparams`): a scaling type
    (`linear` when only a factor is given), a factor, yarn's parameters, and llama3's per-frequency
    divisors from the `rope_freqs` tensor."""
    p = f"{arch}.rope."
    factor = float(meta.get(p + "scaling.factor") or meta.get(p + "scale_linear") or 1.0)
    kind = str(meta.get(p + "scaling.type", "linear"))
    if kind not in ("none", "linear", "yarn"):
        raise ValueError(f"metadata {p}scaling.type = {kind!r} is not implemented (specdec runs none, linear, yarn)")
    if freq_factors is not None:
        if kind == "yarn" or factor != 1.0:
            raise ValueError(f"{ROPE_FREQS} beside {p}scaling.type {kind} with factor {factor}: not implemented")
        return RopeScaling("llama3", freq_factors=freq_factors)
    if kind == "none" or factor == 1.0 and kind == "linear":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling("linear", factor)
    if float(meta.get(p + "scaling.yarn_ext_factor", 1.0)) != 1.0:
        raise ValueError(f"metadata {p}scaling.yarn_ext_factor other than 1 is not implemented")
    return RopeScaling("yarn", factor,
                       original_context=int(meta.get(p + "scaling.original_context_length",
                                                     meta.get(f"{arch}.context_length", 0))),
                       beta_fast=float(meta.get(p + "scaling.yarn_beta_fast", 32.0)),
                       beta_slow=float(meta.get(p + "scaling.yarn_beta_slow", 1.0)),
                       attn_factor=float(meta.get(p + "scaling.attn_factor", 1.0)))


def hf_rope_scaling(raw: dict[str, Any], head_dim: int, theta: float) -> RopeScaling:
    """A Hugging Face config's `rope_scaling` (or Transformers 5's `rope_parameters`) as a RopeScaling;
    a kind or parameter specdec does not implement is refused by name."""
    rs = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    known = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "low_freq_factor",
             "high_freq_factor", "beta_fast", "beta_slow", "attention_factor", "truncate", "partial_rotary_factor"}
    unknown = sorted(set(rs) - known)
    if unknown:
        raise ValueError(f"rope_scaling.{unknown[0]} is not implemented")
    if float(rs.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("rope_parameters.partial_rotary_factor: rotary embeddings over part of a head are not "
                         "implemented")
    factor = float(rs.get("factor", 1.0))
    if kind == "default":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling("linear", factor)
    original = int(rs.get("original_max_position_embeddings") or raw.get("max_position_embeddings", 0))
    if kind == "llama3":
        return RopeScaling("llama3", freq_factors=llama3_factors(
            head_dim, theta, factor, float(rs["low_freq_factor"]), float(rs["high_freq_factor"]), original))
    if kind == "yarn":
        mscale = 1.0 + 0.1 * math.log(factor) if factor > 1 else 1.0
        attention = rs.get("attention_factor")
        return RopeScaling("yarn", factor, original_context=original, beta_fast=float(rs.get("beta_fast", 32.0)),
                           beta_slow=float(rs.get("beta_slow", 1.0)),
                           attn_factor=1.0 if attention is None else float(attention) / mscale,
                           truncate=bool(rs.get("truncate", True)))
    raise ValueError(f"rope_scaling type {kind!r} is not implemented (specdec runs default, linear, llama3, yarn)")


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """Whether the value (or, for a per-layer array, every layer's) is one of `neutral`; floats as
    float32, in which the file stores them."""
    def same(v: Any, n: Any) -> bool:
        return math.isclose(v, n, rel_tol=1e-6) if isinstance(v, float) and isinstance(n, float) else v == n
    values = value if isinstance(value, list) else [value]
    return all(any(same(v, n) for n in neutral) for v in values)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
