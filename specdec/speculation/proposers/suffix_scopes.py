"""The engine's suffix cache as one store per cache scope (`SamplingParams.cache_scope`: requests
with the same `cache_salt`, or the same API key under `server.cache_scope: api_key`).

A request drafts only from its own scope's finished outputs, so one tenant's text never reaches
another's drafts (nor its timing). A scope is created when one of its requests first drafts by
suffix lookup (kinds suffix and hybrid): outputs of scopes that never do are not kept. Each scope
has the whole `suffix.cache_tokens` budget; at most `suffix.max_scopes` are kept, the least
recently used dropped first.

`state()` / `restore()` give the scopes as plain token lists, for `suffix_file` to save and load.
"""
from __future__ import annotations

from collections import OrderedDict

from specdec.metrics import CacheStats
from specdec.speculation.proposers.suffix_cache import DraftLimits, SuffixCache, SuffixDraft


class ScopedSuffixCache:
    name = "suffix"

    def __init__(self, max_tokens: int, max_scopes: int) -> None:
        self.max_tokens, self.max_scopes = max_tokens, max_scopes
        self.scopes: OrderedDict[str, SuffixCache] = OrderedDict()   # least recently used first
        self.num_scopes_evicted = 0
        self._evicted_outputs = 0     # outputs evicted from scopes since dropped (the counter only grows)

    def _use(self, scope: str) -> SuffixCache:
        cache = self.scopes.get(scope)
        if cache is None:
            cache = self.scopes[scope] = SuffixCache(self.max_tokens)
            while len(self.scopes) > self.max_scopes:
                _, dropped = self.scopes.popitem(last=False)
                self._evicted_outputs += dropped.num_evicted + len(dropped.outputs())
                self.num_scopes_evicted += 1
        self.scopes.move_to_end(scope)
        return cache

    def draft(self, context: list[int], max_tokens: int, limits: DraftLimits, scope: str = "") -> SuffixDraft:
        """The continuation of `context` in its scope's outputs (the scope now keeps outputs)."""
        return self._use(scope).draft(context, max_tokens, limits)

    def add(self, request_id: str, tokens: list[int], scope: str = "") -> None:
        """A finished request's output, kept if its scope drafts by suffix lookup."""
        if scope in self.scopes:
            self._use(scope).add(request_id, tokens)

    def clear(self) -> None:
        self.scopes.clear()

    def stats(self) -> CacheStats:
        parts = [c.stats() for c in self.scopes.values()]
        return CacheStats(self.name, sum(p.num_sequences for p in parts), sum(p.num_tokens for p in parts),
                          self.max_tokens, sum(p.num_index_entries for p in parts),
                          sum(p.approx_bytes for p in parts),
                          self._evicted_outputs + sum(p.num_evicted for p in parts), len(self.scopes))

    def state(self) -> dict[str, list[list[int]]]:
        """Each scope's outputs, oldest first (scopes least recently used first)."""
        return {scope: cache.outputs() for scope, cache in self.scopes.items()}

    def restore(self, state: dict[str, list[list[int]]]) -> None:
        """Replace the scopes with `state` (as `state()` gave it), within this cache's budgets."""
        self.clear()
        for scope, outputs in state.items():
            cache = self._use(scope)
            for i, tokens in enumerate(outputs):
                cache.add(f"\x00saved-{i}", tokens)   # ids no request has
