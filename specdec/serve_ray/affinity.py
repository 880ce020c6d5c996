"""Which replica holds which prompt prefix, as the router last sent them: a bounded map from the
chained hash of each piece of a request's text to the replica it went to. Pieces are chunks of
`chunk_chars`, cut also at each SEPARATOR (the end of a chat message), so a short first turn still
names its replica. A new turn of a conversation starts with the previous turn's messages, so its
deepest known piece names the replica whose prefix cache already holds that conversation."""
from __future__ import annotations

from collections import OrderedDict

SEPARATOR = "\x1e"


class PrefixIndex:
    def __init__(self, chunk_chars: int = 128, max_entries: int = 200_000) -> None:
        self.chunk_chars, self.max_entries = chunk_chars, max_entries
        self.entries: OrderedDict[int, str] = OrderedDict()   # piece-chain hash -> replica id (oldest first)

    def _chain(self, text: str) -> list[tuple[int, int]]:
        """(chained hash, characters covered) after each piece."""
        chain, h, covered = [], 0, 0
        for segment in text.split(SEPARATOR):
            for start in range(0, len(segment), self.chunk_chars):
                piece = segment[start:start + self.chunk_chars]
                h, covered = hash((h, piece)), covered + len(piece)
                chain.append((h, covered))
        return chain

    def match(self, text: str, live: set[str]) -> tuple[str | None, int]:
        """The live replica that was sent the longest prefix of `text` (None if no piece matches),
        and how many characters matched."""
        best, depth = None, 0
        for h, covered in self._chain(text):
            owner = self.entries.get(h)
            if owner is None:
                break
            if owner in live:
                best, depth = owner, covered
        return best, depth

    def insert(self, text: str, replica: str) -> None:
        for h, _ in self._chain(text):
            self.entries[h] = replica
            self.entries.move_to_end(h)
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)

    def forget(self, replica: str) -> None:
        for h in [h for h, r in self.entries.items() if r == replica]:
            del self.entries[h]
