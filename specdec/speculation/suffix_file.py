"""The suffix cache on disk (`server.suffix_cache_path`): saved when the server drains, loaded when
it starts, so a restart keeps the outputs its suffix drafts come from.

One JSON document: a format name and version, the tokenizer's fingerprint (token ids mean nothing
under another vocabulary), and each cache scope's outputs, oldest first. Scopes are named by their
digest (`SamplingParams.cache_scope`), never by a salt or a key. The file is written atomically
(fileio), readable by its owner only: it holds tenants' outputs. A file that is not exactly this (another version or tokenizer, bad JSON, a token outside
the vocabulary) is refused whole with a `SuffixFileError` naming the problem.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from specdec.fileio import atomic_write_text
from specdec.speculation.proposers.suffix_scopes import ScopedSuffixCache

FORMAT, VERSION = "specdec-suffix-cache", 1
_SCOPE = re.compile(r"(|[0-9a-f]{32})")


class SuffixFileError(ValueError):
    pass


def save(path: str | Path, cache: ScopedSuffixCache, tokenizer: str) -> int:
    """Write `cache` to `path` atomically; returns the tokens saved."""
    state = cache.state()
    doc = {"format": FORMAT, "version": VERSION, "tokenizer": tokenizer, "scopes": state}
    atomic_write_text(Path(path), json.dumps(doc, separators=(",", ":")))
    return sum(len(seq) for outputs in state.values() for seq in outputs)


def load(path: str | Path, cache: ScopedSuffixCache, tokenizer: str, vocab_size: int) -> int:
    """Replace `cache`'s contents with the file's; returns the tokens loaded. Raises
    SuffixFileError (and leaves `cache` as it was) for a file it cannot trust."""
    try:
        doc = json.loads(Path(path).read_bytes())
    except OSError as e:
        raise SuffixFileError(f"cannot read {path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SuffixFileError(f"{path} is not a suffix cache file (not JSON: {e})") from None
    state = _checked(doc, path, tokenizer, vocab_size)
    cache.restore(state)
    return sum(len(seq) for outputs in state.values() for seq in outputs)


def _checked(doc: object, path: str | Path, tokenizer: str, vocab_size: int) -> dict[str, list[list[int]]]:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise SuffixFileError(f"{path} is not a suffix cache file (format is not {FORMAT!r})")
    if doc.get("version") != VERSION:
        raise SuffixFileError(f"{path} has format version {doc.get('version')!r}; this specdec reads {VERSION}")
    if doc.get("tokenizer") != tokenizer:
        raise SuffixFileError(f"{path} was saved with another tokenizer ({doc.get('tokenizer')!r}, "
                              f"this model's is {tokenizer!r})")
    scopes = doc.get("scopes")
    if not isinstance(scopes, dict):
        raise SuffixFileError(f"{path}: 'scopes' must be a mapping")
    for scope, outputs in scopes.items():
        if not _SCOPE.fullmatch(scope) or not isinstance(outputs, list):
            raise SuffixFileError(f"{path}: scope {scope[:40]!r} is not a scope digest with a list of outputs")
        for seq in outputs:
            if not isinstance(seq, list) or not all(type(t) is int and 0 <= t < vocab_size for t in seq):
                raise SuffixFileError(f"{path}: an output of scope {scope!r} holds something other than "
                                      f"token ids in 0..{vocab_size - 1}")
    return scopes
