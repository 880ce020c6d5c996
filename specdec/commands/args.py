"""Flag groups shared by several subcommands (model, sampling, speculation) and the configs they
map to. Defaults come from the config dataclasses, so the flags and the configs never drift."""
from __future__ import annotations

import argparse
import dataclasses

from specdec.catalog import default_draft
from specdec.config import (
    COUPLINGS,
    DEFAULT_K,
    DEFAULT_TARGET,
    DRAFT_REQUANTIZE,
    KV_CACHE_DTYPES,
    PRECISION_CHOICES,
    PRECISIONS,
    SPEC_POLICIES,
    ControllerConfig,
    DraftConfig,
    EngineConfig,
    ModelConfig,
    SamplingConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from specdec.sampling_params import SamplingParams
from specdec.speculation import registry

_AUTO = ("for a GGUF model on a CPU where the int4 kernel builds, the fastest mode its `specdec kld` verdict "
         "allows (int4-a8 for the default target), int4-a16 where it has none; else float32 (the exact oracle); "
         "the mode chosen is printed")
DRAFT_PRECISION_HELP = ("the draft model's precision (default: int4-a8 where auto picks an int4 mode for the "
                        "target, else the target's; output is unchanged either way)")


def add_model_args(p: argparse.ArgumentParser, defaults: bool = True) -> None:
    """--model, --precision, --device, --max-model-len, --threads. defaults=False leaves each unset
    (None) unless given, for flags that override a YAML file."""
    p.add_argument("--model", default=DEFAULT_TARGET if defaults else None,
                   help="registry name, .gguf path or model folder")
    p.add_argument("--precision", "--dtype", dest="precision", default=ModelConfig.precision if defaults else None,
                   choices=PRECISION_CHOICES,
                   help=f"auto (default): {_AUTO}" if defaults else f"default: the YAML's, else auto: {_AUTO}")
    p.add_argument("--device", default=ModelConfig.device if defaults else None, help="cpu or cuda[:N]")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op threads (default: chosen per forward by measurement)")


def add_huge_pages_arg(p: argparse.ArgumentParser) -> None:
    """--no-huge-pages (None unless given)."""
    p.add_argument("--no-huge-pages", dest="huge_pages", action="store_const", const=False, default=None,
                   help="read the int4 weights through the cache file's mapping (shared between processes) "
                        "instead of copying them into transparent huge pages (faster steps)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """vLLM's engine flags: --chat-template, --max-num-seqs (alias --max-batch-size),
    --max-num-batched-tokens. Each is None unless given."""
    p.add_argument("--chat-template", metavar="FILE_OR_TEXT", default=None,
                   help="a Jinja chat template (a file, or the template text) instead of the model's own")
    p.add_argument("--max-num-seqs", "--max-batch-size", dest="max_batch_size", type=int, default=None, metavar="N",
                   help=f"requests running at once (default {SchedulerConfig.max_batch_size})")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help=f"token budget of one step (default {SchedulerConfig.max_num_batched_tokens})")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                   help="the K/V caches' format (default auto: the smallest measured as close to float32 as "
                        "llama.cpp's float16 K/V, else the model's dtype; float16 halves the cache's memory, "
                        "int8 nearly quarters it)")


def cache_overrides(a: argparse.Namespace) -> dict:
    """The CacheConfig fields the flags give."""
    return {} if a.kv_cache_dtype is None else {"kv_cache_dtype": a.kv_cache_dtype}


def scheduler_overrides(a: argparse.Namespace) -> dict:
    """The SchedulerConfig fields the flags give."""
    given = {"max_batch_size": a.max_batch_size, "max_num_batched_tokens": a.max_num_batched_tokens}
    return {k: v for k, v in given.items() if v is not None}


def check_device(device: str, where: str = "--device") -> None:
    """Refuse a CUDA device on a machine without CUDA before anything loads (ValueError, one line)."""
    if device.startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            raise ValueError(f"{where} {device}: CUDA is not available here (torch.cuda.is_available() is "
                             "false); use --device cpu")


def check_chat_template(setting: str | None, where: str = "--chat-template") -> None:
    """Read and compile a chat template setting before any model loads (ValueError naming `where`)."""
    if setting is None:
        return
    from specdec.models.tokenizer import compile_chat_template, read_chat_template
    try:
        compile_chat_template(read_chat_template(setting))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None,
                   help="seeds the run (vLLM's engine seed): each prompt draws its own stream from it, reproducibly")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", type=int, default=None)


def sampling_params(a: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p,
                          repetition_penalty=a.repetition_penalty, presence_penalty=a.presence_penalty,
                          frequency_penalty=a.frequency_penalty, seed=a.seed, max_tokens=a.max_tokens,
                          stop=a.stop, ignore_eos=a.ignore_eos, logprobs=a.logprobs)


def add_spec_args(p: argparse.ArgumentParser, defaults: bool = True) -> None:
    """--draft | --spec | --no-spec, -k, --spec-policy, --draft-vocab, --draft-precision, --draft-requantize,
    --spec-deterministic. defaults=False leaves k and the policy unset unless given."""
    p.add_argument("--draft", help="draft model (registry name or path): draft-model speculation, or the model "
                                   "draft of --spec hybrid")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--spec", choices=registry.kinds(), help="speculation method: " + "; ".join(
        f"{k}: {registry.get(k).description}" for k in registry.kinds()))
    g.add_argument("--no-spec", action="store_true", help="plain decoding (k = 0 throughout)")
    p.add_argument("--speculative-config", metavar="JSON", default=None,
                   help='vLLM\'s speculative config, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4}\' (methods: ngram, draft_model, suffix, hybrid; '
                        'instead of --spec / --draft / --no-spec / -k)')
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=None,
                   help="k for the fixed policy, the maximum k otherwise (default: "
                        + ", ".join(f"{k} for {p}" for p, k in DEFAULT_K.items()) + ")")
    p.add_argument("--spec-policy", choices=SPEC_POLICIES, default=SpeculativeConfig.policy if defaults else None)
    p.add_argument("--draft-vocab", type=_draft_vocab, default="auto", metavar="N|auto|all",
                   help="the draft model scores only N frequent tokens and each request's own (cheaper steps; "
                        "still lossless); auto (default): 32768 where that cuts a tenth of a draft step")
    p.add_argument("--draft-precision", choices=PRECISIONS, default=None, help=DRAFT_PRECISION_HELP)
    p.add_argument("--draft-requantize", choices=[r or "none" for r in DRAFT_REQUANTIZE], default="auto",
                   help="int4 modes: the draft's matrices requantized at pack time (a cheaper draft step, a "
                        "little less acceptance; still lossless): q4_1 (8-bit-held ones to 4 bits per 32 values), "
                        "q4_64 or q3_64 (int4-a8: 4 or 3 bits per 64 values); auto (default): q4_64 under "
                        "int4-a8, q4_1 under the other int4 modes, where the file holds wider matrices; none: "
                        "the file's blocks")
    p.add_argument("--spec-deterministic", action="store_true",
                   help="cost model decides from acceptance counts alone (under --coupling rejection, a seed "
                        "then fixes the text)")
    p.add_argument("--coupling", choices=COUPLINGS, default=None,
                   help="how sampled drafts are verified: gumbel (default; a seed fixes the text, with or without "
                        "speculation) or rejection (rejection sampling: a seed fixes the distribution)")


def sampling_config(a: argparse.Namespace, base: SamplingConfig | None = None) -> SamplingConfig:
    """The YAML's (or the default) SamplingConfig with --coupling on top."""
    base = base or SamplingConfig()
    return base if a.coupling is None else dataclasses.replace(base, coupling=a.coupling)


def speculative_config(a: argparse.Namespace, model: str | None = None) -> SpeculativeConfig | None:
    """The SpeculativeConfig the flags ask for (None: --no-spec); with no flag, the registry's
    default draft for a registry target, otherwise n-gram lookup. `model`: the target (default
    --model). Raises ValueError for a kind that needs a model when the target has no default draft."""
    model = model or a.model
    if a.speculative_config is not None:
        return _from_json(a, model)
    if a.no_spec:
        if a.draft:
            raise ValueError("--draft and --no-spec contradict each other")
        return None
    method, draft = a.spec, a.draft
    if draft:
        if method is not None and not registry.get(method).needs_model:
            raise ValueError(f"--draft names a model, but --spec {method} uses none")
        method = method or "draft_model"
    elif method is None:
        draft = default_draft(model)
        method = "draft_model" if draft else "ngram"
    elif registry.get(method).needs_model:
        draft = default_draft(model)
        if draft is None:
            raise ValueError(f"{model} has no default draft model; name one with --draft")
    return SpeculativeConfig(method=method, draft_model=draft,
                             num_speculative_tokens=a.num_speculative_tokens,
                             policy=a.spec_policy or SpeculativeConfig.policy,
                             controller=ControllerConfig(deterministic=a.spec_deterministic),
                             draft=_draft_config(a))


def _draft_vocab(value: str) -> int | str | None:
    """--draft-vocab: N, auto, or all (None: the whole vocabulary)."""
    if value in ("auto", "all"):
        return None if value == "all" else value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens, auto or all, got {value!r}") from None


def _draft_config(a: argparse.Namespace) -> DraftConfig:
    return DraftConfig(precision=a.draft_precision, vocab_size=a.draft_vocab,
                       requantize=None if a.draft_requantize == "none" else a.draft_requantize)


def _from_json(a: argparse.Namespace, model: str) -> SpeculativeConfig:
    """--speculative-config, with --spec-policy, --spec-deterministic and the draft's settings on top."""
    from specdec.commands import spec_json
    given = [flag for flag, value in (("--spec", a.spec), ("--draft", a.draft), ("--no-spec", a.no_spec),
                                      ("-k", a.num_speculative_tokens)) if value not in (None, False)]
    if given:
        raise ValueError(f"{spec_json.FLAG} and {given[0]} both set the speculation: keep one")
    spec = spec_json.parse(a.speculative_config, model, a.spec_policy)
    return dataclasses.replace(spec,
                               controller=ControllerConfig(deterministic=a.spec_deterministic),
                               draft=_draft_config(a))


def describe_speculation(spec: SpeculativeConfig | None) -> str:
    """One stderr line: how an engine speculates (give it the engine's resolved config)."""
    if spec is None:
        return "speculation: off (plain decoding)"
    kind = registry.get(spec.method)
    what = (f"draft model {spec.draft_model} ({spec.draft.precision or 'the target precision'})" if kind.needs_model
            else kind.description)
    return f"speculation: {what}, k={spec.num_speculative_tokens}, policy={spec.policy}"


def config_models(config: EngineConfig) -> list[str]:
    """Every model reference an engine built from `config` loads: the target, its draft (the
    registry's default when the method needs one and none is named) and the extra drafts."""
    models = [config.model.model]
    spec = config.speculative
    if spec is not None:
        if registry.get(spec.method).needs_model:
            models.append(spec.draft_model or default_draft(config.model.model))
        models += spec.draft.extra_models
    return [m for m in dict.fromkeys(models) if m]


def pull_on_first_use(models: list[str | None]) -> None:
    """Pull the registry models named that are not in the cache yet, one stderr line each (the CLI
    pulls on first use, as `ollama run` does; the server and the library never install)."""
    from specdec.models.loader import pull_on_first_use as pull
    for model in dict.fromkeys(m for m in models if m):
        pull(model)


def check_pulled(models: list[str]) -> None:
    """Raise ModelNotPulledError (a ValueError: one line, exit 2) for the first registry model
    named that was never pulled: a server installs nothing, at start or later."""
    from specdec.models.loader import check_pulled as check
    for model in models:
        check(model)
