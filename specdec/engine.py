"""LLMEngine: add_request / abort / step over the scheduler, the speculator, the model runner and
the rejection sampler.

step() is the whole loop, as values crossing each seam: propose (a SpecStep: the drafts and each
request's plan) -> schedule (a SchedulerOutput: the drafts kept) -> run the target (logits) ->
verify (each request's tokens) -> commit. Plain decoding is the same loop without a speculator.
Everything speculation knows lives behind the Speculator (speculation/speculator.py); the server and
the metrics read `stats()`.
"""
from __future__ import annotations

import copy
import itertools
import logging
import secrets
import sys
import time
from dataclasses import replace

import torch

from specdec.config import EngineConfig
from specdec.core.kv_cache_manager import KVCacheManager
from specdec.core.outputs import ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from specdec.core.scheduler import QueueFull, Scheduler  # noqa: F401 - QueueFull: add_request's error, re-exported
from specdec.metrics import DraftStatus, EngineCounters, EngineStats, PoolStats
from specdec.models.llama import LlamaModel
from specdec.models.loader import LoadedModel, load_model
from specdec.output_processor import OutputProcessor
from specdec.precision import resolve_kv_cache, resolve_precision
from specdec.quant import kernel
from specdec.request import (
    Request,
    RequestOutput,
    RequestStats,
    RequestStatus,
    SpecOptions,
)
from specdec.runner.model_runner import ModelRunner, kv_cache_dtype
from specdec.runner.teacher import teacher_forcing
from specdec.runner.threads import thread_tuner
from specdec.sample.noise import noise_key
from specdec.sample.rejection_sampler import rejection_sample
from specdec.sample.sampler import request_seed, top_logprobs
from specdec.sample.structured import GrammarCompiler
from specdec.sample.verifier import Sampler, Verified, Verifier
from specdec.sampling_params import SamplingParams
from specdec.speculation import registry
from specdec.speculation import suffix_file
from specdec.speculation.speculator import Plan, SpecStep, Speculator

