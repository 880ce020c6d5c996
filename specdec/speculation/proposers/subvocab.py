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
The result is cached per tokenizer and size. `RequestVocab` widens it for each request by the
tokens of the request's own prompt and output.
"""
from __future__ import annotations

import hashlib
import json
import math
import sysconfig
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specdec.config import specdec_home
from specdec.fileio import atomic_write_text
from specdec.models.llama import LlamaModel
from specdec.quant.layers import KernelOptions, linear
from specdec.quant.packed import QuantLinear

_CORPUS_BYTES = 8 << 20  # enough standard library for stable counts, seconds to tokenize
AUTO_SIZE = 32768        # the sub-vocabulary `draft.vocab_size: auto` scores ...
AUTO_MIN_CUT = 0.1       # ... where that cuts at least this share of a draft step's multiply-adds
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


def auto_vocab_size(model: LlamaModel, vocab_size: int) -> int | None:
    """`draft.vocab_size: auto`: AUTO_SIZE where scoring it instead of all `vocab_size` tokens cuts at
    least AUTO_MIN_CUT of a draft step's multiply-adds (the 0.5B Qwen draft: a fifth), None (all) elsewhere."""
    if vocab_size <= AUTO_SIZE:
        return None
    kept = [n for n in range(model.cfg.num_layers) if n not in model.skip_layers]
    layers = sum(math.prod(w.shape) for name, w in model.w.items()
                 if name.startswith("layers.") and int(name.split(".")[1]) in kept and len(w.shape) == 2)
    hidden = model.cfg.hidden_size
    cut = (vocab_size - AUTO_SIZE) * hidden
    return AUTO_SIZE if cut >= AUTO_MIN_CUT * (layers + vocab_size * hidden) else None


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


class RequestVocab:
    """A sub-vocabulary output layer widened, for each request, by the tokens of its own text.

    The frequent tokens miss what a request is about (its identifiers, its language's words), and a
    request's output repeats its prompt's tokens: each request also scores the full layer's rows of
    its prompt's and output's tokens outside the sub-vocabulary, in a small layer of its own that
    grows with the output. A request whose output keeps falling outside (text in a script the
    frequent tokens barely hold) scores the whole vocabulary from then on. Only acceptance depends
    on any of it: every draft distribution stays exact."""

    MIN_OUTPUT = 8      # output tokens seen before judging the sub-vocabulary
    MAX_MISSED = 0.2    # above this share of them outside what was scored: the whole vocabulary

    def __init__(self, full_head: QuantLinear | torch.Tensor, ids: torch.Tensor, vocab_size: int,
                 never: torch.Tensor, row_align: int = 1, options: KernelOptions = KernelOptions()) -> None:
        """`full_head`: the whole output layer (QuantLinear or [vocab, hidden] tensor); `ids`: the
        sub-vocabulary; `vocab_size`: the ids a token may have; `never`: ids never to score;
        `row_align`, `options`: the model's, for its products."""
        self.full, self.never, self.row_align, self.options = full_head, never, row_align, options
        # the sub-vocabulary, or never to be scored (numpy: a propose takes each request's new tokens in,
        # and small torch operations there cost several times their numpy twins)
        self.scored = np.zeros(vocab_size, dtype=bool)
        self.scored[ids[ids < vocab_size].cpu().numpy()] = True
        self.scored[never[never < vocab_size].cpu().numpy()] = True
        self._requests: dict[str, _Widened] = {}

    def take_in(self, request_id: str, prompt: list[int], output: list[int]) -> None:
        """Add the request's tokens not taken in before: its prompt the first time, then its output."""
        w = self._requests.get(request_id)
        if w is None:
            w = self._requests[request_id] = _Widened(np.zeros_like(self.scored))
            self._add(w, np.asarray(prompt, dtype=np.int64))
        if len(output) <= w.output_seen or w.whole:
            return
        new = np.asarray(output[w.output_seen:], dtype=np.int64)
        new = new[new < len(self.scored)]
        w.missed += int((~(self.scored[new] | w.own[new])).sum())
        w.output_seen = len(output)
        if w.output_seen >= self.MIN_OUTPUT and w.missed > self.MAX_MISSED * w.output_seen:
            w.whole, w.ids, w.head = True, None, self.full
            return
        self._add(w, new)

    def _add(self, w: _Widened, tokens: np.ndarray) -> None:
        tokens = np.unique(tokens[tokens < len(self.scored)])
        new = tokens[~(self.scored[tokens] | w.own[tokens])]
        if not len(new):
            return
        w.own[new] = True
        w.ids = torch.from_numpy(np.flatnonzero(w.own))
        w.head = self.full[w.ids].contiguous() if isinstance(self.full, torch.Tensor) else self.full.select_rows(w.ids)

    @torch.inference_mode()  # `logits` is the runner's
    def score(self, request_id: str, logits: torch.Tensor, hidden: torch.Tensor) -> None:
        """Write the request's own tokens' logits into `logits` ([vocab], in place) from its final
        hidden state (`hidden`: [hidden_size])."""
        own = self.own_scores(request_id, hidden)
        if own is None:
            return
        ids, scored = own
        if ids is None:
            logits[: len(scored)] = scored
        else:
            logits[ids] = scored

    @torch.inference_mode()
    def own_scores(self, request_id: str, hidden: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """(ids, logits) of the request's own tokens from its final hidden state ([hidden_size]): ids None
        when it scores the whole vocabulary (then logits are every id's, never-sample ids at -inf); None
        when it has no tokens of its own."""
        w = self._requests.get(request_id)
        if w is None or w.head is None:
            return None
        rows = hidden.expand(self.row_align, -1).contiguous()
        scored = linear(rows, w.head, options=self.options)[0].float()
        if w.whole:
            return None, scored.index_fill_(0, self.never[self.never < len(scored)], float("-inf"))
        return w.ids, scored

    def own_head(self, request_id: str) -> tuple[QuantLinear | torch.Tensor | None, torch.Tensor | None]:
        """(the output layer's rows of the request's own tokens, their ids); (None, None) without any.
        Not for a request that scores the whole vocabulary (`whole`)."""
        w = self._requests.get(request_id)
        return (None, None) if w is None or w.head is None else (w.head, w.ids)

    def whole(self, request_id: str) -> bool:
        """Whether the request now scores the whole vocabulary."""
        w = self._requests.get(request_id)
        return w is not None and w.whole

    def free(self, request_id: str) -> None:
        self._requests.pop(request_id, None)


@dataclass
class _Widened:
    """One request's own tokens outside the sub-vocabulary, and what it has seen of its output."""
    own: np.ndarray                         # [vocab] bool
    ids: torch.Tensor | None = None         # own's ids, sorted
    head: QuantLinear | torch.Tensor | None = None  # their rows of the output layer (whole: all of it)
    output_seen: int = 0
    missed: int = 0                         # output tokens that were outside what was scored
    whole: bool = False
