"""`specdec cache [list] | clear`: what $SPECDEC_HOME holds, by model and kind, and selective removal.

A model is known by the sha256 of its GGUF file: its weight caches live in cache/<sha256>/ (one file per
kind: weights-float32, weights-bfloat16, weights-int4, the tokenizer files, the dense loaders' config).
A cache is named after its model through the registry's digests, then the GGUF paths sha256.json
remembers; an unknown one shows as its short hash. Every cache is rebuilt on first use, so clearing
one costs only the time to rebuild it; a removed GGUF comes back with `specdec models pull`."""
from __future__ import annotations

import argparse
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

# what `--kind` may name; a model's own kinds first (the ones `--model` alone clears)
MODEL_KINDS = ("gguf", "float32", "bfloat16", "int4", "tokenizer", "config", "partial")
KINDS = (*MODEL_KINDS, "precision", "kernels", "peers", "subvocab", "self-draft", "index", "other")
# folders of $SPECDEC_HOME whose whole content is one kind (peers: one entry per peer build)
FOLDER_KINDS = {"kernels": "kernels", "subvocab": "subvocab", "self-draft": "self-draft"}
CACHE_FILES = {"tokenizer.json": "tokenizer", "tokenizer_meta.json": "tokenizer", "config.json": "config"}
SHORT = 12  # hex digits of an unknown model's hash shown


@dataclass
class Entry:
    """Files of one owner (a model name, a short hash, or the item's own name) and one kind."""
    owner: str
    kind: str
    paths: list[Path] = field(default_factory=list)
    size: int = 0