log = logging.getLogger("specdec")


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = True, loaded: LoadedModel | None = None,
                 draft_loaded: LoadedModel | None = None,
                 rejection_sampler: Sampler = rejection_sample) -> None:
        """`loaded` / `draft_loaded`: weights already in memory to reuse. `rejection_sampler`: the
        verification function (tests inject deliberately broken ones to show a check has power)."""
        if config.speculative is not None:  # an unknown method fails before any load
            config = replace(config, speculative=registry.resolve_config(config.speculative))
        config, why = resolve_precision(config, loaded)
        if progress and why != "set":
            print(f"precision: {config.model.precision} ({why})", file=sys.stderr)
        kv = resolve_kv_cache(config)
        if kv is not None:
            config, why = kv
            if progress:
                print(f"K/V cache: {config.cache.kv_cache_dtype} ({why})", file=sys.stderr)
        self.config = config
        mc, cc = config.model, config.cache
        self.device = torch.device(mc.device)
        # a coupled row's processing and pick in one native call where the CPU kernels build
        native = self.device.type == "cpu" and kernel.available()
        self.verifier = Verifier(rejection_sampler, picks=kernel.coupled_picks if native else None)
        self.loaded = loaded or load_model(mc.model, mc.precision, mc.device, progress, huge_pages=mc.huge_pages)
        cfg = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        if mc.chat_template is not None:
            self.tokenizer = self.tokenizer.with_chat_template(mc.chat_template)
        self.max_model_len = min(mc.max_model_len or cfg.max_position, cfg.max_position)
        self.kv = KVCacheManager(cc.target_cache_blocks, cc.block_size, cc.enable_prefix_caching)
        self.speculator: Speculator | None = None
        if config.speculative is not None:
            self.speculator = Speculator(config, self.loaded, self.max_model_len, draft_loaded, progress)
        spec = self.speculator
        self.scheduler = Scheduler(config.scheduler, cc, self.kv, self.max_model_len,
                                   spec.pools if spec else None, spec.reserve if spec else 0)
        self.runner = ModelRunner(LlamaModel(cfg, self.loaded.weights, self.max_model_len, self.device),
                                  cc.target_cache_blocks, cc.block_size, self.device,
                                  self.tokenizer.never_sample_ids, self.tokenizer.vocab_size, thread_tuner(mc),
                                  kv_cache_dtype(cc.kv_cache_dtype))
        self.kv_cache_dtype = str(self.runner.kv_dtype).removeprefix("torch.")   # what outputs record
        self.output_processor = OutputProcessor(self.tokenizer, self.max_model_len)
        self.grammars = GrammarCompiler(self.tokenizer, config.structured)
        self.counters = EngineCounters()
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._seeds = itertools.count()  # requests seeded from config.model.seed, in arrival order

    @property
    def precision(self) -> str:
        return self.config.model.precision

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, speculative: SpecOptions | None = None,
                    background: bool = False) -> Request:
        """Tokenize and queue a prompt. Raises ValueError (and queues nothing) on a bad request,
        QueueFull when the waiting queue is at its limit. `background`: low priority (admitted only
        when no other request waits, preempted first)."""
        params = params or SamplingParams()
        if params.seed is None:  # recorded in its stats, so that any output can be replayed
            params = replace(params, seed=self.draw_seed())
        if isinstance(prompt, str):
            ids, text = self.tokenizer.encode(prompt), prompt
        else:
            ids, text = list(prompt), None
            bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < self.tokenizer.vocab_size)]
            if bad:
                raise ValueError(f"token ids outside the vocabulary (0..{self.tokenizer.vocab_size - 1}): {bad[:5]}")
        bad = [t for t in params.logit_bias or () if t >= self.tokenizer.vocab_size]
        if bad:  # the server says so with param logit_bias; the library must not drop them silently
            raise ValueError(f"logit_bias: token ids outside the vocabulary (0..{self.tokenizer.vocab_size - 1}): "
                             f"{bad[:5]}")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        grammar = self.grammars.matcher(params.structured) if params.structured is not None else None
        method, domain = self._assign(speculative, ids, text)
        coupled = not params.greedy and self.config.sampling.coupling == "gumbel"
        req = Request(request_id, text, ids, params, spec_method=method,
                      spec_max_k=speculative.max_k if speculative else None, spec_domain=domain,
                      spec_history=[method] if method else [], background=background, grammar=grammar,
                      noise_key=noise_key(params.seed, params.choice) if coupled else None)
        self.scheduler.add_request(req)  # validates length and KV-pool fit
        if method is not None:
            self.speculator.admitted(method)
        self.requests[request_id] = req
        self.output_processor.add(req)
        self.verifier.add(request_id, params.seed)
        return req

    def draw_seed(self) -> int:
        """A seed for a request that brings none: from the engine's seed in arrival order (so a run
        reproduces), else from the OS."""
        if self.config.model.seed is not None:
            return request_seed(self.config.model.seed, next(self._seeds))
        return secrets.randbits(63)

    def _assign(self, opts: SpecOptions | None, ids: list[int], text: str | None
                ) -> tuple[str | None, str | None]:
        """(proposer id, domain guess) for a new request; (None, None): plain decoding."""
        if self.speculator is None:
            if opts is not None and opts.enabled and opts.method is not None:
                raise ValueError(f"speculative method {opts.method!r} is not available: this engine decodes plainly")
            return None, None
        return self.speculator.assign(opts, ids, text)

    def abort(self, request_id: str) -> None:
        if self.scheduler.abort(request_id) is not None:
            self._release(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        spec = self.speculator
        if spec is not None:
            spec.poll(list(self.requests.values()))
        t0 = time.perf_counter()
        proposed = spec.propose(self.scheduler.running) if spec is not None else None
        sched = self.scheduler.schedule(proposed.drafts if proposed is not None else None)
        for rid in sched.preempted_request_ids if spec is not None else []:
            spec.preempted(rid)
        if sched.is_empty:
            if proposed is not None:
                spec.end_step(proposed, sched, self.requests, None, 0.0)
            return []
        out = self.runner.execute(sched)
        verified = self.verifier.verify(sched, out, proposed.drafts if proposed is not None else None,
                                        self.requests)
        outputs = self._commit(sched, verified, out, proposed)
        if proposed is not None:
            spec.end_step(proposed, sched, self.requests, out, time.perf_counter() - t0)
        return outputs

    def _commit(self, sched: SchedulerOutput, verified: dict[str, Verified], out: ModelRunnerOutput,
                proposed: SpecStep | None) -> list[RequestOutput]:
        outputs = []
        for i, chunk in enumerate(sched.chunks):
            req = self.requests[chunk.request_id]
            self.scheduler.advance(chunk, req)
            result = verified.get(chunk.request_id)
            if result is not None:
                plan = proposed.plans.get(chunk.request_id) if proposed is not None else None
                rows = out.logits[out.cu_num_logits[i]:out.cu_num_logits[i + 1]]
                self._accept(req, chunk, result, rows, out.forward_seconds, plan)
            if not req.finished:
                self.kv.commit(req.request_id, req.all_token_ids[: req.num_computed_tokens], req.params.cache_scope)
            if chunk.num_logits or req.finished:
                outputs.append(self.output_processor.output(req, self._stats(req)))
            if req.finished:
                self._release(req.request_id)
        return outputs

    def _accept(self, req: Request, chunk: ScheduledChunk, result: Verified, raw_logits: torch.Tensor,
                forward_seconds: float, plan: Plan | None) -> None:
        """Append the emitted tokens one by one (a stop inside the block cuts it there), advance the
        grammar over them, then roll back the K/V of rejected drafts in the target; the speculator
        does the same in the proposer."""
        k, num_accepted = chunk.num_drafts, result.num_accepted
        decoding = bool(req.output_token_ids)
        now = time.perf_counter()
        req.first_token_time = req.first_token_time or now
        req.spec.verify_seconds += forward_seconds
        if k:
            self.counters.record_spec(self.speculator.name_of(req.spec_method), k, num_accepted)
        status: RequestStatus | None = None
        for j, token in enumerate(result.token_ids):
            req.output_token_ids.append(token)
            if req.params.logprobs is not None:
                req.logprobs.append(top_logprobs(raw_logits[j], token, req.params.logprobs))
            status = self.output_processor.check_stop(req, token)
            if status is not None:
                break
        if req.grammar is not None:
            req.grammar.commit(result.token_ids[: j + 1])
        if decoding:
            req.spec.decode_forwards += 1
            req.spec.decode_tokens += j + 1
        self.counters.generated_tokens += j + 1
        self.counters.target_forwards += 1
        rejected = k - num_accepted
        if status is not None:
            req.finish_time = now
            # its full blocks stay cached for later prompts (a rejected draft's K/V is not its token's)
            self.kv.commit(req.request_id, req.all_token_ids[: req.num_computed_tokens - rejected],
                           req.params.cache_scope)
            self.scheduler.finish(req, status)
        elif rejected:
            self.kv.rollback(req.request_id, rejected)
            req.num_computed_tokens -= rejected
        if self.speculator is not None:
            self.speculator.verified(req, plan, k, num_accepted, j + 1, decoding, finished=status is not None)

    def _stats(self, req: Request) -> RequestStats:
        spec, method, kv = self.speculator, req.spec_method, self.kv_cache_dtype
        if spec is None:
            return RequestStats.from_request(req, self.precision, kv_cache_dtype=kv)
        names = [spec.name_of(i) for i in req.spec_history]
        return RequestStats.from_request(req, self.precision, spec.kind_of(method),
                                         spec.name_of(method) if method else None, names, kv)

    def _release(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None and req.finished:
            self.counters.requests_finished += 1
            self.counters.prompt_tokens += req.num_prompt_tokens
            self.counters.cached_prompt_tokens += max(req.num_cached_tokens, 0)
        if req is not None and self.speculator is not None:
            self.speculator.free(req)
        self.output_processor.free(request_id)
        self.verifier.free(request_id)

    # ---- scoring ----------------------------------------------------------------------------
    def teacher_logits(self, prompt_token_ids: list[int], output_token_ids: list[int]) -> torch.Tensor:
        """Teacher forcing through the engine's own runner and KV pool (runner/teacher.py); no
        requests may be running."""
        if self.has_unfinished():
            raise RuntimeError("score_tokens borrows the engine's runner: wait until its requests finish")
        return teacher_forcing(self.runner, self.kv, self.config.scheduler.max_num_batched_tokens,
                               self.max_model_len, f"__score-{next(self._ids)}", prompt_token_ids, output_token_ids)

    # ---- drafts and stats ---------------------------------------------------------------------
    def poll_drafts(self) -> None:
        """Install drafts that finished loading, move requests off drafts that failed to, unload idle
        ones. Runs every step; a server also calls it while idle."""
        if self.speculator is not None:
            self.speculator.poll(list(self.requests.values()))

    def load_draft(self, model: str) -> str:
        """Start loading a draft model (registry name or path) in the background; returns its id.
        A load that fails is reported by draft_status() and the log, and requests skip the draft."""
        return self._speculator().load(model)

    def unload_draft(self, model: str) -> str:
        """Unload a loaded draft now; requests using it move to another proposer (or plain decoding)
        and keep going. Returns its id."""
        return self._speculator().unload(model, list(self.requests.values()))

    def save_suffix_cache(self, path: str) -> int:
        """Write the suffix cache to `path` (atomically); returns the tokens saved."""
        return suffix_file.save(path, self._speculator().suffix_cache(), self.tokenizer.fingerprint)

    def load_suffix_cache(self, path: str) -> int:
        """Replace the suffix cache with `path`'s (SuffixFileError, a ValueError, for a file it cannot
        trust: the cache stays as it was); returns the tokens loaded."""
        return suffix_file.load(path, self._speculator().suffix_cache(), self.tokenizer.fingerprint,
                                self.tokenizer.vocab_size)

    def draft_status(self) -> list[DraftStatus]:
        return self.speculator.status() if self.speculator is not None else []

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def request_ids(self) -> list[str]:
        return list(self.requests)

    def waiting_longer_than(self, seconds: float) -> list[str]:
        """Client requests queued more than `seconds` ago that have not started (preempted ones have)."""
        now = time.perf_counter()
        return [r.request_id for r in self.scheduler.waiting
                if r.num_preemptions == 0 and now - r.arrival_time > seconds]

    def stats(self) -> EngineStats:
        """A snapshot for the server, the metrics and tools: plain data, no engine internals."""
        sched = self.scheduler
        return EngineStats(self.loaded.name, self.precision, self.max_model_len, copy.deepcopy(self.counters),
                           len(sched.waiting), len(sched.background), len(sched.running), sched.num_preemptions,
                           PoolStats(self.kv.num_blocks, self.kv.num_free_blocks()),
                           self.speculator.stats() if self.speculator is not None else None)

    def _speculator(self) -> Speculator:
        if self.speculator is None:
            raise ValueError("speculation is not configured on this engine")
        return self.speculator
