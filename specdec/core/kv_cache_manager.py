"""KVCacheManager: per-request block tables over one BlockPool.

Paired verbs: `can_allocate` / `allocate` (append slots), `rollback` (drop the last n slots, e.g.
rejected draft tokens), `can_fork` / `fork` (share blocks, copy-on-write on the next write), `free`. `commit`
hashes blocks whose tokens are all committed; a hashed block is never rolled back or written again,
so it can be shared through the prefix cache.

Prefix hashes are chained from a scope's root (a request's `cache_scope`: "" or a salt's digest), so
blocks are found only by requests of the same scope.
"""
from __future__ import annotations

from specdec.core.block_pool import BlockPool, hash_block


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def scope_root(scope: str) -> bytes | None:
    """The parent hash of a scope's first block (None: the default scope's)."""
    return bytes.fromhex(scope) if scope else None


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.block_tables: dict[str, list[int]] = {}
        self.num_slots: dict[str, int] = {}          # tokens with a slot (computed or about to be)
        self.block_hashes: dict[str, list[bytes]] = {}  # hashes of the leading committed full blocks
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) for the runner

    # ---- prefix cache -------------------------------------------------------------------------
    def find_cached_prefix(self, token_ids: list[int], scope: str = "") -> list[int]:
        """Blocks of this scope already holding a prefix of token_ids. The last token is always left
        to compute, so the forward that follows has a position to return logits for."""
        blocks: list[int] = []
        parent = scope_root(scope)
        bs = self.block_size
        for i in range((len(token_ids) - 1) // bs):
            parent = hash_block(parent, token_ids[i * bs:(i + 1) * bs])
            b = self.pool.lookup(parent)
            if b is None:
                break
            blocks.append(b)
        return blocks

    # ---- allocation ---------------------------------------------------------------------------
    def num_blocks_needed(self, request_id: str, num_new_tokens: int, num_cached_blocks: int = 0) -> int:
        table = self.block_tables.get(request_id, [])
        slots = self.num_slots.get(request_id, num_cached_blocks * self.block_size)
        have = len(table) if table else num_cached_blocks
        need = cdiv(slots + num_new_tokens, self.block_size) - have
        if num_new_tokens and table and slots % self.block_size and self._must_copy(table[-1]):
            need += 1  # copy-on-write of a shared (or hashed) partial last block
        return max(need, 0)

    def _must_copy(self, block_id: int) -> bool:
        """A write into this block must go to a copy: others read it, or it is hashed (immutable; a
        forked request may roll back into a block its parent committed and then freed)."""
        return self.pool.ref_cnt[block_id] > 1 or self.pool.block_hash[block_id] is not None

    def can_allocate(self, request_id: str, num_new_tokens: int, cached_blocks: list[int] | None = None) -> bool:
        cached = cached_blocks or []
        # cached blocks sitting in the free queue stop being free once we take them
        reclaimed = sum(1 for b in cached if self.pool.ref_cnt[b] == 0)
        need = self.num_blocks_needed(request_id, num_new_tokens, len(cached))
        return need + reclaimed <= self.pool.num_free_blocks()

    def allocate(self, request_id: str, num_new_tokens: int, cached_blocks: list[int] | None = None) -> None:
        """Give the request slots for num_new_tokens more tokens (after any cached prefix blocks)."""
        new = request_id not in self.block_tables
        if not new:
            assert not cached_blocks, "cached prefix blocks only apply to a new block table"
        if not self.can_allocate(request_id, num_new_tokens, cached_blocks if new else None):
            raise RuntimeError(f"out of KV blocks for request {request_id}")
        if new:
            cached = cached_blocks or []
            self.pool.touch(cached)
            self.block_tables[request_id] = list(cached)
            self.num_slots[request_id] = len(cached) * self.block_size
            self.block_hashes[request_id] = [self.pool.block_hash[b] for b in cached]  # type: ignore[misc]
        table = self.block_tables[request_id]
        slots = self.num_slots[request_id]
        copied_from = None
        if num_new_tokens and slots % self.block_size and self._must_copy(table[-1]):
            (fresh,) = self.pool.allocate(1)
            self.pending_copies.append((table[-1], fresh))
            copied_from, table[-1] = table[-1], fresh
        extra = cdiv(slots + num_new_tokens, self.block_size) - len(table)
        if extra > 0:
            table.extend(self.pool.allocate(extra))
        if copied_from is not None:
            # released last, so this call cannot hand the copy's source back out before the copy runs
            self.pool.free([copied_from])
        self.num_slots[request_id] = slots + num_new_tokens

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Drop the last num_tokens slots (rejected tokens), freeing blocks that become empty."""
        if num_tokens == 0:
            return
        slots = self.num_slots[request_id] - num_tokens
        assert slots >= len(self.block_hashes[request_id]) * self.block_size, "rollback into a hashed block"
        table = self.block_tables[request_id]
        keep = cdiv(slots, self.block_size)
        self.pool.free(table[keep:][::-1])
        del table[keep:]
        self.num_slots[request_id] = slots

    def commit(self, request_id: str, token_ids: list[int], scope: str = "") -> None:
        """token_ids are the request's committed tokens (all with K/V computed): hash newly full blocks
        (the first from the root of the request's cache scope)."""
        hashes = self.block_hashes[request_id]
        table = self.block_tables[request_id]
        bs = self.block_size
        num_full = min(len(token_ids), self.num_slots[request_id]) // bs
        for i in range(len(hashes), num_full):
            h = hash_block(hashes[-1] if hashes else scope_root(scope), token_ids[i * bs:(i + 1) * bs])
            hashes.append(h)
            if self.pool.block_hash[table[i]] is None:
                self.pool.cache_block(table[i], h)

    def fork(self, parent_id: str, child_id: str, num_tokens: int | None = None) -> None:
        """The child shares the parent's blocks holding its first num_tokens slots (default: all);
        its first write copies the shared partial block (parallel sampling: n choices, one prompt)."""
        assert child_id not in self.block_tables
        n = self.num_slots[parent_id] if num_tokens is None else num_tokens
        assert n <= self.num_slots[parent_id]
        table = self.block_tables[parent_id][: cdiv(n, self.block_size)]
        self.pool.touch(table)
        self.block_tables[child_id] = list(table)
        self.num_slots[child_id] = n
        self.block_hashes[child_id] = self.block_hashes[parent_id][: n // self.block_size]

    def can_fork(self, parent_id: str, num_tokens: int, num_new_tokens: int) -> bool:
        """Room for a fork of the parent's first num_tokens slots, then num_new_tokens more."""
        bs = self.block_size
        copy = 1 if num_tokens % bs else 0   # the shared partial block is copied on the first write
        need = cdiv(num_tokens + num_new_tokens, bs) - cdiv(num_tokens, bs) + copy
        return need <= self.pool.num_free_blocks()

    def free(self, request_id: str) -> None:
        table = self.block_tables.pop(request_id, None)
        if table is not None:
            self.pool.free(table[::-1])
            del self.num_slots[request_id]
            del self.block_hashes[request_id]

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks
