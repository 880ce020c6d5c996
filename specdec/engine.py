"""LLMEngine: add_request / abort / step over the scheduler, the proposer, the model runner and the
rejection sampler.

step() is the whole loop: plan k -> schedule -> propose -> run the target -> rejection-sample ->
update. Plain decoding is the same loop with k = 0 everywhere.
"""
from __future__ import annotations

import itertools
import logging
import time

import torch

from specdec.config import EngineConfig
from specdec.core.kv_cache_manager import KVCacheManager
from specdec.core.outputs import ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from specdec.core.scheduler import Scheduler
from specdec.metrics import EngineCounters
from specdec.models.llama import LlamaModel
from specdec.models.loader import LoadedModel, load_model
from specdec.output_processor import OutputProcessor
from specdec.request import (
    Request,
    RequestOutput,
    RequestStats,
    RequestStatus,
    SpecOptions,
)
from specdec.runner.model_runner import ModelRunner
from specdec.runner.threads import thread_tuner
from specdec.sample.logits_processors import process_logits
from specdec.sample.rejection_sampler import rejection_sample
from specdec.sample.sampler import fill_random_inputs, make_generator, top_logprobs
from specdec.sampling_params import SamplingParams
from specdec.speculation.controller import SpecController
from specdec.speculation.draft_set import NGRAM, DraftSet, DraftStatus
from specdec.speculation.proposers.base import DraftProposal, Proposer
from specdec.speculation.router import DraftRouter, guess_domain

