"""Suffix matching over token sequences, with frequency-scored continuations (SuffixDecoding,
Oliaro et al. 2024, arXiv 2411.04975), in the shape of a suffix tree of bounded depth without its
memory: each position is indexed by the short n-grams that end there (ANCHORS), and a lookup finds
the occurrences of the context's last n tokens, extends each match backwards up to `max_depth`
tokens and keeps the occurrences that share the longest match. From there the draft walks forward
as a walk down the tree would: at each step the most frequent next token among the occurrences still
agreeing, its probability the fraction that agrees, stopping when the running product falls below
`min_prob` or the draft reaches `factor * match length + offset` tokens (a short match predicts
little, a long one a lot).

`SuffixIndex` holds a request's own prompt and output; `SuffixCache` holds finished requests'
outputs for the requests of one cache scope, within a token budget (oldest sequences evicted first;
suffix_scopes.py keeps one per scope).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from specdec.metrics import CacheStats
from specdec.speculation.policy import expected_tokens

ANCHORS = (4, 2, 1)      # n-grams indexed per position, longest tried first
MAX_OCCURRENCES = 64     # most recent occurrences kept per n-gram: a lookup's work stays bounded
_SHIFT, _MASK = 32, (1 << 32) - 1


@dataclass
class SuffixDraft:
    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)   # each token's probability given the ones before
    match_length: int = 0

    @property
    def score(self) -> float:
        """Expected number of drafts accepted if the probabilities were right."""
        return expected_tokens(self.probs) - 1.0


@dataclass(frozen=True)
class DraftLimits:
    max_depth: int = 32          # longest context matched
    min_prob: float = 0.1        # stop drafting below this running probability
    factor: float = 1.0          # draft at most factor * match length + offset tokens
    offset: float = 0.0


class SuffixIndex:
    """Sequences of tokens (appended to, never edited) and the n-gram index over them. An index
    entry packs (sequence id, position after the n-gram) into one int, `seq << 32 | pos`: later
    sequences and positions compare greater, so the most recent occurrence is the largest."""

    def __init__(self) -> None:
        self.seqs: dict[int, list[int]] = {}
        self.index: dict[tuple[int, ...], list[int]] = {}   # n-gram -> entries, oldest first
        self.num_entries = 0                                 # kept up to date: /metrics reads it often

    def extend(self, seq_id: int, tokens: list[int]) -> None:
        seq = self.seqs.setdefault(seq_id, [])
        for t in tokens:
            seq.append(t)
            end = len(seq)
            for n in ANCHORS:
                if end >= n:
                    slots = self.index.setdefault(tuple(seq[end - n:]), [])
                    slots.append(seq_id << _SHIFT | end)
                    if len(slots) > MAX_OCCURRENCES:
                        del slots[0]
                    else:
                        self.num_entries += 1

    def remove(self, seq_id: int) -> int:
        """Drop a sequence and its index entries. Returns its length."""
        seq = self.seqs.pop(seq_id, [])
        for end in range(1, len(seq) + 1):
            for n in ANCHORS:
                if end >= n:
                    key = tuple(seq[end - n:end])
                    slots = self.index.get(key)
                    if slots is None:
                        continue
                    kept = [e for e in slots if e >> _SHIFT != seq_id]
                    self.num_entries -= len(slots) - len(kept)
                    if kept:
                        self.index[key] = kept
                    else:
                        del self.index[key]
        return len(seq)

    def draft(self, context: list[int], max_tokens: int, limits: DraftLimits) -> SuffixDraft:
        """The most likely continuation of `context` (see the module docstring)."""
        matches, length = self._longest_matches(context, limits.max_depth)
        budget = min(max_tokens, int(limits.factor * length + limits.offset))
        out = SuffixDraft(match_length=length)
        reach = 1.0
        for j in range(budget):
            nexts = []    # (next token, entry) of the occurrences still agreeing
            for e in matches:
                seq = self.seqs[e >> _SHIFT]
                pos = (e & _MASK) + j
                if pos < len(seq):
                    nexts.append((seq[pos], e))
            if not nexts:
                break
            counts = Counter(t for t, _ in nexts)
            # the most frequent; among equals the most recent occurrence's
            best = max(counts, key=lambda t: (counts[t], max(e for u, e in nexts if u == t)))
            prob = counts[best] / len(nexts)
            reach *= prob
            if reach < limits.min_prob:
                break
            out.token_ids.append(best)
            out.probs.append(prob)
            matches = [e for t, e in nexts if t == best]
        return out

    def _longest_matches(self, context: list[int], max_depth: int) -> tuple[list[int], int]:
        """The entries sharing the longest match of the context's end, and that length; occurrences
        with nothing after them are skipped."""
        for n in ANCHORS:
            if len(context) < n:
                continue
            slots = self.index.get(tuple(context[-n:]))
            if not slots:
                continue
            best, found = 0, []
            for e in slots:
                seq, end = self.seqs[e >> _SHIFT], e & _MASK
                if end >= len(seq):
                    continue   # the context itself, or a sequence's last tokens: nothing follows
                length = _match_length(seq, end, context, max_depth)
                if length > best:
                    best, found = length, [e]
                elif length == best:
                    found.append(e)
            if found:
                return found, best
        return [], 0


def _match_length(seq: list[int], end: int, context: list[int], max_depth: int) -> int:
    """How many tokens before seq[end] equal the context's last tokens (at most max_depth)."""
    n, limit = 0, min(max_depth, end, len(context))
    while n < limit and seq[end - 1 - n] == context[-1 - n]:
        n += 1
    return n


class SuffixCache:
    """Outputs of finished requests, shared by the requests of one cache scope, within `max_tokens`
    (oldest first out). It holds token ids only; another request's text reaches a request solely
    as draft tokens that the target then verifies."""

    name = "suffix"

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.index = SuffixIndex()
        self._ids: dict[str, int] = {}      # request id -> sequence id (insertion order = age)
        self._next = 0
        self.num_tokens = 0
        self.num_evicted = 0

    def add(self, request_id: str, tokens: list[int]) -> None:
        """Cache a request's output (replacing what was cached under its id: a preempted request's
        output comes back longer)."""
        if request_id in self._ids:
            self.num_tokens -= self.index.remove(self._ids.pop(request_id))
        tokens = tokens[-self.max_tokens:] if self.max_tokens else []
        if not tokens:
            return
        while self._ids and self.num_tokens + len(tokens) > self.max_tokens:
            oldest = next(iter(self._ids))
            self.num_tokens -= self.index.remove(self._ids.pop(oldest))
            self.num_evicted += 1
        self._ids[request_id] = self._next
        self.index.extend(self._next, tokens)
        self._next += 1
        self.num_tokens += len(tokens)

    def draft(self, context: list[int], max_tokens: int, limits: DraftLimits) -> SuffixDraft:
        return self.index.draft(context, max_tokens, limits) if self._ids else SuffixDraft()

    def clear(self) -> None:
        self.__init__(self.max_tokens)

    def outputs(self) -> list[list[int]]:
        """The cached outputs, oldest first."""
        return [self.index.seqs[i] for i in self._ids.values()]

    def stats(self) -> CacheStats:
        index = self.index
        # CPython sizes, roughly: a token id (an int above 256) and its list slot; per n-gram its key
        # tuple, entry list and dict slot; per entry an int and its list slot
        approx = self.num_tokens * 36 + len(index.index) * 190 + index.num_entries * 40
        return CacheStats(self.name, len(self._ids), self.num_tokens, self.max_tokens, index.num_entries, approx,
                          self.num_evicted)
