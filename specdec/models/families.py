"""Decoder families, each declared once: how it differs from the base decoder (RMSNorm before attention
and MLP, rotate-half rotary embeddings, grouped-query attention, SwiGLU). The loaders, the PyTorch
forward and the C++ forward read these flags; nothing is inferred from which tensors a file holds.
A new family is one entry here (and its test in tests/test_model_keys.py)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str               # GGUF `general.architecture`
    hf_model_type: str      # Hugging Face `config.json` model_type
    qkv_bias: str           # "always", "never", or "optional" (read where the file has them, as llama.cpp does)
    qk_norm: str = ""       # an RMSNorm of q and of k before rotary embeddings: over each "head" (Qwen3)
                            # or over the whole "projection" (OLMo 2)
    norms: str = "pre"      # RMSNorms before attention and the MLP ("pre"), or on their outputs before
                            # the residual adds ("post": OLMo 2)
    interleaved_qk: bool = False  # GGUF Q/K rows in llama.cpp's interleaved order (undone at load)
    rope_freqs: bool = False      # reads a GGUF `rope_freqs.weight` (Llama 3's per-frequency rope factors)
    no_rope_interval: int = 0     # every n-th layer (n, 2n, ...) attends without rotary embeddings (SmolLM3: 4)

    def no_rope_layers(self, num_layers: int) -> tuple[int, ...]:
        """The layers without rotary embeddings, as llama.cpp places them for a GGUF file."""
        n = self.no_rope_interval
        return tuple(i for i in range(num_layers) if n and (i + 1) % n == 0)


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", "llama", qkv_bias="optional", interleaved_qk=True, rope_freqs=True),
    Family("qwen2", "qwen2", qkv_bias="always"),
    Family("qwen3", "qwen3", qkv_bias="never", qk_norm="head"),
    Family("olmo2", "olmo2", qkv_bias="never", qk_norm="projection", norms="post"),
    Family("smollm3", "smollm3", qkv_bias="never", interleaved_qk=True, no_rope_interval=4),
)}
HF_MODEL_TYPES = {f.hf_model_type: f.name for f in FAMILIES.values()}


def family(architecture: str) -> Family:
    """The family of a GGUF architecture name; ValueError naming those that run."""
    if architecture not in FAMILIES:
        raise ValueError(f"unknown architecture {architecture!r}: specdec runs {', '.join(FAMILIES)}")
    return FAMILIES[architecture]


def has_bias(fam: Family, file_has_bias: bool) -> bool:
    """Whether q|k|v carry biases: the family's declaration, or the file's where the family allows both."""
    if fam.qkv_bias == "optional":
        return file_has_bias
    return fam.qkv_bias == "always"
