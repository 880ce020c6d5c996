"""Scheduler: continuous batching under a token budget, FCFS.

One rule covers prefill, chunked prefill, plain decode and verification alike: each step moves a
request's `num_computed_tokens` toward `num_tokens + len(drafts)` within the token budget (drafts:
what the proposers offered this step, a DraftBatch). Drafts are optional: where the budget or the KV
pool is short, the scheduler trims them; what it keeps goes into each ScheduledChunk and is what
gets verified.
Running requests are served first (oldest first); waiting ones are admitted while budget, batch
size and KV blocks allow: room for the prompt plus the k speculative slots in the target pool, and
room for the prompt in the draft pool of the request's proposer (two-pool admission). When target
blocks run out, a running request first gives up its speculative slots for the step; if that is not
enough, a running request is preempted by recompute, youngest first, and goes back to the front of
the queue. A request that can never fit is refused at add_request; a full queue raises QueueFull.
A request queued behind one with the same prompt (parallel sampling's n choices) waits until that
one has computed the prompt, then shares its blocks and computes only the prompt's last token.
Background requests (the server's shadow A/B) have their own queue: they are admitted only when no
foreground request waits, and they are the first to be preempted.
"""
from __future__ import annotations

from collections import deque

from specdec.config import CacheConfig, SchedulerConfig
from specdec.core.kv_cache_manager import KVCacheManager, cdiv
from specdec.core.outputs import DraftBatch, ScheduledChunk, SchedulerOutput
from specdec.request import Request, RequestStatus