def register(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("cache", help="what $SPECDEC_HOME holds (models, weight caches, kernels, peers), "
                                     "by model and kind; clear it selectively")
    csub = c.add_subparsers(dest="cache_cmd")
    csub.add_parser("list", help="the default: every model and kind, with sizes and a total")
    clear = csub.add_parser("clear", help="remove what --model / --kind select (or --all); caches are "
                                          "rebuilt on first use")
    clear.add_argument("--model", action="append", default=[],
                       help="a model name (or an unknown cache's short hash); alone, its GGUF and weight "
                            "caches (repeatable)")
    clear.add_argument("--kind", action="append", default=[], choices=KINDS, help="only this kind (repeatable)")
    clear.add_argument("--all", action="store_true", help="everything in $SPECDEC_HOME")
    clear.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    c.set_defaults(func=cmd_cache, cache_cmd=None)


def cmd_cache(a: argparse.Namespace) -> int:
    from specdec.config import specdec_home
    home = specdec_home()
    entries = scan(home)
    if a.cache_cmd == "clear":
        return _clear(home, entries, a)
    _print_entries(home, entries)
    print(f"total {human(sum(e.size for e in entries))} in {home}")
    return 0


# ---- what the home holds ------------------------------------------------------------------------
def scan(home: Path) -> list[Entry]:
    """Every item of the home as entries merged by (owner, kind): the models' own kinds first, then the
    rest; by owner, then kind, within each."""
    names = _names_by_sha(home)
    items: list[tuple[str, str, Path]] = []
    for top in sorted(home.iterdir()) if home.is_dir() else []:
        items += _items_of(top, names)
    merged: dict[tuple[str, str], Entry] = {}
    for owner, kind, path in items:
        e = merged.setdefault((owner, kind), Entry(owner, kind))
        e.paths.append(path)
        e.size += _size(path)
    return sorted(merged.values(), key=lambda e: (e.kind not in MODEL_KINDS, e.owner, KINDS.index(e.kind)))


def _items_of(top: Path, names: dict[str, str]) -> list[tuple[str, str, Path]]:
    """(owner, kind, path) of one top-level entry of the home."""
    if top.name == "models" and top.is_dir():
        # a partial assembly (".NAME.gguf.PID.partial") belongs to its model too
        return [(p.name.lstrip(".").split(".gguf")[0], "gguf" if p.suffix == ".gguf" else "partial", p)
                for p in sorted(top.iterdir())]
    if top.name == "cache" and top.is_dir():
        return [(names.get(d.name, d.name[:SHORT]), _cache_kind(f), f)
                for d in sorted(top.iterdir()) for f in (sorted(d.iterdir()) if d.is_dir() else [d])]
    if top.name == "precision" and top.is_dir():
        return [(p.stem, "precision", p) for p in sorted(top.iterdir())]
    if top.name == "peers" and top.is_dir():
        return [(p.name, "peers", p) for p in sorted(top.iterdir())]
    if top.name in FOLDER_KINDS:
        return [(top.name, FOLDER_KINDS[top.name], top)]
    if top.name == "sha256.json":
        return [(top.name, "index", top)]
    return [(top.name, "other", top)]


def _cache_kind(f: Path) -> str:
    if f.name in CACHE_FILES:
        return CACHE_FILES[f.name]
    kind = f.name.removeprefix("weights-").removesuffix(".safetensors")
    if f.name.startswith("weights-") and kind in MODEL_KINDS:
        return kind
    return "partial" if f.name.startswith(".") else "other"  # a hidden name: a write that was interrupted


def _names_by_sha(home: Path) -> dict[str, str]:
    """sha256 -> model name: the registry's first, then the stem of a GGUF path sha256.json remembers."""
    from specdec.catalog import REGISTRY
    names = {}
    for path, sha in sorted(_read_memo(home).items()):
        names.setdefault(sha, Path(path.split("|")[0]).name.removesuffix(".gguf"))
    names.update({e.sha256: e.name for e in REGISTRY.values()})
    return names


def _read_memo(home: Path) -> dict[str, str]:
    try:
        memo = json.loads((home / "sha256.json").read_text())
    except (OSError, ValueError):
        return {}
    return memo if isinstance(memo, dict) else {}


def _size(path: Path) -> int:
    if path.is_symlink() or not path.is_dir():
        return path.lstat().st_size
    return sum((Path(root) / f).lstat().st_size for root, _, files in os.walk(path) for f in files)


def human(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _where(home: Path, e: Entry) -> str:
    """Where an entry lies, relative to the home, a cache folder's hash cut short."""
    parts = list(e.paths[0].relative_to(home).parts)
    if parts[0] == "cache" and len(parts) > 1 and len(parts[1]) > SHORT:
        parts[1] = parts[1][:SHORT] + "..."
    first = Path(*parts)
    if len(e.paths) == 1:
        return str(first)
    same_folder = len({p.parent for p in e.paths}) == 1
    return f"{first.parent}/ ({len(e.paths)} files)" if same_folder else f"{len(e.paths)} files"


def _print_entries(home: Path, entries: list[Entry]) -> None:
    owner = None
    for e in entries:
        if e.owner != owner:
            owner = e.owner
            total = sum(x.size for x in entries if x.owner == owner)
            print(f"{owner:40} {human(total):>10}")
        print(f"  {e.kind:12} {human(e.size):>10}  {_where(home, e)}")


# ---- clearing -----------------------------------------------------------------------------------
def select(entries: list[Entry], models: list[str], kinds: list[str], everything: bool) -> list[Entry]:
    """The entries `clear` removes. Raises ValueError when nothing is named, or a model is unknown."""
    if everything:
        if models or kinds:
            raise ValueError("--all clears everything; it takes no --model or --kind")
        return entries
    if not models and not kinds:
        raise ValueError("name what to clear: --model NAME, --kind KIND (or both), or --all")
    from specdec.catalog import REGISTRY
    unknown = [m for m in models if m not in REGISTRY and all(e.owner != m for e in entries)]
    if unknown:
        raise ValueError(f"nothing cached for {', '.join(unknown)}; `specdec cache` lists the models")
    wanted_kinds = kinds or MODEL_KINDS  # a model alone: its files, not its measured precision verdict
    return [e for e in entries if (not models or e.owner in models) and e.kind in wanted_kinds]


def _clear(home: Path, entries: list[Entry], a: argparse.Namespace) -> int:
    chosen = select(entries, a.model, a.kind, a.all)
    if not chosen:
        print("nothing matches; nothing removed")
        return 0
    verb = "would remove" if a.dry_run else "removed"
    for e in chosen:
        if not a.dry_run:
            remove(home, e)
        print(f"{verb} {e.owner} {e.kind} ({human(e.size)}): {_where(home, e)}")
    print(f"{'would free' if a.dry_run else 'freed'} {human(sum(e.size for e in chosen))}")
    return 0


def remove(home: Path, e: Entry) -> None:
    """Delete an entry's files; a removed GGUF leaves sha256.json, and an emptied cache folder goes too."""
    for path in e.paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
        if path.parent.parent == home / "cache" and not any(path.parent.iterdir()):
            path.parent.rmdir()
    if e.kind == "gguf":
        forget_sha256(home, e.paths)


def forget_sha256(home: Path, removed: list[Path]) -> None:
    """Drop the memo entries of removed files (keyed "real path|size|mtime"); rewritten atomically."""
    from specdec.fileio import atomic_write_text
    memo_path = home / "sha256.json"
    memo = _read_memo(home)
    gone = {str(p.resolve()) for p in removed} | {str(p) for p in removed}
    kept = {k: v for k, v in memo.items() if k.split("|")[0] not in gone}
    if len(kept) != len(memo):
        atomic_write_text(memo_path, json.dumps(kept, indent=0))