log = logging.getLogger("specdec")


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = True, loaded: LoadedModel | None = None,
                 draft_loaded: LoadedModel | None = None) -> None:
        self.config = config
        mc, cc = config.model, config.cache
        if mc.num_threads:
            torch.set_num_threads(mc.num_threads)
        self.device = torch.device(mc.device)
        self.loaded = loaded or load_model(mc.model, mc.precision, mc.device, progress)
        cfg = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = min(mc.max_model_len or cfg.max_position, cfg.max_position)
        self.kv = KVCacheManager(cc.target_cache_blocks, cc.block_size, cc.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, cc, self.kv, self.max_model_len)
        self.runner = ModelRunner(LlamaModel(cfg, self.loaded.weights, self.max_model_len, self.device),
                                  cc.target_cache_blocks, cc.block_size, self.device,
                                  self.tokenizer.never_sample_ids, self.tokenizer.vocab_size, thread_tuner(mc))
        self.output_processor = OutputProcessor(self.tokenizer, self.max_model_len)
        self.counters = EngineCounters()
        # the loaded proposers by id (the configured one first); each has its own controller
        self.drafts: DraftSet | None = None
        self.proposers: dict[str, Proposer] = {}
        self.controllers: dict[str, SpecController] = {}
        self.default_method: str | None = None   # id of the configured proposer
        if config.speculative is not None:
            self.drafts = DraftSet(config, self.loaded, self.max_model_len, self.scheduler, draft_loaded, progress)
            self.proposers, self.controllers = self.drafts.proposers, self.drafts.controllers
            self.default_method = self.drafts.default_id
            self.scheduler.spec_reserve = config.speculative.num_speculative_tokens
        self.requests: dict[str, Request] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._drafts: dict[str, DraftProposal] = {}
        self._ids = itertools.count()
        self._step_explored = False  # this step ran a forward on a thread count being tried
        # test suites only: a deliberately broken rejection sampler (see rejection_sample's _test_mode)
        self._rejection_test_mode: str | None = None

    @property
    def precision(self) -> str:
        return self.config.model.precision

    @property
    def proposer(self) -> Proposer | None:
        """The configured (default) proposer."""
        return self.proposers.get(self.default_method) if self.default_method else None

    @property
    def controller(self) -> SpecController | None:
        return self.controllers.get(self.default_method) if self.default_method else None

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, speculative: SpecOptions | None = None,
                    background: bool = False) -> Request:
        """Tokenize and queue a prompt. Raises ValueError (and queues nothing) on a bad request,
        QueueFull when the waiting queue is at its limit. `background`: low priority (admitted only
        when no other request waits, preempted first)."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            ids, text = self.tokenizer.encode(prompt), prompt
        else:
            ids, text = list(prompt), None
            bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < self.tokenizer.vocab_size)]
            if bad:
                raise ValueError(f"token ids outside the vocabulary (0..{self.tokenizer.vocab_size - 1}): {bad[:5]}")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        method, domain = self._spec_method(speculative, ids, text)
        req = Request(request_id, text, ids, params, spec_method=method,
                      spec_max_k=speculative.max_k if speculative else None, spec_domain=domain,
                      spec_history=[method] if method else [], background=background)
        self.scheduler.add_request(req)  # validates length and KV-pool fit
        if method is not None:
            self.drafts.touch(method)
            if method not in self.proposers:
                self.drafts.load(method)  # first use: loads in the background, drafts once ready
        self.requests[request_id] = req
        self.output_processor.add(req)
        self._generators[request_id] = make_generator(params.seed)
        return req

    def _spec_method(self, opts: SpecOptions | None, ids: list[int], text: str | None
                     ) -> tuple[str | None, str | None]:
        """(proposer id, domain guess) for a new request: what it asked for, else the router's
        choice, else the configured proposer."""
        if opts is not None and not opts.enabled:
            return None, None
        method = opts.method if opts is not None else None
        if self.drafts is None:
            if method is not None:
                raise ValueError(f"speculative method {method!r} is not available: this engine decodes plainly")
            return None, None
        if method not in (None, "auto"):
            proposer_id = self.drafts.resolve(method)
            # a draft that failed to load is skipped (reported by draft_status), never an error
            return (None if proposer_id in self.drafts.errors else proposer_id), None
        # the domain guess also keys the controller's acceptance prior, so it is made with one draft too
        domain = guess_domain(text if text is not None else self.tokenizer.decode(ids))
        if self.router is None:
            return self.default_method, domain
        return self.router.choose(domain, self.drafts.candidates()), domain

    def abort(self, request_id: str) -> None:
        if self.scheduler.abort(request_id) is not None:
            self._release(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.drafts is not None:
            self.poll_drafts()
        t0, self._step_explored = time.perf_counter(), False
        planned = self._plan_speculation()
        emitted_before = {rid: len(self.requests[rid].output_token_ids) for rid in planned}
        sched = self.scheduler.schedule()
        for rid in sched.preempted_request_ids:
            for proposer in self.proposers.values():
                proposer.free(rid)
        if sched.is_empty:
            return []
        self._propose(sched)
        out = self.runner.execute(sched)
        outputs = self._update(sched, out)
        self._record_step(sched, planned, time.perf_counter() - t0, emitted_before)
        return outputs

    def _record_step(self, sched: SchedulerOutput, planned: dict[str, tuple[str, int]], seconds: float,
                     emitted_before: dict[str, int]) -> None:
        """A pure decode step whose requests share one proposer and one k, none of them catching up on
        more than a step's tokens (the last draft and the bonus token of a fully accepted step), no
        forward on a thread count being tried: its wall time calibrates that controller's predicted
        step cost."""
        shape = {(planned.get(c.request_id, ("", -1))[0], c.num_drafts) for c in sched.chunks}
        caught_up = all(c.num_drafts == 0 or planned[c.request_id][1] <= 2 for c in sched.chunks
                        if c.request_id in planned)
        if len(shape) == 1 and caught_up and not self._step_explored:
            (method, k), = shape
            if method in self.controllers:
                controller, batch = self.controllers[method], len(sched.chunks)
                controller.record_step(k, batch, seconds)
                for c in sched.chunks:
                    req = self.requests.get(c.request_id)
                    if req is not None and c.request_id in emitted_before:
                        tokens = len(req.output_token_ids) - emitted_before[c.request_id]
                        controller.record_request_step(c.request_id, k, batch, seconds, tokens)

    def _plan_speculation(self) -> dict[str, tuple[str, int]]:
        """Sets each decoding request's k; returns {request id: (proposer id, catch-up tokens)}."""
        planned: dict[str, tuple[str, int]] = {}
        batch = len(self.scheduler.running)
        for req in self.scheduler.running:
            req.num_spec_tokens = 0
            method = req.spec_method
            if method not in self.proposers or req.num_computed_tokens != req.num_tokens - 1:
                continue  # plain decoding, its draft still loading, or still prefilling
            controller = self.controllers[method]
            remaining = min(req.params.max_tokens - len(req.output_token_ids), self.max_model_len - req.num_tokens)
            k = catch_up = 0
            if remaining > 1:
                catch_up = self.proposers[method].catch_up_tokens(req)
                k = controller.next_k(req.request_id, len(req.output_token_ids), batch, remaining, catch_up,
                                      req.spec_domain)
                if req.spec_max_k is not None:
                    k = min(k, req.spec_max_k)
                k = min(k, remaining - 1)
            req.num_spec_tokens = k
            controller.charge(req.request_id, k, batch, catch_up)
            planned[req.request_id] = (method, catch_up)
        return planned

    def _propose(self, sched: SchedulerOutput) -> None:
        by_method: dict[str, list[ScheduledChunk]] = {}
        for c in sched.chunks:
            if c.num_drafts:
                by_method.setdefault(self.requests[c.request_id].spec_method, []).append(c)
        for method, chunks in by_method.items():
            self._propose_with(method, chunks, sched)

    def _propose_with(self, method: str, chunks: list[ScheduledChunk], sched: SchedulerOutput) -> None:
        proposer, controller = self.proposers[method], self.controllers[method]
        reqs = [self.requests[c.request_id] for c in chunks]
        try:
            proposals = proposer.propose(reqs, [c.num_drafts for c in chunks])
        except Exception:  # a proposer failure costs speed, never a request
            log.exception("proposer %s failed; speculation disabled for %d request(s)", proposer.name, len(reqs))
            self.counters.proposer_errors += 1
            for r in reqs:
                controller.disable(r.request_id)
                proposer.free(r.request_id)
            proposals = [DraftProposal([]) for _ in reqs]
        seconds = proposer.draft_seconds
        for rows, forward_seconds in proposer.forward_costs:
            if forward_seconds is not None:
                controller.record_draft(rows, forward_seconds)
        self._step_explored |= any(s is None for _, s in proposer.forward_costs)
        if not proposer.forward_costs:  # a model-free proposer: its wall time per draft step
            controller.record_draft(len(reqs), seconds / max(c.num_drafts for c in chunks))
        for chunk, req, prop in zip(chunks, reqs, proposals):
            k = chunk.num_drafts
            drafts = prop.token_ids[:k]
            if len(drafts) < k:  # fewer drafts than scheduled slots: give the slots back
                self.kv.rollback(req.request_id, k - len(drafts))
                chunk.num_logits -= k - len(drafts)
                sched.num_batched_tokens -= k - len(drafts)
            chunk.token_ids.extend(drafts)
            req.spec_token_ids = drafts
            req.spec.draft_seconds += seconds
            probs = None if prop.probs is None else prop.probs[: len(drafts)]
            self._drafts[req.request_id] = DraftProposal(drafts, probs)

    def _update(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[RequestOutput]:
        sampled = [(i, c) for i, c in enumerate(sched.chunks) if c.num_logits]
        tokens, accepted = self._sample(sampled, out) if sampled else ([], [])
        self._step_explored |= out.exploring
        for controller in self.controllers.values():
            if not out.exploring:
                controller.record_verify(sched.num_batched_tokens, out.forward_seconds)
        emitted = dict(zip((i for i, _ in sampled), zip(tokens, accepted)))
        outputs = []
        for i, chunk in enumerate(sched.chunks):
            req = self.requests[chunk.request_id]
            self.scheduler.advance(chunk, req)
            if i in emitted:
                new, num_accepted = emitted[i]
                row0 = out.cu_num_logits[i]
                self._accept(req, chunk, new, num_accepted, out.logits[row0:row0 + chunk.num_logits],
                             out.forward_seconds)
            if not req.finished:
                self.kv.commit(req.request_id, req.all_token_ids[: req.num_computed_tokens])
            if chunk.num_logits or req.finished:
                outputs.append(self.output_processor.output(req, self._stats(req)))
            if req.finished:
                self._release(req.request_id)
        return outputs

    def _sample(self, sampled: list[tuple[int, ScheduledChunk]], out: ModelRunnerOutput
                ) -> tuple[list[list[int]], list[int]]:
        """Build the padded batch for rejection_sample: processed target logits at every scored
        position (drafts before position j count as output for penalties), draft probabilities,
        and each request's random draws."""
        vocab = out.logits.shape[-1]
        max_k = max(c.num_drafts for _, c in sampled)
        n = len(sampled)
        if max_k == 0 and all(self.requests[c.request_id].params.greedy for _, c in sampled):
            # plain greedy steps: the processed argmax is all rejection_sample would compute (k = 0), without
            # its vocabulary-sized softmax, noise and gathers (about 1.7 ms of a 68 ms 1.5B step here)
            tokens = []
            for i, chunk in sampled:
                req = self.requests[chunk.request_id]
                row = process_logits(out.logits[out.cu_num_logits[i]], req.params, req.prompt_token_ids,
                                     req.output_token_ids)
                tokens.append([int(row.argmax())])
            return tokens, [0] * n
        draft_ids = torch.full((n, max_k), -1, dtype=torch.long)
        num_draft = torch.zeros(n, dtype=torch.long)
        target = torch.zeros(n, max_k + 1, vocab)
        draft_probs = torch.zeros(n, max_k, vocab) if max_k else None
        greedy = torch.zeros(n, dtype=torch.bool)
        uniforms = torch.zeros(n, max_k)
        noise = torch.ones(n, max_k + 1, vocab)
        for r, (i, chunk) in enumerate(sampled):
            req = self.requests[chunk.request_id]
            k, p = chunk.num_drafts, req.params
            drafts = req.spec_token_ids
            rows = out.logits[out.cu_num_logits[i]:out.cu_num_logits[i + 1]]
            for j in range(k + 1):
                target[r, j] = process_logits(rows[j], p, req.prompt_token_ids, req.output_token_ids + drafts[:j])
            if k:
                draft_ids[r, :k] = torch.tensor(drafts)
                num_draft[r] = k
                q = self._drafts[req.request_id].probs
                if q is None:  # one-hot drafts (n-gram, or a greedy draft)
                    draft_probs[r, torch.arange(k), draft_ids[r, :k]] = 1.0
                else:
                    draft_probs[r, :k, : q.shape[-1]] = q
            greedy[r] = p.greedy
            fill_random_inputs(None if p.greedy else self._generators[req.request_id], k, uniforms[r], noise[r])
        out_ids, num_accepted = rejection_sample(draft_ids, num_draft, draft_probs, target, greedy, uniforms, noise,
                                               _test_mode=self._rejection_test_mode)
        tokens = [out_ids[r, : int(num_accepted[r]) + 1].tolist() for r in range(n)]
        return tokens, num_accepted.tolist()

    def _accept(self, req: Request, chunk: ScheduledChunk, new: list[int], num_accepted: int,
                raw_logits: torch.Tensor, forward_seconds: float) -> None:
        """Append the emitted tokens one by one (a stop inside the block cuts it there), then roll
        back the K/V of rejected drafts in the target and in the proposer."""
        k = chunk.num_drafts
        decoding = bool(req.output_token_ids)
        now = time.perf_counter()
        req.first_token_time = req.first_token_time or now
        req.spec.verify_seconds += forward_seconds
        proposer = self.proposers.get(req.spec_method) if req.spec_method else None
        fell_back = False
        if k:
            req.spec.record(k, num_accepted)
            fell_back = self.controllers[req.spec_method].observe(req.request_id, k, num_accepted)
            self.counters.record_spec(proposer.name, k, num_accepted)
        status: RequestStatus | None = None
        for j, token in enumerate(new):
            req.output_token_ids.append(token)
            if req.params.logprobs is not None:
                req.logprobs.append(top_logprobs(raw_logits[j], token, req.params.logprobs))
            status = self.output_processor.check_stop(req, token)
            if status is not None:
                break
        if decoding:
            req.spec.decode_forwards += 1
            req.spec.decode_tokens += j + 1
            if proposer is not None:
                self.controllers[req.spec_method].credit(req.request_id, j + 1)
        self.counters.generated_tokens += j + 1
        self.counters.target_forwards += 1
        req.spec_token_ids, req.num_spec_tokens = [], 0
        rejected = k - num_accepted
        if status is not None:
            req.finish_time = now
            # its full blocks stay cached for later prompts (a rejected draft's K/V is not its token's)
            self.kv.commit(req.request_id, req.all_token_ids[: req.num_computed_tokens - rejected])
            self.scheduler.finish(req, status)
            return
        if rejected:
            self.kv.rollback(req.request_id, rejected)
            req.num_computed_tokens -= rejected
        if proposer is not None:
            proposer.on_verified(req, k, num_accepted)
        if fell_back and self.router is not None:
            self.drafts.move(req, "acceptance collapsed")

    def _stats(self, req: Request) -> RequestStats:
        names = [self._proposer_name(i) for i in req.spec_history]
        method = req.spec_method
        kind = "none" if method is None else (NGRAM if method == NGRAM else "draft_model")
        return RequestStats.from_request(req, self.precision, kind, self._proposer_name(method) if method else None,
                                         names)

    def _proposer_name(self, proposer_id: str) -> str:
        p = self.proposers.get(proposer_id)
        return p.name if p is not None else proposer_id

    def _release(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None and req.spec_method is not None and self.drafts is not None:
            self.drafts.observe_gain(req)
            self.drafts.touch(req.spec_method)
        if req is not None and req.finished:
            self.counters.requests_finished += 1
            self.counters.prompt_tokens += req.num_prompt_tokens
        self.output_processor.free(request_id)
        self._generators.pop(request_id, None)
        self._drafts.pop(request_id, None)
        for proposer in self.proposers.values():
            proposer.free(request_id)
        for controller in self.controllers.values():
            controller.free(request_id)

    # ---- drafts (speculation/draft_set.py does the work) -----------------------------------------------
    @property
    def router(self) -> DraftRouter | None:
        return self.drafts.router if self.drafts is not None else None

    def poll_drafts(self) -> None:
        """Install drafts that finished loading, move requests off drafts that failed to, unload idle
        ones. Runs every step; a server also calls it while idle."""
        if self.drafts is not None:
            self.drafts.update(list(self.requests.values()))

    def load_draft(self, model: str) -> str:
        """Start loading a draft model (registry name or path) in the background; returns its id.
        A load that fails is reported by draft_status() and the log, and requests skip the draft."""
        if self.drafts is None:
            raise ValueError("speculation is not configured on this engine")
        return self.drafts.add(model)

    def unload_draft(self, model: str) -> str:
        """Unload a loaded draft now; requests using it move to another proposer (or plain decoding)
        and keep going. Returns its id."""
        if self.drafts is None:
            raise ValueError("speculation is not configured on this engine")
        return self.drafts.unload(model, list(self.requests.values()))

    def draft_status(self) -> list[DraftStatus]:
        return self.drafts.status() if self.drafts is not None else []
