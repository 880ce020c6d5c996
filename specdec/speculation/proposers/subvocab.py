"""A frequent-token sub-vocabulary for a draft model's output layer.

The draft's largest matrix is its output layer (151,936 rows on Qwen2.5, against 896 hidden); scoring
only a sub-vocabulary cuts a draft step's cost. The draft then proposes from a distribution that is
zero outside the sub-vocabulary, and rejection sampling stays exact for any draft distribution:
the target's output distribution is unchanged, only acceptance can drop.

Which tokens, from data we can name and that ships with every Python:
  * the first `size // 2` ids of the vocabulary: byte-level BPE assigns ids in merge order, so low
    ids are the pieces most frequent in the tokenizer's own training corpus (prose, code, bytes);
  * the most frequent tokens of the CPython standard library's source (`sysconfig`'s stdlib path,
    *.py files), filling the rest: code identifiers, keywords, indentation runs;
  * every special and control token (end of turn, end of text), so a draft can propose a stop;
  * should the corpus hold fewer distinct tokens, the next ids in merge order.
The result is cached per tokenizer and size.
"""
from __future__ import annotations

import hashlib
import json
import sysconfig
from collections import Counter
from pathlib import Path

import torch

from specdec.config import specdec_home
from specdec.fileio import atomic_write_text

_CORPUS_BYTES = 8 << 20  # enough standard library for stable counts, seconds to tokenize
_VERSION = 2  # of the selection rule: part of the cache key


def _stdlib_counts(tokenizer) -> Counter:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("**/*.py"))
    texts, total = [], 0
    for f in files:
        if "test" in f.parts or "site-packages" in f.parts:
            continue
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(text)
        total += len(text)
        if total >= _CORPUS_BYTES:
            break
    counts: Counter = Counter()
    for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
        counts.update(enc.ids)
    return counts


def build_subvocab(tokenizer, vocab_size: int, size: int) -> torch.Tensor:
    """Sorted token ids (LongTensor, at most `size`) of the sub-vocabulary; see the module docstring.
    `tokenizer`: specdec's Tokenizer."""
    if size >= vocab_size:
        return torch.arange(vocab_size)
    inner = tokenizer._tok  # the `tokenizers` object: batch encoding and a stable serialization
    key = hashlib.sha256(json.dumps([_VERSION, vocab_size, size, inner.get_vocab_size()]).encode()
                         + inner.to_str().encode()).hexdigest()[:16]
    cache = specdec_home() / "subvocab" / f"{key}.json"
    if cache.exists():
        return torch.tensor(json.loads(cache.read_text()), dtype=torch.long)
    chosen = set(range(min(size // 2, vocab_size)))
    chosen.update(i for i in (*tokenizer._special, *tokenizer.eos_token_ids) if i < vocab_size)
    for tid, _ in _stdlib_counts(inner).most_common():
        if len(chosen) >= size:
            break
        if tid < vocab_size:
            chosen.add(tid)
    for tid in range(vocab_size):  # a corpus with fewer distinct tokens: the next ids in merge order
        if len(chosen) >= size:
            break
        chosen.add(tid)
    ids = sorted(chosen)[:size]
    atomic_write_text(cache, json.dumps(ids))
    return torch.tensor(ids, dtype=torch.long)