class QueueFull(RuntimeError):
    """The waiting queue is at max_queued_requests: try again later (HTTP 429)."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig, kv: KVCacheManager,
                 max_model_len: int, draft_pools: dict[str, KVCacheManager] | None = None,
                 spec_reserve: int = 0) -> None:
        """`draft_pools`: the proposers' KV pools by proposer id (the speculator keeps the dict up to
        date); `spec_reserve`: k, the target slots kept free for drafts when admitting a request."""
        self.config = config
        self.cache_config = cache_config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.background: deque[Request] = deque()   # low priority: admitted when `waiting` is empty
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.draft_pools = draft_pools if draft_pools is not None else {}
        self.spec_reserve = spec_reserve

    # ---- admission ----------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a request, refusing one that could never fit the context or the KV pool."""
        n = req.num_prompt_tokens
        queue = self.background if req.background else self.waiting
        if len(queue) >= self.config.max_queued_requests:
            raise QueueFull(f"the waiting queue is full ({self.config.max_queued_requests} requests)")
        if n == 0:
            raise ValueError("prompt is empty")
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens; the context holds {self.max_model_len} "
                             "(prompt plus at least one generated token)")
        worst = min(n + req.params.max_tokens, self.max_model_len)
        if cdiv(worst, self.kv.block_size) > self.kv.num_blocks:
            raise ValueError(f"request needs up to {cdiv(worst, self.kv.block_size)} KV blocks; the pool "
                             f"has {self.kv.num_blocks} (raise cache blocks or lower max_tokens)")
        pool = self.draft_pools.get(req.spec_method or "")
        if pool is not None and cdiv(worst, pool.block_size) > pool.num_blocks:
            raise ValueError(f"request needs up to {cdiv(worst, pool.block_size)} draft KV blocks; the draft "
                             f"pool has {pool.num_blocks} (raise draft_cache_blocks, lower max_tokens, or "
                             "disable speculation for it)")
        sibling = next((r for r in queue if r.prompt_token_ids == req.prompt_token_ids and r.fork_of is None
                        and r.params.cache_scope == req.params.cache_scope), None)
        if sibling is not None and self.kv.pool.enable_caching:
            req.fork_of = sibling.request_id   # an identical prompt ahead of it: prefill once, share the blocks
        queue.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.background)

    # ---- one step -----------------------------------------------------------------------------
    def schedule(self, drafts: DraftBatch | None = None) -> SchedulerOutput:
        """`drafts`: what the proposers offer for running requests; a prefix of each is kept."""
        budget = self.config.max_num_batched_tokens
        offered = {rid: d.token_ids for rid, d in drafts.by_request.items()} if drafts is not None else {}
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        scheduled: list[Request] = []

        for req in list(self.running):
            if budget == 0:
                break
            if req not in self.running:  # preempted below by an older request
                continue
            spec = offered.get(req.request_id, [])
            num_new = self._num_new_tokens(req, budget, spec)
            if spec and not self.kv.can_allocate(req.request_id, num_new):
                spec = []  # drafts are optional: drop them before evicting anyone
                num_new = self._num_new_tokens(req, budget, spec)
            while not self.kv.can_allocate(req.request_id, num_new):
                # the youngest background request goes first, then the youngest request
                victim = next((r for r in reversed(self.running) if r.background), self.running[-1])
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req not in self.running:
                continue
            self.kv.allocate(req.request_id, num_new)
            chunks.append(self._chunk(req, num_new, spec))
            scheduled.append(req)
            budget -= num_new

        while budget > 0 and len(self.running) < self.config.max_batch_size:
            if preempted:
                break  # memory is tight this step: don't admit what we just evicted
            queue = self.waiting or self.background
            if not queue:
                break
            req = queue[0]
            leader = self._leader(req)
            if leader is not None:
                if leader.num_computed_tokens < leader.num_prompt_tokens or not self._fork(req, leader):
                    break   # its prompt's K/V is still being computed, or no room: the sibling waits
                queue.popleft()
                chunks.append(self._chunk(req, 1))
                scheduled.append(req)
                budget -= 1
                continue
            cached = self.kv.find_cached_prefix(req.all_token_ids, req.params.cache_scope)
            num_cached = len(cached) * self.kv.block_size
            req.num_computed_tokens = num_cached
            num_new = self._num_new_tokens(req, budget)
            if not self._can_admit(req, num_new, cached):
                req.num_computed_tokens = 0
                break
            queue.popleft()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            self.kv.allocate(req.request_id, num_new, cached)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chunks.append(self._chunk(req, num_new))
            scheduled.append(req)
            budget -= num_new

        return SchedulerOutput(
            chunks=chunks,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            block_copies=self.kv.take_pending_copies(),
            preempted_request_ids=preempted,
        )

    def _leader(self, req: Request) -> Request | None:
        """The request whose prompt K/V `req` shares (parallel sampling: an identical prompt queued
        before it), while that one is running or about to; None: `req` computes its own prompt."""
        if req.fork_of is None:
            return None
        for other in [*self.running, *self.waiting, *self.background]:
            if other.request_id == req.fork_of and other is not req:
                return other if other.status == RequestStatus.RUNNING or other.num_computed_tokens == 0 else None
        req.fork_of = None   # it finished or was aborted: its full blocks may still be cached
        return None

    def _fork(self, req: Request, leader: Request) -> bool:
        """Share the leader's prompt blocks; the sibling computes only the prompt's last token (its own
        logits there), copying the shared partial block."""
        keep = req.num_prompt_tokens - 1
        if not self.kv.can_fork(leader.request_id, keep, 1 + self.spec_reserve):
            return False
        self.kv.fork(leader.request_id, req.request_id, keep)
        self.kv.allocate(req.request_id, 1)
        req.num_computed_tokens = keep
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = keep
        req.fork_of = None
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return True

    def _can_admit(self, req: Request, num_new: int, cached: list[int]) -> bool:
        """Target room for this chunk, plus k speculative slots once the prompt is done; and draft
        room for the whole prompt (the draft catches up on it before its first draft)."""
        done = num_new == req.num_tokens - req.num_computed_tokens
        reserve = min(self.spec_reserve, req.params.max_tokens - 1) if req.spec_method and done else 0
        if not self.kv.can_allocate(req.request_id, num_new + reserve, cached):
            return False
        pool = self.draft_pools.get(req.spec_method or "")
        if pool is None or req.request_id in pool.block_tables:
            return True
        draft_cached = pool.find_cached_prefix(req.all_token_ids, req.params.cache_scope)
        return pool.can_allocate(req.request_id, req.num_tokens - len(draft_cached) * pool.block_size + reserve,
                                 draft_cached)

    def _num_new_tokens(self, req: Request, budget: int, drafts: list[int] = ()) -> int:
        target = req.num_tokens + len(drafts)
        num_new = min(target - req.num_computed_tokens, budget)
        if self.config.long_prefill_token_threshold:
            num_new = min(num_new, self.config.long_prefill_token_threshold)
        assert num_new > 0, f"request {req.request_id} has nothing to compute"
        return num_new

    def _chunk(self, req: Request, num_new: int, drafts: list[int] = ()) -> ScheduledChunk:
        start = req.num_computed_tokens
        end = start + num_new
        kept = list(drafts[: max(0, end - req.num_tokens)])  # the drafts that fit
        tokens = req.all_token_ids[start:end] + kept
        # logits for every position from the last committed token on: 1 + drafts covered
        num_logits = max(0, end - (req.num_tokens - 1))
        return ScheduledChunk(req.request_id, tokens, start, list(self.kv.block_tables[req.request_id]),
                              num_logits, kept)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        (self.background if req.background else self.waiting).appendleft(req)

    # ---- after the forward --------------------------------------------------------------------
    def advance(self, chunk: ScheduledChunk, req: Request) -> None:
        """The forward computed the chunk's K/V."""
        req.num_computed_tokens = chunk.start_position + len(chunk.token_ids)

    def finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req in self.background:
            self.background.remove(req)
        self.kv.free(req.request_id)

    def abort(self, request_id: str) -> Request | None:
        for req in list(self.running) + list(self.waiting) + list(self.background):
            if req.request_id == request_id:
                self.finish(req, RequestStatus.FINISHED_ABORTED)
                return req
        return None
