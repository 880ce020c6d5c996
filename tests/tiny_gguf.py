"""Tiny random-weight GGUF files for unit tests: the whole loading path, in a few hundred KB."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _byte_tokens() -> list[str]:
    # GPT-2's bytes_to_unicode: each byte as one printable character
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def _add_value(w: gguf.GGUFWriter, key: str, value: object) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    else:
        w.add_string(key, str(value))


def _random_k_blocks(qtype, shape: tuple[int, int], scale: float, rng: np.random.Generator) -> np.ndarray:
    """Q4_K / Q6_K bytes with random codes and sub-block scales, the super-block scales set so that
    weights come out near `scale` in size (gguf-py cannot quantize K-quants itself)."""
    Q = gguf.GGMLQuantizationType
    per_block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (shape[0] * shape[1] // per_block, nbytes), dtype=np.uint8)
    f16 = lambda s, n: (rng.uniform(0.5, 1.5, (raw.shape[0], n)) * s).astype(np.float16).view(np.uint8)  # noqa: E731
    if qtype == Q.Q6_K:  # w = d * sc * q: sc * q has a spread of about 1400
        raw[:, 208:210] = f16(scale / 1400, 1)
    else:  # Q4_K: w = d * sc * q - dmin * m (sc, m < 64, q < 16); dmin = 7.5 d centres them, spread ~256 d
        raw[:, 0:2] = f16(scale / 256, 1)
        raw[:, 2:4] = f16(7.5 * scale / 256, 1)
    return raw.reshape(shape[0], -1)


def _add_tokenizer(w: gguf.GGUFWriter) -> int:
    """A byte-level BPE vocabulary: 256 bytes, a few merges, 3 control tokens, 2 unused rows, and a chat
    template. Returns its size."""
    tokens = _byte_tokens()
    merges = ["Ġ t", "Ġ a", "h e", "i n", "Ġt he"]
    tokens += [a + b for a, b in (m.split(" ") for m in merges)]
    types = [1] * len(tokens)
    tokens += SPECIALS
    types += [3] * len(SPECIALS)
    tokens += ["[PAD0]", "[PAD1]"]
    types += [5, 5]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    return len(tokens)


def write_tiny_gguf(path: Path, arch: str = "qwen2", seed: int = 0, num_layers: int = 2, hidden: int = 64,
                    num_heads: int = 4, num_kv_heads: int = 2, intermediate: int = 128, context: int = 512,
                    quantized: bool = True, unsupported_tensor: str | None = None, kquants: bool = False,
                    meta: dict[str, object] | None = None, extra_tensors: dict[str, np.ndarray] | None = None,
                    qk_scale: float = 1.0, rope_theta: float = 10000.0, logit_scale: float = 1.0,
                    head_dim: int | None = None) -> Path:
    """A random model of the given architecture with a byte-level BPE vocabulary (256 bytes, a few
    merges, 3 control tokens, 2 unused rows). Weights are scaled so logits are well spread.
    kquants: matrices whose rows are whole 256-value super-blocks are Q4_K and Q6_K in turn (as in the
    real Qwen files); needs hidden and intermediate multiples of 256.
    meta: further metadata by full key (bool, int as uint32, float as float32, str); extra_tensors:
    further float32 tensors by name (a Llama 3 file's `rope_freqs.weight`); qk_scale: Q and K weights that
    much larger, so attention is peaked and positions matter; logit_scale: the output layer that much
    larger, so the next-token distribution is peaked; head_dim: other than hidden / num_heads (as Qwen3's)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(num_layers)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(intermediate)
    w.add_head_count(num_heads)
    w.add_head_count_kv(num_kv_heads)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(1e-6)
    vocab = _add_tokenizer(w)
    for key, value in (meta or {}).items():
        _add_value(w, key, value)

    if head_dim is None:
        head_dim = hidden // num_heads
    else:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    Q = gguf.GGMLQuantizationType
    kinds = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.F16, Q.BF16]  # cycled over the matrices: every loader path
    if kquants:
        kinds = [Q.Q4_K, Q.Q6_K]
    counter = [0]

    def add(name: str, shape: tuple[int, ...], scale: float, quant: bool = True) -> None:
        arr = (rng.standard_normal(shape) * scale).astype(np.float32)
        if name == unsupported_tensor:  # a type the loader does not handle: IQ4_NL, 18 bytes per 32 values
            raw = np.zeros((shape[0], shape[1] // 32 * 18), dtype=np.uint8)
            w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
        elif quantized and quant and len(shape) == 2 and shape[1] % 32 == 0:
            q = kinds[counter[0] % len(kinds)]
            counter[0] += 1
            if q == Q.F16:
                w.add_tensor(name, arr.astype(np.float16))
            elif q in (Q.Q4_K, Q.Q6_K):
                w.add_tensor(name, _random_k_blocks(q, shape, scale, rng), raw_dtype=q)
            else:
                w.add_tensor(name, gguf.quants.quantize(arr, q), raw_dtype=q)
        else:
            w.add_tensor(name, arr)

    add("token_embd.weight", (vocab, hidden), 1.0)
    add("output_norm.weight", (hidden,), 0.1)
    add("output.weight", (vocab, hidden), logit_scale * hidden ** -0.5)
    for n in range(num_layers):
        b = f"blk.{n}."
        if arch != "olmo2":  # OLMo 2 norms attention's and the MLP's outputs instead (below)
            add(b + "attn_norm.weight", (hidden,), 0.1)
        add(b + "attn_q.weight", (num_heads * head_dim, hidden), qk_scale * hidden ** -0.5)
        add(b + "attn_k.weight", (num_kv_heads * head_dim, hidden), qk_scale * hidden ** -0.5)
        add(b + "attn_v.weight", (num_kv_heads * head_dim, hidden), hidden ** -0.5, quant=False)
        if arch in ("qwen3", "olmo2"):  # q/k norms per head, or over the projection; weights near 1
            q_len, k_len = (head_dim, head_dim) if arch == "qwen3" else (num_heads * head_dim, num_kv_heads * head_dim)
            w.add_tensor(b + "attn_q_norm.weight", (1 + 0.2 * rng.standard_normal(q_len)).astype(np.float32))
            w.add_tensor(b + "attn_k_norm.weight", (1 + 0.2 * rng.standard_normal(k_len)).astype(np.float32))
        if arch == "qwen2":
            add(b + "attn_q.bias", (num_heads * head_dim,), 0.1)
            add(b + "attn_k.bias", (num_kv_heads * head_dim,), 0.1)
            add(b + "attn_v.bias", (num_kv_heads * head_dim,), 0.1)
        add(b + "attn_output.weight", (hidden, num_heads * head_dim), hidden ** -0.5)
        if arch == "olmo2":
            add(b + "post_attention_norm.weight", (hidden,), 0.2)
            add(b + "post_ffw_norm.weight", (hidden,), 0.2)
        else:
            add(b + "ffn_norm.weight", (hidden,), 0.1)
        add(b + "ffn_gate.weight", (intermediate, hidden), hidden ** -0.5)
        add(b + "ffn_up.weight", (intermediate, hidden), hidden ** -0.5)
        add(b + "ffn_down.weight", (hidden, intermediate), intermediate ** -0.5)
    for name, arr in (extra_tensors or {}).items():
        w.add_tensor(name, np.asarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_hf_folder(src, folder: Path, **config) -> Path:
    """A loaded model (`specdec.models.loader.LoadedModel`, float32) as a Hugging Face-style folder:
    config.json (plus `config`'s keys), model.safetensors in Transformers' names, tokenizer.json."""
    from safetensors.torch import save_file

    cfg, w = src.config, src.weights
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    hf = {"model.embed_tokens.weight": w["embed"], "model.norm.weight": w["norm"]}
    if not cfg.tie_embeddings:
        hf["lm_head.weight"] = w["lm_head"]
    for n in range(cfg.num_layers):
        a, p = f"model.layers.{n}.", f"layers.{n}."
        for name, part in zip("qkv", w[p + "qkv"].split([q, kv, kv])):
            hf[a + f"self_attn.{name}_proj.weight"] = part
        if cfg.attention_bias:
            for name, part in zip("qkv", w[p + "qkv_bias"].split([q, kv, kv])):
                hf[a + f"self_attn.{name}_proj.bias"] = part
        if p + "q_norm" in w:
            hf[a + "self_attn.q_norm.weight"], hf[a + "self_attn.k_norm.weight"] = w[p + "q_norm"], w[p + "k_norm"]
        hf[a + "self_attn.o_proj.weight"] = w[p + "o"]
        gate, up = w[p + "gate_up"].chunk(2)
        hf[a + "mlp.gate_proj.weight"], hf[a + "mlp.up_proj.weight"] = gate, up
        hf[a + "mlp.down_proj.weight"] = w[p + "down"]
        if p + "input_norm" in w:
            hf[a + "input_layernorm.weight"] = w[p + "input_norm"]
            hf[a + "post_attention_layernorm.weight"] = w[p + "post_norm"]
        else:  # OLMo 2: the norms of attention's and the MLP's outputs
            hf[a + "post_attention_layernorm.weight"] = w[p + "attn_out_norm"]
            hf[a + "post_feedforward_layernorm.weight"] = w[p + "mlp_out_norm"]
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in hf.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "model_type": cfg.architecture, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps, "max_position_embeddings": cfg.max_position,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": cfg.attention_bias, "pad_token_id": None,
        **({"no_rope_layers": [int(n not in cfg.no_rope_layers) for n in range(cfg.num_layers)]}
           if cfg.architecture == "smollm3" else {}), **config}))
    (folder / "tokenizer.json").write_text(src.tokenizer._tok.to_str())
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "add_bos_token": False,
                                                              "chat_template": src.tokenizer.chat_template}))
    return folder
