"""BlockPool: the physical KV blocks of one cache, their reference counts and prefix hashes.

Free blocks wait in an LRU queue; a freed block keeps its hash (and its K/V) until it is reused, so a
later request with the same prefix can take it back. Blocks are plain ints: the runner owns the
memory, this module only does the bookkeeping.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from array import array


def hash_block(parent_hash: bytes | None, token_ids: list[int]) -> bytes:
    """Chained hash of one full block: it names the whole prefix, not just the block's tokens."""
    h = hashlib.sha256(parent_hash or b"root")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}

    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take n blocks from the head of the free queue (least recently freed), evicting their hashes."""
        if n > len(self._free):
            raise RuntimeError(f"out of KV blocks: want {n}, have {len(self._free)}")
        blocks = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self.ref_cnt[block_id] = 1
            blocks.append(block_id)
        return blocks

    def touch(self, block_ids: list[int]) -> None:
        """Take another reference (prefix-cache hit or fork)."""
        for b in block_ids:
            if self.ref_cnt[b] == 0:
                del self._free[b]
            self.ref_cnt[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference each. Pass blocks tail first: the free queue then evicts tails first."""
        for b in block_ids:
            assert self.ref_cnt[b] > 0, f"double free of block {b}"
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self._free[b] = None

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        if not self.enable_caching:
            return
        assert self.block_hash[block_id] is None, "block hashed twice"
        self.block_hash[block_id] = block_hash
        self._cached.setdefault(block_hash, block_id)

    def lookup(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def _evict(self, block_id: int) -> None:
        h = self.block_hash[block_id]
        if h is not None:
            if self._cached.get(h) == block_id:
                del self._cached[h]
            self.block_hash[block_id] = None

    def check_invariants(self) -> None:
        """Used by tests: free queue == blocks with zero references; cache entries point to hashed blocks."""
        free = {b for b in range(self.num_blocks) if self.ref_cnt[b] == 0}
        assert free == set(self._free), "free queue disagrees with reference counts"
        assert all(c >= 0 for c in self.ref_cnt)
        for h, b in self._cached.items():
            assert self.block_hash[b] == h
