"""The proposer registry: kind -> builder, static cost hint and capabilities.

Config checks, CLI choices, the draft set and the router take their lists from here, so a new
proposer is one file in proposers/ plus one `register(...)` line below.

Ids: a model-free kind has one instance, whose id is the kind ("ngram"); a kind that needs a model
has one instance per model, whose id is the model's name.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from specdec.config import SpeculativeConfig

from specdec.speculation.proposers import draft_model, hybrid, ngram, suffix
from specdec.speculation.proposers.base import BuildContext, Proposer


@dataclass(frozen=True)
class ProposerKind:
    kind: str
    build: Callable[[BuildContext], Proposer]
    description: str                 # one line, for help texts and errors
    needs_model: bool                # built from a model reference (speculative.draft_model)
    has_kv_pool: bool = False        # keeps a KV pool of its own (proposer.kv, proposer.row_align)
    # a draft token's cost as a fraction of a target step; None: the config's controller.draft_cost_ratio,
    # then what its forwards measure
    cost_hint: float | None = None
    # domains where the router tries it before anything else, until gains are measured
    preferred_domains: tuple[str, ...] = ()
    # decides itself how many tokens to draft (up to the engine's cap) for every decoding request,
    # rather than the controller's k (see proposers/base.py)
    sizes_own_drafts: bool = False


_KINDS: dict[str, ProposerKind] = {}


def register(entry: ProposerKind) -> None:
    """Add a kind (a test may add its own and remove it with `unregister`)."""
    if entry.kind in _KINDS:
        raise ValueError(f"proposer kind {entry.kind!r} is already registered")
    _KINDS[entry.kind] = entry


def unregister(kind: str) -> None:
    _KINDS.pop(kind, None)


def get(kind: str) -> ProposerKind:
    entry = _KINDS.get(kind)
    if entry is None:
        raise ValueError(f"unknown speculative method {kind!r} (known: {', '.join(_KINDS)})")
    return entry


def resolve_config(spec: SpeculativeConfig) -> SpeculativeConfig:
    """Check the method against the registry; a model reference that names another kind selects
    it (`draft_model: suffix` in a YAML file; `hybrid` or `hybrid:MODEL` for a kind with a model).
    Raises ValueError."""
    entry = get(spec.method)
    kind, _, model = (spec.draft_model or "").partition(":")
    if entry.needs_model and kind in _KINDS and kind != spec.method:
        if not _KINDS[kind].needs_model and not model:
            return replace(spec, method=kind, draft_model=None)
        if _KINDS[kind].needs_model:
            return replace(spec, method=kind, draft_model=model or None)
    return spec


def kinds() -> list[str]:
    return list(_KINDS)


def model_free_kinds() -> list[str]:
    return [k for k, e in _KINDS.items() if not e.needs_model]


def model_kinds() -> list[str]:
    return [k for k, e in _KINDS.items() if e.needs_model]


register(ProposerKind("draft_model", draft_model.build, "a smaller model of the same vocabulary (or self:...)",
                      needs_model=True, has_kv_pool=True))
register(ProposerKind("hybrid", hybrid.build, "suffix lookup or the draft model, whichever the cost model prices "
                      "higher per step", needs_model=True, has_kv_pool=True, sizes_own_drafts=True))
register(ProposerKind("ngram", ngram.build, "n-gram prompt lookup (no model)", needs_model=False, cost_hint=0.01,
                      preferred_domains=("code_edit",)))
register(ProposerKind("suffix", suffix.build, "suffix lookup in the prompt, the output and earlier outputs (no model)",
                      needs_model=False, cost_hint=0.01, preferred_domains=("code_edit",), sizes_own_drafts=True))
