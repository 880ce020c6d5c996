"""The precisions a benchmark loads its shared weights in: what an engine would choose for the
flags (`precision.resolve_precision`: `auto` -> a concrete mode, and the draft's), said on stderr as the
engine says it. Arms then share weights loaded once in exactly those modes."""
from __future__ import annotations

import sys

from specdec.config import DraftConfig, EngineConfig, ModelConfig, SpeculativeConfig


def resolve_precisions(model: str, precision: str, device: str, draft: str | None = None,
                       draft_precision: str | None = None) -> tuple[str, str]:
    """(target precision, draft precision) an engine would run for these settings.

    Args:
        model: the target's reference; precision: a mode or "auto"; device: "cpu" or "cuda[:N]".
        draft: the draft model's reference (None: the registry's default, never self-speculation).
        draft_precision: the draft's mode, None for the engine's choice.
    """
    from specdec.precision import resolve_precision
    config = EngineConfig(model=ModelConfig(model=model, precision=precision, device=device),
                          speculative=SpeculativeConfig(draft_model=draft, draft=DraftConfig(precision=draft_precision)))
    config, why = resolve_precision(config)
    if why != "set":
        print(f"precision: {config.model.precision} ({why})", file=sys.stderr)
    return config.model.precision, config.speculative.draft.precision or config.model.precision
