"""`precision: auto` made concrete: which mode a model runs in on this machine, and why."""
from __future__ import annotations

from dataclasses import replace

from specdec.config import AUTO_CPU_PRECISION, AUTO_DRAFT_PRECISION, EngineConfig
from specdec.models.loader import LoadedModel, gguf_identity, is_gguf
from specdec.quant import criterion, kernel
from specdec.speculation.proposers.self_draft import is_self_draft


def resolve_precision(config: EngineConfig, loaded: LoadedModel | None = None) -> tuple[EngineConfig, str]:
    """`precision: auto` -> a concrete mode, and why. Auto is the fastest mode that meets the precision
    criterion (quant/criterion.py: no further from float32 than llama.cpp, as `specdec kld` measured
    it) for a GGUF model on a CPU where the kernel builds; int4-a16 where the model has no verdict;
    float32 elsewhere. A model already loaded keeps its own precision. With the CPU mode, a draft model left at the target's
    precision runs in int4-a8: a draft's numbers never change the output (rejection sampling is
    exact for any draft), and integer dot products make its steps cheaper (not for self-speculation,
    which runs the target's own weights)."""
    mc, spec = config.model, config.speculative
    if mc.precision != "auto":
        return config, "set"
    if loaded is not None:
        precision, why = loaded.precision, "the loaded model's"
    elif not mc.device.startswith("cpu"):
        precision, why = "float32", f"device {mc.device}"
    elif not kernel.available():
        precision, why = "float32", f"the int4 kernel is unavailable: {kernel.unavailable_reason()}"
    elif not is_gguf(mc.model):
        precision, why = "float32", "int4 modes pack a GGUF file's quantized blocks"
    else:
        precision, why = criterion.auto_choice(gguf_identity(mc.model)) or (AUTO_CPU_PRECISION, (
            "no `specdec kld` verdict for this model: the GGUF's own weights, activations rounded to int16 on "
            "its K-quant matrices (near-lossless); float32 is the exact oracle"))
    config = replace(config, model=replace(mc, precision=precision))
    if (precision.startswith("int4") and spec is not None and spec.draft.precision is None
            and not is_self_draft(spec.draft_model)):
        config = replace(config, speculative=replace(spec, draft=replace(spec.draft, precision=AUTO_DRAFT_PRECISION)))
    return config, why


def resolve_kv_cache(config: EngineConfig) -> tuple[EngineConfig, str] | None:
    """`kv_cache_dtype: auto` -> the smallest K/V format measured as close to float32 as llama.cpp in the
    model's (concrete) precision mode (quant/criterion.py), and why; None where auto keeps the model's
    dtype: no such measurement, or not a GGUF model on a CPU where the kernel builds."""
    mc = config.model
    if (config.cache.kv_cache_dtype != "auto" or not mc.device.startswith("cpu") or not is_gguf(mc.model)
            or not kernel.available()):
        return None
    choice = criterion.auto_kv_choice(gguf_identity(mc.model), mc.precision)
    if choice is None:
        return None
    fmt, why = choice
    return replace(config, cache=replace(config.cache, kv_cache_dtype=fmt)), why
