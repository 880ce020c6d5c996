"""Unit tests for BlockPool: reference counts, the LRU free queue and the prefix-hash index."""
from __future__ import annotations

import pytest

from specdec.core.block_pool import BlockPool, hash_block


def test_rejects_empty_pool():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocate_and_free_counts():
    pool = BlockPool(6)
    assert pool.num_free_blocks() == 6
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert len(a) == 2 and len(b) == 3
    assert len(set(a) | set(b)) == 5, "a block was handed out twice"
    assert pool.num_free_blocks() == 1
    assert all(pool.ref_cnt[x] == 1 for x in a + b)
    pool.check_invariants()

    pool.free(a[::-1])
    assert pool.num_free_blocks() == 3
    assert all(pool.ref_cnt[x] == 0 for x in a)
    pool.free(b[::-1])
    assert pool.num_free_blocks() == 6
    assert pool.ref_cnt == [0] * 6
    pool.check_invariants()


def test_allocate_zero_is_noop():
    pool = BlockPool(3)
    assert pool.allocate(0) == []
    assert pool.num_free_blocks() == 3


def test_fresh_pool_hands_out_blocks_in_order():
    pool = BlockPool(4)
    assert pool.allocate(4) == [0, 1, 2, 3]


def test_free_order_tail_first_means_tail_evicted_first():
    pool = BlockPool(4)
    table = pool.allocate(4)  # [0, 1, 2, 3]
    pool.free(table[::-1])    # tail first: the queue is now 3, 2, 1, 0
    # the least recently freed block comes out first, i.e. the table's tail
    assert pool.allocate(1) == [table[3]]
    assert pool.allocate(1) == [table[2]]
    assert pool.allocate(2) == [table[1], table[0]]


def test_freed_blocks_go_behind_older_free_blocks():
    pool = BlockPool(4)
    a = pool.allocate(2)      # [0, 1]; free queue: 2, 3
    pool.free(a[::-1])        # queue: 2, 3, 1, 0
    assert pool.allocate(4) == [2, 3, a[1], a[0]]


def test_shared_block_is_free_only_after_last_reference():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.touch([b])
    assert pool.ref_cnt[b] == 2
    pool.free([b])
    assert pool.ref_cnt[b] == 1
    assert pool.num_free_blocks() == 2
    pool.check_invariants()
    pool.free([b])
    assert pool.ref_cnt[b] == 0
    assert pool.num_free_blocks() == 3
    pool.check_invariants()


def test_freed_hashed_block_found_until_reallocated():
    pool = BlockPool(3)
    b0, b1 = pool.allocate(2)
    h0 = hash_block(None, [1, 2])
    h1 = hash_block(h0, [3, 4])
    pool.cache_block(b0, h0)
    pool.cache_block(b1, h1)
    assert pool.lookup(h0) == b0 and pool.lookup(h1) == b1

    pool.free([b1, b0])       # queue: 2, b1, b0
    assert pool.lookup(h0) == b0, "a freed block keeps its hash until reused"
    assert pool.lookup(h1) == b1
    assert pool.block_hash[b1] == h1

    assert pool.allocate(1) == [2]           # the never-hashed block goes first
    assert pool.lookup(h1) == b1 and pool.lookup(h0) == b0
    assert pool.allocate(1) == [b1]          # now b1 is reused: its hash is evicted
    assert pool.lookup(h1) is None
    assert pool.block_hash[b1] is None
    assert pool.lookup(h0) == b0
    pool.check_invariants()


def test_touch_of_free_cached_block_removes_it_from_free_queue():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    h = hash_block(None, [7, 7])
    pool.cache_block(b, h)
    pool.free([b])
    assert pool.num_free_blocks() == 3

    assert pool.lookup(h) == b
    pool.touch([b])           # prefix-cache hit revives it
    assert pool.ref_cnt[b] == 1
    assert pool.num_free_blocks() == 2
    pool.check_invariants()
    others = pool.allocate(2)
    assert b not in others, "a touched block must not be handed out again"
    assert pool.lookup(h) == b and pool.block_hash[b] == h
    with pytest.raises(RuntimeError):
        pool.allocate(1)


def test_touch_of_used_block_only_adds_reference():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.touch([b])
    assert pool.ref_cnt[b] == 2
    assert pool.num_free_blocks() == 1
    pool.check_invariants()


def test_double_free_asserts():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(AssertionError, match="double free"):
        pool.free([b])


def test_free_of_never_allocated_block_asserts():
    pool = BlockPool(2)
    with pytest.raises(AssertionError):
        pool.free([1])


def test_out_of_blocks_raises_and_changes_nothing():
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        pool.allocate(2)
    assert pool.num_free_blocks() == 1, "a failed allocate must not take any block"
    pool.check_invariants()
    assert len(pool.allocate(1)) == 1
    with pytest.raises(RuntimeError):
        pool.allocate(1)


def test_hashing_a_block_twice_asserts():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.cache_block(b, hash_block(None, [1]))
    with pytest.raises(AssertionError):
        pool.cache_block(b, hash_block(None, [2]))


def test_duplicate_hash_keeps_first_block_and_survives_its_eviction():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    h = hash_block(None, [5, 6])
    pool.cache_block(a, h)
    pool.cache_block(b, h)    # same content computed twice: the index keeps the first
    assert pool.lookup(h) == a
    pool.free([b])
    pool.free([a])            # queue: b, a
    assert pool.allocate(1) == [b]   # evicting b must not drop a's entry
    assert pool.lookup(h) == a
    pool.check_invariants()


def test_caching_disabled_never_indexes():
    pool = BlockPool(2, enable_caching=False)
    (b,) = pool.allocate(1)
    h = hash_block(None, [1, 2])
    pool.cache_block(b, h)
    assert pool.block_hash[b] is None
    assert pool.lookup(h) is None


def test_hash_is_chained():
    h_a = hash_block(None, [1, 2])
    assert hash_block(None, [1, 2]) == h_a
    assert hash_block(None, [2, 1]) != h_a
    # same block tokens under a different prefix name a different prefix
    assert hash_block(h_a, [3, 4]) != hash_block(hash_block(None, [9, 9]), [3, 4])
    assert hash_block(h_a, [3, 4]) != hash_block(None, [3, 4])
