"""Which replicas hold which prompt prefix, as the router sent them: a bounded map from the chained
hash of each piece of a request's text to the replicas it went to. Pieces are chunks of
`chunk_chars`, cut also at each SEPARATOR (the end of a chat message), so a short first turn still
names its replica. A new turn of a conversation starts with the previous turn's messages, so its
deepest known piece names the replica whose prefix cache already holds that conversation. A hot
prefix (a shared system prompt) that the router spread to relieve its first replica has several
holders, and stays spread."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

SEPARATOR = "\x1e"


class PrefixIndex:
    def __init__(self, chunk_chars: int = 128, max_entries: int = 200_000) -> None:
        self.chunk_chars, self.max_entries = chunk_chars, max_entries
        # piece-chain hash -> replica ids it was sent to, first holder first; least recently sent piece first
        self.entries: OrderedDict[int, tuple[str, ...]] = OrderedDict()

    def _chain(self, text: str) -> list[tuple[int, int]]:
        """(chained hash, characters covered) after each piece."""
        chain, h, covered = [], 0, 0
        for segment in text.split(SEPARATOR):
            for start in range(0, len(segment), self.chunk_chars):
                piece = segment[start:start + self.chunk_chars]
                h, covered = hash((h, piece)), covered + len(piece)
                chain.append((h, covered))
        return chain

    def match(self, text: str, live: set[str]) -> tuple[list[str], int]:
        """The live replicas that were sent the longest prefix of `text` (empty if no piece matches),
        and how many characters matched."""
        best, depth = [], 0
        for h, covered in self._chain(text):
            holders = self.entries.get(h)
            if holders is None:
                break
            here = [r for r in holders if r in live]
            if here:
                best, depth = here, covered
        return best, depth

    def insert(self, text: str, replica: str) -> None:
        for h, _ in self._chain(text):
            holders = self.entries.get(h, ())
            self.entries[h] = holders if replica in holders else (*holders, replica)
            self.entries.move_to_end(h)
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)

    def keep_only(self, live: set[str]) -> None:
        """Forget every replica not in `live` (the replica set changed: one died or scaled away)."""
        self._drop(lambda r: r not in live)

    def forget(self, replica: str) -> None:
        self._drop(lambda r: r == replica)

    def _drop(self, gone: Callable[[str], bool]) -> None:
        for h, holders in list(self.entries.items()):
            kept = tuple(r for r in holders if not gone(r))
            if not kept:
                del self.entries[h]
            elif kept != holders:
                self.entries[h] = kept  # an existing key keeps its place in the order
