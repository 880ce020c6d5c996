"""Build proposers (the one place that knows every proposer class)."""
from __future__ import annotations

import sys

import torch

from specdec.config import EngineConfig, SpeculativeConfig
from specdec.models import registry
from specdec.models.loader import LoadedModel, load_model
from specdec.runner.threads import thread_tuner
from specdec.speculation.proposers.draft_model import DraftModelProposer, check_same_vocabulary
from specdec.speculation.proposers.ngram import NgramProposer
from specdec.speculation.proposers.self_draft import format_skip, is_self_draft, parse_skip, resolve_auto


def default_draft(target_name: str) -> str | None:
    entry = registry.REGISTRY.get(target_name)
    return entry.default_draft if entry else None


def build_ngram_proposer(spec: SpeculativeConfig) -> NgramProposer:
    return NgramProposer(spec.ngram_max, spec.ngram_min)


def build_draft_proposer(config: EngineConfig, target: LoadedModel, draft_loaded: LoadedModel | None,
                         max_model_len: int, progress: bool = True) -> DraftModelProposer:
    spec = config.speculative
    assert spec is not None
    name = spec.draft_model or default_draft(target.name)
    if name is None and draft_loaded is None:
        raise ValueError(f"no draft model given and {target.name!r} has no default draft; "
                         "pass draft_model=... or use method='ngram'")
    skip = None
    if is_self_draft(name):  # self-speculation: the target's own weights, some layers skipped
        if spec.draft_precision not in (None, config.model.precision):
            raise ValueError("self-speculation runs the target's own weights: draft_precision must be the "
                             f"target's ({config.model.precision}) or unset")
        skip = parse_skip(name, target.config.num_layers)
        if skip is None:
            skip = resolve_auto(target, progress)
        name, draft = format_skip(skip), target
    else:
        precision = spec.draft_precision or config.model.precision
        draft = draft_loaded or load_model(name, precision, config.model.device, progress)
    if progress:
        print(f"draft model {draft.name} loaded in {draft.load_seconds:.1f}s", file=sys.stderr)
    shared = check_same_vocabulary(target.tokenizer.token_strings, draft.tokenizer.token_strings,
                                   target.name, draft.name)
    return DraftModelProposer(draft, config.cache.draft_cache_blocks, config.cache.block_size,
                              torch.device(config.model.device), shared, max_model_len, spec.draft_vocab_size,
                              skip_layers=skip, name=name if skip is not None else None,
                              tuner=thread_tuner(config.model), prefix_caching=config.cache.enable_prefix_caching)
