"""KVCacheManager: unit tests, and a stateful Hypothesis model that simulates the runner's KV memory.

The state machine keeps its own copy of what each physical slot holds (writes of new tokens, the
copy-on-write copies the manager asks for) and checks after every step that every request still
reads its own tokens and every prefix-cache entry still holds the tokens its hash names.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from specdec.core.block_pool import hash_block
from specdec.core.kv_cache_manager import KVCacheManager, cdiv


def snapshot(m: KVCacheManager):
    return ({k: list(v) for k, v in m.block_tables.items()}, dict(m.num_slots),
            {k: list(v) for k, v in m.block_hashes.items()}, list(m.pool.ref_cnt),
            m.num_free_blocks(), list(m.pending_copies))


# ---- allocation and rollback -------------------------------------------------------------------

def test_cdiv():
    assert [cdiv(a, 4) for a in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]


def test_allocate_across_block_boundaries():
    m = KVCacheManager(num_blocks=8, block_size=4)
    m.allocate("r", 3)
    assert len(m.block_tables["r"]) == 1 and m.num_slots["r"] == 3
    m.allocate("r", 1)  # fills the block exactly
    assert len(m.block_tables["r"]) == 1 and m.num_slots["r"] == 4
    m.allocate("r", 1)  # first token of the next block
    assert len(m.block_tables["r"]) == 2 and m.num_slots["r"] == 5
    m.allocate("r", 9)  # 14 slots: 4 blocks
    table = m.block_tables["r"]
    assert len(table) == 4 and m.num_slots["r"] == 14
    assert len(set(table)) == 4
    assert m.num_free_blocks() == 4
    assert all(m.pool.ref_cnt[b] == 1 for b in table)
    m.pool.check_invariants()


def test_allocate_zero_tokens_takes_nothing():
    m = KVCacheManager(num_blocks=2, block_size=4)
    m.allocate("r", 0)
    assert m.block_tables["r"] == [] and m.num_slots["r"] == 0
    assert m.num_free_blocks() == 2


def test_rollback_frees_emptied_blocks_and_keeps_partial_ones():
    m = KVCacheManager(num_blocks=8, block_size=4)
    m.allocate("r", 10)  # 3 blocks: 4 + 4 + 2
    t0 = list(m.block_tables["r"])
    assert m.num_free_blocks() == 5
    m.rollback("r", 2)   # 8 slots: the third block is empty -> freed
    assert m.block_tables["r"] == t0[:2]
    assert m.num_slots["r"] == 8
    assert m.num_free_blocks() == 6 and m.pool.ref_cnt[t0[2]] == 0
    m.rollback("r", 1)   # 7 slots: the second block is partial -> kept
    assert m.block_tables["r"] == t0[:2]
    assert m.num_slots["r"] == 7
    assert m.num_free_blocks() == 6
    m.rollback("r", 0)
    assert m.num_slots["r"] == 7 and m.block_tables["r"] == t0[:2]
    m.rollback("r", 7)   # everything
    assert m.block_tables["r"] == [] and m.num_slots["r"] == 0
    assert m.num_free_blocks() == 8
    m.pool.check_invariants()


def test_rollback_frees_tail_first():
    m = KVCacheManager(num_blocks=4, block_size=2)
    m.allocate("r", 8)
    t = list(m.block_tables["r"])
    m.rollback("r", 6)                  # frees t[1], t[2], t[3]
    assert m.pool.allocate(1) == [t[3]], "the table's tail should be the first to be reused"


def test_rollback_never_enters_a_hashed_block():
    m = KVCacheManager(num_blocks=8, block_size=4)
    m.allocate("r", 10)
    m.commit("r", list(range(10)))      # 2 full committed blocks hashed
    assert len(m.block_hashes["r"]) == 2
    m.rollback("r", 2)                  # drops only the partial third block: fine
    assert m.num_slots["r"] == 8
    before = snapshot(m)
    with pytest.raises(AssertionError, match="hashed"):
        m.rollback("r", 1)              # would reopen the second (hashed) block
    assert snapshot(m) == before, "a refused rollback must not change anything"


def test_rollback_never_enters_a_hashed_block_even_with_caching_off():
    m = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    m.allocate("r", 4)
    m.commit("r", [1, 2, 3, 4])
    with pytest.raises(AssertionError):
        m.rollback("r", 1)


# ---- commit ------------------------------------------------------------------------------------

def test_commit_hashes_only_full_committed_blocks():
    m = KVCacheManager(num_blocks=8, block_size=4)
    m.allocate("r", 10)
    t = m.block_tables["r"]
    toks = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]

    m.commit("r", toks[:3])             # no full block committed yet
    assert m.block_hashes["r"] == []
    assert all(m.pool.block_hash[b] is None for b in t)

    m.commit("r", toks[:6])             # one full block committed, the second only half
    h0 = hash_block(None, toks[:4])
    assert m.block_hashes["r"] == [h0]
    assert m.pool.block_hash[t[0]] == h0
    assert m.pool.block_hash[t[1]] is None and m.pool.block_hash[t[2]] is None

    m.commit("r", toks)                 # 10 committed: 2 full blocks, the third is partial
    h1 = hash_block(h0, toks[4:8])
    assert m.block_hashes["r"] == [h0, h1]
    assert m.pool.block_hash[t[1]] == h1
    assert m.pool.block_hash[t[2]] is None
    assert m.pool.lookup(h1) == t[1]

    m.commit("r", toks)                 # idempotent
    assert m.block_hashes["r"] == [h0, h1]


def test_commit_never_hashes_past_the_allocated_slots():
    m = KVCacheManager(num_blocks=8, block_size=4)
    m.allocate("r", 6)
    m.commit("r", list(range(12)))      # more tokens than slots: only slots count
    assert len(m.block_hashes["r"]) == 1
    m.pool.check_invariants()


def test_commit_with_caching_off_tracks_hashes_but_indexes_nothing():
    m = KVCacheManager(num_blocks=4, block_size=2, enable_caching=False)
    m.allocate("r", 4)
    m.commit("r", [1, 2, 3, 4])
    assert len(m.block_hashes["r"]) == 2
    assert all(h is None for h in m.pool.block_hash)
    m.free("r")
    assert m.find_cached_prefix([1, 2, 3, 4, 5]) == []


# ---- prefix cache ------------------------------------------------------------------------------

def _run_prompt(m: KVCacheManager, rid: str, prompt: list[int]) -> list[int]:
    cached = m.find_cached_prefix(prompt)
    m.allocate(rid, len(prompt) - len(cached) * m.block_size, cached)
    m.commit(rid, prompt)
    return cached


def test_find_cached_prefix_returns_hits_in_order():
    m = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(13))
    assert _run_prompt(m, "a", prompt) == []
    t = m.block_tables["a"]
    assert m.find_cached_prefix(prompt + [99]) == t[:3]
    assert m.find_cached_prefix(prompt[:9]) == t[:2]
    # a different second block ends the hit there, even if the third block's tokens match
    other = prompt[:4] + [77, 5, 6, 7] + prompt[8:]
    assert m.find_cached_prefix(other) == t[:1]
    assert m.find_cached_prefix([42] + prompt[1:]) == []
    assert m.find_cached_prefix([]) == []


def test_find_cached_prefix_always_leaves_the_last_token():
    bs = 4
    m = KVCacheManager(num_blocks=8, block_size=bs)
    prompt = list(range(8))             # exactly two blocks
    _run_prompt(m, "a", prompt)
    assert len(m.block_hashes["a"]) == 2, "both blocks are committed and cached"
    hits = m.find_cached_prefix(prompt)
    assert len(hits) * bs <= len(prompt) - 1
    assert hits == m.block_tables["a"][:1]
    # a one-block prompt that is fully cached gets no hit at all
    assert m.find_cached_prefix(prompt[:4]) == []
    # the request that follows still has at least one token to compute
    m.allocate("b", len(prompt) - len(hits) * bs, hits)
    assert m.num_slots["b"] == 8 and len(m.block_tables["b"]) == 2


def test_prefix_hit_then_allocate_shares_blocks():
    m = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(10))
    _run_prompt(m, "a", prompt)
    ta = list(m.block_tables["a"])
    free_before = m.num_free_blocks()

    cached = _run_prompt(m, "b", prompt[:8] + [50, 51, 52])
    tb = m.block_tables["b"]
    assert cached == ta[:2]
    assert tb[:2] == ta[:2]
    assert m.pool.ref_cnt[ta[0]] == 2 and m.pool.ref_cnt[ta[1]] == 2
    assert m.pool.ref_cnt[ta[2]] == 1 and m.pool.ref_cnt[tb[2]] == 1
    assert tb[2] != ta[2]
    assert m.num_free_blocks() == free_before - 1, "only the unshared tail took a new block"
    assert m.block_hashes["b"] == m.block_hashes["a"]
    assert m.pending_copies == []

    m.free("a")
    assert m.pool.ref_cnt[ta[0]] == 1 and m.pool.ref_cnt[ta[1]] == 1
    m.free("b")
    assert m.num_free_blocks() == 8
    assert all(c == 0 for c in m.pool.ref_cnt)
    m.pool.check_invariants()


def test_prefix_hit_on_freed_blocks_revives_them():
    m = KVCacheManager(num_blocks=4, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    _run_prompt(m, "a", prompt)
    ta = list(m.block_tables["a"])
    m.free("a")
    assert m.num_free_blocks() == 4
    cached = _run_prompt(m, "b", prompt)
    assert cached == ta[:2]
    assert m.block_tables["b"][:2] == ta[:2]
    assert m.num_free_blocks() == 1
    m.pool.check_invariants()


# ---- fork / copy-on-write ----------------------------------------------------------------------

def test_fork_shares_blocks_and_copies_on_first_write_to_partial_block():
    m = KVCacheManager(num_blocks=8, block_size=4)
    m.allocate("p", 6)                  # one full block + a partial one
    tp = list(m.block_tables["p"])
    free_before = m.num_free_blocks()
    m.fork("p", "c")
    assert m.block_tables["c"] == tp
    assert m.block_tables["c"] is not m.block_tables["p"]
    assert all(m.pool.ref_cnt[b] == 2 for b in tp)
    assert m.num_free_blocks() == free_before, "fork takes no new block"
    assert m.num_slots["c"] == 6

    m.allocate("c", 1)                  # writes into the shared partial block
    tc = m.block_tables["c"]
    copies = m.take_pending_copies()
    assert len(copies) == 1
    assert copies == [(tp[1], tc[1])]
    assert tc[0] == tp[0] and tc[1] != tp[1]
    assert m.block_tables["p"] == tp, "the parent's table must be left intact"
    assert m.pool.ref_cnt[tp[0]] == 2 and m.pool.ref_cnt[tp[1]] == 1 and m.pool.ref_cnt[tc[1]] == 1
    assert m.num_free_blocks() == free_before - 1

    m.allocate("c", 1)                  # the child's block is its own now
    m.allocate("p", 1)                  # and so is the parent's
    assert m.take_pending_copies() == []
    assert m.block_tables["p"] == tp and len(m.block_tables["c"]) == 2
    m.free("p")
    m.free("c")
    assert m.num_free_blocks() == 8
    m.pool.check_invariants()


def test_fork_with_full_last_block_needs_no_copy():
    m = KVCacheManager(num_blocks=8, block_size=4)
    m.allocate("p", 8)
    tp = list(m.block_tables["p"])
    m.fork("p", "c")
    m.allocate("c", 1)
    assert m.take_pending_copies() == []
    assert m.block_tables["c"][:2] == tp and len(m.block_tables["c"]) == 3
    assert m.block_tables["p"] == tp


def test_fork_child_rolling_back_into_shared_block_copies_on_write():
    m = KVCacheManager(num_blocks=8, block_size=4)
    m.allocate("p", 8)
    tp = list(m.block_tables["p"])
    m.fork("p", "c")
    m.rollback("c", 2)                  # the child's view of tp[1] is partial now
    assert m.block_tables["c"] == tp and m.pool.ref_cnt[tp[1]] == 2
    m.allocate("c", 1)
    assert m.take_pending_copies() == [(tp[1], m.block_tables["c"][1])]
    assert m.block_tables["p"] == tp


def test_child_never_writes_into_block_its_freed_parent_committed():
    """Regression: the parent commits (hashes) a block it shares with a forked child, then finishes.
    The child, which had not committed those tokens, rolls them back and writes new ones: that
    write must go to a copy, or the prefix cache would serve the child's tokens as the parent's."""
    m = KVCacheManager(num_blocks=8, block_size=2)
    m.allocate("p", 2)                  # two draft tokens
    m.fork("p", "c")
    m.commit("p", [1, 2])               # the parent accepts them: its block is hashed
    (x,) = m.block_tables["p"]
    m.free("p")
    assert m.pool.ref_cnt[x] == 1
    m.rollback("c", 1)                  # the child rejects its second token ...
    m.allocate("c", 1)                  # ... and writes another one there
    (y,) = m.block_tables["c"]
    assert y != x, "a hashed block was written in place"
    assert m.take_pending_copies() == [(x, y)]
    assert m.pool.ref_cnt[x] == 0 and m.pool.lookup(hash_block(None, [1, 2])) == x
    assert m.find_cached_prefix([1, 2, 9]) == [x]
    m.pool.check_invariants()


# ---- can_allocate ------------------------------------------------------------------------------

def test_can_allocate_matches_allocate_when_full():
    m = KVCacheManager(num_blocks=3, block_size=4)
    m.allocate("a", 10)
    assert m.can_allocate("a", 2)
    assert not m.can_allocate("a", 3)
    assert m.can_allocate("b", 0)
    assert not m.can_allocate("b", 1)
    before = snapshot(m)
    with pytest.raises(RuntimeError):
        m.allocate("a", 3)
    with pytest.raises(RuntimeError):
        m.allocate("b", 1)
    assert snapshot(m) == before
    assert "b" not in m.block_tables, "a refused allocation must not leave a block table behind"
    m.allocate("a", 2)
    assert m.num_free_blocks() == 0


def test_can_allocate_counts_cached_blocks_in_the_free_queue():
    m = KVCacheManager(num_blocks=4, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    _run_prompt(m, "a", prompt)
    m.free("a")
    assert m.num_free_blocks() == 4
    cached = m.find_cached_prefix(prompt + [6, 7, 8, 9, 10])
    assert len(cached) == 2 and all(m.pool.ref_cnt[b] == 0 for b in cached)
    # 4 cached slots + 6 new ones = 5 blocks: 3 new + 2 revived > 4 free
    assert not m.can_allocate("b", 6, cached)
    before = snapshot(m)
    with pytest.raises(RuntimeError):
        m.allocate("b", 6, cached)
    assert snapshot(m) == before, "a refused allocation must not keep the cached blocks"
    assert m.find_cached_prefix(prompt) == cached
    # 4 cached + 4 new = 4 blocks: 2 new + 2 revived == 4 free
    assert m.can_allocate("b", 4, cached)
    m.allocate("b", 4, cached)
    assert m.num_free_blocks() == 0
    assert m.block_tables["b"][:2] == cached
    m.pool.check_invariants()


def test_can_allocate_counts_the_copy_on_write_block():
    m = KVCacheManager(num_blocks=3, block_size=4)
    m.allocate("p", 6)
    m.fork("p", "c")
    m.allocate("x", 4)                  # the pool is now full
    assert m.num_free_blocks() == 0
    assert not m.can_allocate("c", 1), "writing into a shared partial block needs a copy"
    with pytest.raises(RuntimeError):
        m.allocate("c", 1)
    assert m.can_allocate("c", 0)
    m.free("x")
    assert m.can_allocate("c", 1) and not m.can_allocate("c", 3)
    m.allocate("c", 1)
    assert len(m.take_pending_copies()) == 1


# ---- stateful model ----------------------------------------------------------------------------

class KVCacheMachine(RuleBasedStateMachine):
    """A small engine over a simulated KV memory: prompts (with prefix-cache hits), decode steps that
    commit a prefix of what was computed, drafts rolled back, forks, frees."""

    caching = True
    max_requests = 4

    def __init__(self) -> None:
        super().__init__()
        self.m: KVCacheManager | None = None

    @initialize(num_blocks=st.integers(8, 24), block_size=st.integers(2, 4), vocab=st.integers(2, 4))
    def setup(self, num_blocks, block_size, vocab):
        self.m = KVCacheManager(num_blocks, block_size, enable_caching=self.caching)
        self.bs = block_size
        self.vocab = vocab
        self.mem: dict[int, list[int | None]] = {b: [None] * block_size for b in range(num_blocks)}
        self.tokens: dict[str, list[int]] = {}      # what each request's slots hold
        self.committed: dict[str, int] = {}         # how many leading tokens are committed
        self.expected: dict[bytes, tuple[int, ...]] = {}  # hash -> the block tokens it names
        self.history: list[list[int]] = []          # committed sequences, to re-prompt with
        self.next_id = 0
        self.last: str | None = None
        tok = st.integers(0, vocab - 1)
        self.prompt_st = st.lists(tok, min_size=1, max_size=3 * block_size + 1)
        self.tail_st = st.lists(tok, max_size=block_size + 1)
        self.new_st = st.lists(tok, min_size=1, max_size=2 * block_size)
        self.drafts_st = st.lists(tok, min_size=1, max_size=block_size + 1)

    # -- helpers --
    def pick(self, data) -> str | None:
        """A live request, half the time the one touched last (so steps chain on one request);
        with none live, add one instead (the caller then has nothing to do)."""
        if not self.tokens:
            self.add_request(data)
            return None
        live = sorted(self.tokens)
        i = data.draw(st.integers(0, 2 * len(live) - 1), label="request")
        rid = live[i % len(live)] if i < len(live) or self.last not in self.tokens else self.last
        self.last = rid
        return rid

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _must_copy(self, b: int) -> bool:
        return self.m.pool.ref_cnt[b] > 1 or self.m.pool.block_hash[b] is not None

    def _allocate(self, rid: str, new_tokens: list[int], cached: list[int] | None = None) -> bool:
        """Allocate + 'run the forward' (apply copies, write tokens). Checks the accounting."""
        m, bs, pool = self.m, self.bs, self.m.pool
        n = len(new_tokens)
        new = rid not in m.block_tables
        table0 = list(cached or []) if new else list(m.block_tables[rid])
        slots0 = len(table0) * bs if new else m.num_slots[rid]
        reclaimed = sum(1 for b in (cached or []) if pool.ref_cnt[b] == 0)
        cow = bool(n and slots0 % bs and self._must_copy(table0[-1]))
        new_blocks = cdiv(slots0 + n, bs) - len(table0)
        assert new_blocks >= 0
        peak = new_blocks + cow + reclaimed
        net = new_blocks + reclaimed + (cow and pool.ref_cnt[table0[-1]] > 1)
        free0 = m.num_free_blocks()

        ok = m.can_allocate(rid, n, cached)
        assert ok == (peak <= free0), "can_allocate disagrees with what allocate needs"
        if not ok:
            before = snapshot(m)
            with pytest.raises(RuntimeError):
                m.allocate(rid, n, cached)
            assert snapshot(m) == before
            assert new == (rid not in m.block_tables)
            return False

        m.allocate(rid, n, cached)  # must not raise: can_allocate said yes
        table = m.block_tables[rid]
        assert m.num_slots[rid] == slots0 + n
        assert m.num_free_blocks() == free0 - net
        assert table[:len(table0) - cow] == table0[:len(table0) - cow]
        copies = m.take_pending_copies()
        if cow:
            assert copies == [(table0[-1], table[len(table0) - 1])]
            assert table[len(table0) - 1] not in table0
        else:
            assert copies == []
        for src, dst in copies:     # the runner copies before the forward writes
            self.mem[dst] = list(self.mem[src])
        for i, t in enumerate(new_tokens):
            s = slots0 + i
            b = table[s // bs]
            assert pool.ref_cnt[b] == 1, f"write into shared block {b}"
            assert pool.block_hash[b] is None, f"write into hashed block {b}"
            self.mem[b][s % bs] = t
        if new:
            self.tokens[rid] = [t for b in table0 for t in self.mem[b]]
        self.tokens[rid] = self.tokens[rid] + list(new_tokens)
        return True

    def _commit(self, rid: str, c: int) -> None:
        assert self.committed[rid] <= c <= len(self.tokens[rid])
        self.committed[rid] = c
        toks = self.tokens[rid][:c]
        self.m.commit(rid, toks)
        hashes = self.m.block_hashes[rid]
        assert len(hashes) == c // self.bs
        for i, h in enumerate(hashes):
            block = tuple(toks[i * self.bs:(i + 1) * self.bs])
            assert self.expected.setdefault(h, block) == block
        if c:
            self.history.append(toks)

    # -- rules --
    @precondition(lambda self: len(self.tokens) < self.max_requests)
    @rule(data=st.data())
    def add_request(self, data):
        bs = self.bs
        fresh = self.prompt_st
        if self.history:
            base = self.history[data.draw(st.integers(0, len(self.history) - 1), label="reuse")]
            cut = data.draw(st.integers(0, len(base)), label="cut")
            prompt = base[:cut] + data.draw(self.tail_st, label="tail")
            if not prompt:
                prompt = data.draw(fresh, label="prompt")
        else:
            prompt = data.draw(fresh, label="prompt")

        cached = self.m.find_cached_prefix(prompt)
        assert len(cached) * bs <= len(prompt) - 1, "must leave the last token to compute"
        assert len(set(cached)) == len(cached)
        if not self.caching:
            assert cached == []
        for i, b in enumerate(cached):  # a hit holds exactly the prompt's tokens
            assert self.mem[b] == prompt[i * bs:(i + 1) * bs]
        # the hit is maximal: the next full block (short of the last token) is not cached
        if self.caching and (len(cached) + 1) * bs <= len(prompt) - 1:
            h = None
            for i in range(len(cached) + 1):
                h = hash_block(h, prompt[i * bs:(i + 1) * bs])
            assert self.m.pool.lookup(h) is None

        rid = self._new_id()
        if self._allocate(rid, prompt[len(cached) * bs:], cached):
            assert self.tokens[rid] == prompt
            self.committed[rid] = len(cached) * bs
            self._commit(rid, len(prompt))
            assert self.m.block_tables[rid][:len(cached)] == cached
            self.last = rid

    @rule(data=st.data())
    def append(self, data):
        rid = self.pick(data)
        if rid is not None:
            self._append(rid, data)

    @rule(data=st.data())
    def speculate(self, data):
        rid = self.pick(data)
        if rid is not None:
            self._speculate(rid, data)

    def _append(self, rid: str, data) -> None:
        """A decode/verify step: compute some tokens, then commit a prefix of everything computed."""
        if self._allocate(rid, data.draw(self.new_st, label="new")):
            self._accept(rid, data)

    def _accept(self, rid: str, data) -> None:
        """Verification: commit some more of the tokens already computed (drafts included)."""
        self._commit(rid, data.draw(st.integers(self.committed[rid], len(self.tokens[rid])), label="commit"))

    def _speculate(self, rid: str, data) -> None:
        """A draft step: reject some of the earlier unverified tokens, give k new drafts a slot, then
        reject a random number of those."""
        if self.m.block_hashes[rid] and data.draw(st.booleans(), label="try too far"):
            self._refused_rollback(rid)
        uncommitted = len(self.tokens[rid]) - self.committed[rid]
        self._rollback(rid, data.draw(st.integers(0, uncommitted), label="reject earlier"))
        drafts = data.draw(self.drafts_st, label="drafts")
        if self._allocate(rid, drafts):
            self._rollback(rid, data.draw(st.integers(0, len(drafts)), label="reject"))

    def _refused_rollback(self, rid: str) -> None:
        """Rolling back into the request's own hashed (committed) blocks is refused, changing nothing."""
        too_far = len(self.tokens[rid]) - len(self.m.block_hashes[rid]) * self.bs + 1
        before = snapshot(self.m)
        with pytest.raises(AssertionError, match="hashed"):
            self.m.rollback(rid, too_far)
        assert snapshot(self.m) == before

    def _rollback(self, rid: str, n: int) -> None:
        m, pool = self.m, self.m.pool
        table0 = list(m.block_tables[rid])
        slots = len(self.tokens[rid]) - n
        keep = cdiv(slots, self.bs)
        dropped = table0[keep:]
        expect_freed = sum(1 for b in dropped if pool.ref_cnt[b] == 1)
        free0 = m.num_free_blocks()
        m.rollback(rid, n)
        assert m.block_tables[rid] == table0[:keep]
        assert m.num_free_blocks() == free0 + expect_freed
        self.tokens[rid] = self.tokens[rid][:slots]

    @precondition(lambda self: len(self.tokens) < self.max_requests)
    @rule(data=st.data())
    def fork(self, data):
        parent = self.pick(data)
        if parent is None:
            return
        child = self._new_id()
        table = list(self.m.block_tables[parent])
        refs0 = [self.m.pool.ref_cnt[b] for b in table]
        free0 = self.m.num_free_blocks()
        self.m.fork(parent, child)
        assert self.m.block_tables[child] == table
        assert [self.m.pool.ref_cnt[b] for b in table] == [r + 1 for r in refs0]
        assert self.m.num_free_blocks() == free0
        self.tokens[child] = list(self.tokens[parent])
        self.committed[child] = self.committed[parent]

    @rule(data=st.data())
    def free(self, data):
        rid = self.pick(data)
        if rid is not None:
            self._free(rid)

    def _free(self, rid: str) -> None:
        m = self.m
        table = m.block_tables[rid]
        expect_freed = sum(1 for b in table if m.pool.ref_cnt[b] == 1)
        free0 = m.num_free_blocks()
        m.free(rid)
        assert rid not in m.block_tables and rid not in m.num_slots and rid not in m.block_hashes
        assert m.num_free_blocks() == free0 + expect_freed
        del self.tokens[rid], self.committed[rid]

    # -- invariants --
    @invariant()
    def bookkeeping(self):
        if self.m is None:
            return
        m, pool, bs = self.m, self.m.pool, self.bs
        pool.check_invariants()
        assert set(m.block_tables) == set(self.tokens) == set(m.num_slots) == set(m.block_hashes)
        assert m.pending_copies == []
        refs = [0] * m.num_blocks
        for rid, table in m.block_tables.items():
            assert len(set(table)) == len(table), "a table holds a block twice"
            for b in table:
                refs[b] += 1
            assert m.num_slots[rid] == len(self.tokens[rid])
            assert len(table) == cdiv(m.num_slots[rid], bs)
            hashed = [pool.block_hash[b] is not None for b in table]
            assert hashed == sorted(hashed, reverse=True), "hashed blocks must be a prefix of the table"
            hashes = m.block_hashes[rid]
            assert len(hashes) * bs <= m.num_slots[rid]
            assert len(hashes) == self.committed[rid] // bs
            if self.caching:
                assert [pool.block_hash[b] for b in table[:len(hashes)]] == hashes
            else:
                assert not any(hashed)
        assert refs == pool.ref_cnt, "ref counts disagree with the block tables"
        referenced = sum(1 for r in refs if r)
        assert m.num_free_blocks() + referenced == m.num_blocks

    @invariant()
    def memory_is_consistent(self):
        if self.m is None:
            return
        bs = self.bs
        for rid, toks in self.tokens.items():  # every request reads back its own tokens
            table = self.m.block_tables[rid]
            assert [self.mem[table[s // bs]][s % bs] for s in range(len(toks))] == toks, rid
        for h, block in self.expected.items():  # the cache serves what its hashes name
            b = self.m.pool.lookup(h)
            if b is not None:
                assert tuple(self.mem[b]) == block, f"cached block {b} was overwritten"

    def teardown(self):
        if self.m is None:
            return
        for rid in sorted(self.tokens):
            self._free(rid)
        pool = self.m.pool
        assert all(c == 0 for c in pool.ref_cnt), "blocks leaked"
        assert self.m.num_free_blocks() == self.m.num_blocks
        assert self.m.block_tables == {} and self.m.num_slots == {} and self.m.block_hashes == {}
        pool.check_invariants()


_ops = st.sampled_from(["append", "speculate", "accept"])


@settings(max_examples=200, deadline=None)
@given(data=st.data(), block_size=st.integers(2, 4), caching=st.booleans(),
       prompt_len=st.integers(1, 9), num_drafts=st.integers(1, 6),
       together=st.lists(st.tuples(st.booleans(), _ops), max_size=3),
       finisher=st.sampled_from(["parent", "child"]), alone=st.lists(_ops, min_size=1, max_size=4))
def test_forked_siblings_diverge_safely(data, block_size, caching, prompt_len, num_drafts, together,
                                        finisher, alone):
    """The state machine's model, focused on one fork: a request with unverified drafts forks, the
    siblings take a few steps each, one finishes, the other goes on alone (rejecting drafts its
    sibling accepted, writing others ...). Neither may see the other's tokens, and the prefix
    cache must never serve a block that was written after it was hashed."""
    machine = KVCacheMachine()
    machine.caching = caching
    machine.setup(num_blocks=16, block_size=block_size, vocab=2)
    machine._allocate("parent", [0] * prompt_len)
    machine.committed["parent"] = 0
    machine._commit("parent", prompt_len)
    machine._allocate("parent", [1] * num_drafts)  # drafts, not verified yet
    machine.m.fork("parent", "child")
    machine.tokens["child"] = list(machine.tokens["parent"])
    machine.committed["child"] = prompt_len

    def do(rid, op):
        getattr(machine, "_" + op)(rid, data)
        machine.bookkeeping()
        machine.memory_is_consistent()

    for child, op in together:
        do("child" if child else "parent", op)
    machine._accept(finisher, data)
    machine._free(finisher)
    machine.bookkeeping()
    machine.memory_is_consistent()
    survivor = "child" if finisher == "parent" else "parent"
    for op in alone:
        do(survivor, op)
    machine.add_request(data)  # a new prompt, maybe hitting the finisher's cached blocks
    machine.bookkeeping()
    machine.memory_is_consistent()
    machine.teardown()


class KVCacheMachineNoCaching(KVCacheMachine):
    caching = False


TestKVCacheStateful = KVCacheMachine.TestCase
TestKVCacheStateful.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
# caching off is the simpler case (and test_forked_siblings_diverge_safely covers it too): fewer runs
TestKVCacheStatefulNoCaching = KVCacheMachineNoCaching.TestCase
TestKVCacheStatefulNoCaching.settings = settings(max_examples=50, stateful_step_count=40, deadline=None)
