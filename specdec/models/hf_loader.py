"""A Hugging Face-style folder (config.json, *.safetensors) -> our fused parameter layout."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from specdec.models.gguf_keys import hf_rope_scaling
from specdec.models.gguf_loader import ModelFileError, refuse_unread
from specdec.models.families import HF_MODEL_TYPES, family, has_bias
from specdec.models.llama import LlamaConfig, param_shapes


def _architecture(raw: dict) -> str:
    arch = HF_MODEL_TYPES.get(raw.get("model_type", ""))
    if arch is None:
        raise ModelFileError(f"unknown architecture {raw.get('model_type')!r}: specdec runs "
                             f"{', '.join(HF_MODEL_TYPES)}")
    return arch


# config keys that change the forward unless they hold one of these values (None: absent or null)
_NEUTRAL = {"hidden_act": ("silu",), "mlp_bias": (False,), "use_sliding_window": (False,),
            "attn_logit_softcapping": (None,), "final_logit_softcapping": (None,), "logit_scale": (None, 1.0),
            "logits_scaling": (None, 1.0), "embedding_multiplier": (None, 1.0), "residual_multiplier": (None, 1.0),
            "attention_multiplier": (None,), "partial_rotary_factor": (None, 1.0)}


def _no_rope_layers(raw: dict, arch: str) -> tuple[int, ...]:
    """The layers without rotary embeddings: SmolLM3's `no_rope_layers` (1: the layer rotates), else none."""
    flags = raw.get("no_rope_layers")
    if flags is None:
        return family(arch).no_rope_layers(raw["num_hidden_layers"])
    if family(arch).no_rope_interval == 0:
        raise ModelFileError(f"config.json no_rope_layers: layers without rotary embeddings are not part of {arch}")
    if len(flags) != raw["num_hidden_layers"]:
        raise ModelFileError(f"config.json no_rope_layers has {len(flags)} entries for "
                             f"{raw['num_hidden_layers']} layers")
    return tuple(i for i, rotates in enumerate(flags) if not rotates)


def _check_keys(raw: dict) -> None:
    for key, neutral in _NEUTRAL.items():
        if key in raw and raw[key] not in neutral:
            raise ModelFileError(f"config.json {key} = {raw[key]!r} changes the forward in a way specdec does not "
                                 "implement")
    layers = set(raw.get("layer_types") or ()) - {"full_attention"}
    if layers:
        raise ModelFileError(f"config.json layer_types has {sorted(layers)[0]!r} layers: not implemented")


def config_from_hf(raw: dict, tensor_names: set[str]) -> LlamaConfig:
    arch = _architecture(raw)
    _check_keys(raw)
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    theta = float(raw.get("rope_theta") or (raw.get("rope_parameters") or {}).get("rope_theta") or 10000.0)
    try:
        scaling = hf_rope_scaling(raw, head_dim, theta)
    except ValueError as e:
        raise ModelFileError(f"config.json: {e}") from e
    return LlamaConfig(
        architecture=arch, vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"], num_layers=raw["num_hidden_layers"], num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads", heads),
        head_dim=head_dim, rope_theta=theta, rms_norm_eps=float(raw["rms_norm_eps"]),
        max_position=raw.get("max_position_embeddings", 4096),
        attention_bias=has_bias(family(arch), bool(raw.get("attention_bias", False))),
        tie_embeddings="lm_head.weight" not in tensor_names, rope=scaling, no_rope_layers=_no_rope_layers(raw, arch),
    )


def load_hf_folder(path: Path, dtype: torch.dtype, device: str) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    files = sorted(path.glob("*.safetensors"))
    if not (path / "config.json").is_file() or not files:
        raise ModelFileError(f"{path}: a model folder needs config.json and *.safetensors")
    try:
        raw_config = json.loads((path / "config.json").read_text())
    except ValueError as e:
        raise ModelFileError(f"{path / 'config.json'} is not valid JSON: {e}") from e
    _architecture(raw_config)  # an unknown architecture fails before any weight is read
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    raw[k] = st.get_tensor(k)
        except Exception as e:  # the safetensors library raises its own error types on bad files
            raise ModelFileError(f"{f} is not a readable safetensors file (truncated or corrupt?): {e}") from e
    try:
        cfg = config_from_hf(raw_config, set(raw))
    except KeyError as e:
        raise ModelFileError(f"{path / 'config.json'} lacks {e}") from e

    used: set[str] = set()

    def get(name: str) -> torch.Tensor:
        if name not in raw:
            raise ModelFileError(f"{path}: tensor {name} is missing")
        used.add(name)
        return raw[name]

    fam = family(cfg.architecture)
    w = {"embed": get("model.embed_tokens.weight"), "norm": get("model.norm.weight")}
    if not cfg.tie_embeddings:
        w["lm_head"] = get("lm_head.weight")
    for n in range(cfg.num_layers):
        a, p = f"model.layers.{n}.", f"layers.{n}."
        if fam.norms == "pre":  # Transformers' names; OLMo 2's post_attention_layernorm follows attention
            w[p + "input_norm"] = get(a + "input_layernorm.weight")
            w[p + "post_norm"] = get(a + "post_attention_layernorm.weight")
        else:
            w[p + "attn_out_norm"] = get(a + "post_attention_layernorm.weight")
            w[p + "mlp_out_norm"] = get(a + "post_feedforward_layernorm.weight")
        w[p + "qkv"] = torch.cat([get(a + f"self_attn.{x}_proj.weight") for x in "qkv"])
        if cfg.attention_bias:
            w[p + "qkv_bias"] = torch.cat([get(a + f"self_attn.{x}_proj.bias") for x in "qkv"])
        if fam.qk_norm:
            w[p + "q_norm"], w[p + "k_norm"] = get(a + "self_attn.q_norm.weight"), get(a + "self_attn.k_norm.weight")
        w[p + "o"] = get(a + "self_attn.o_proj.weight")
        w[p + "gate_up"] = torch.cat([get(a + "mlp.gate_proj.weight"), get(a + "mlp.up_proj.weight")])
        w[p + "down"] = get(a + "mlp.down_proj.weight")
    # rotary_emb.inv_freq: a buffer older checkpoints saved, recomputed from the config (as Transformers does)
    refuse_unread({k for k in set(raw) - used if not k.endswith("rotary_emb.inv_freq")}, cfg.architecture,
                  f"the folder {path}")
    shapes = param_shapes(cfg)
    for k, t in w.items():
        if tuple(t.shape) != shapes[k]:
            raise ModelFileError(f"{path}: {k} has shape {tuple(t.shape)}, expected {shapes[k]}")
    return cfg, {k: t.to(device=device, dtype=dtype).contiguous() for k, t in w.items()}
