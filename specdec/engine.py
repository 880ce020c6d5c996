"""LLMEngine: add_request / abort / step over the scheduler, the speculator, the model runner and
the rejection sampler.

step() is the whole loop: propose (plan k, draft) -> schedule -> run the target -> rejection-sample
-> update. Plain decoding is the same loop without a speculator. Everything speculation knows lives
behind the Speculator (speculation/speculator.py); the server and the metrics read `stats()`.
"""
from __future__ import annotations

import copy
import itertools
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from specdec.config import AUTO_CPU_PRECISION, AUTO_DRAFT_PRECISION, EngineConfig
from specdec.core.kv_cache_manager import KVCacheManager
from specdec.core.outputs import ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from specdec.core.scheduler import QueueFull, Scheduler  # noqa: F401 - QueueFull: add_request's error, re-exported
from specdec.metrics import DraftStatus, EngineCounters, EngineStats, PoolStats
from specdec.models.llama import LlamaModel
from specdec.models.loader import LoadedModel, gguf_identity, is_gguf, load_model
from specdec.output_processor import OutputProcessor
from specdec.quant import criterion, kernel
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
from specdec.sample.structured import GrammarCompiler, constrain, settle
from specdec.sampling_params import SamplingParams
from specdec.speculation import registry
from specdec.speculation.proposers.self_draft import is_self_draft
from specdec.speculation.speculator import Speculator

log = logging.getLogger("specdec")


def resolve_precision(config: EngineConfig, loaded: LoadedModel | None = None) -> tuple[EngineConfig, str]:
    """`precision: auto` -> a concrete mode, and why. Auto is the fastest mode that meets the precision
    criterion (quant/criterion.py: no further from float32 than llama.cpp, as `specdec kld` measured
    it) for a GGUF model on a CPU where the kernel builds; int4-a16 where the model has no verdict;
    float32 elsewhere. A model already loaded keeps its own precision. With the CPU mode, a draft model left at the target's
    precision runs in int4-a8: a draft's numbers never change the output (rejection sampling is
    exact for any draft), and integer dot products make its steps cheaper (not for self-speculation,
    which runs the target's own weights)."""
    mc, spec = config.model, config.speculative
    if mc.precision != "auto":
        return config, "set"
    if loaded is not None:
        precision, why = loaded.precision, "the loaded model's"
    elif not mc.device.startswith("cpu"):
        precision, why = "float32", f"device {mc.device}"
    elif not kernel.available():
        precision, why = "float32", f"the int4 kernel is unavailable: {kernel.unavailable_reason()}"
    elif not is_gguf(mc.model):
        precision, why = "float32", "int4 modes pack a GGUF file's quantized blocks"
    else:
        precision, why = criterion.auto_choice(gguf_identity(mc.model)) or (AUTO_CPU_PRECISION, (
            "no `specdec kld` verdict for this model: the GGUF's own weights, activations rounded to int16 on "
            "its K-quant matrices (near-lossless); float32 is the exact oracle"))
    config = replace(config, model=replace(mc, precision=precision))
    if (precision.startswith("int4") and spec is not None and spec.draft_precision is None
            and not is_self_draft(spec.draft_model)):
        config = replace(config, speculative=replace(spec, draft_precision=AUTO_DRAFT_PRECISION))
    return config, why


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = True, loaded: LoadedModel | None = None,
                 draft_loaded: LoadedModel | None = None,
                 rejection_sampler: Callable[..., tuple[torch.Tensor, torch.Tensor]] = rejection_sample) -> None:
        """`loaded` / `draft_loaded`: weights already in memory to reuse. `rejection_sampler`: the
        verification function (tests inject deliberately broken ones to show a check has power)."""
        if config.speculative is not None:  # an unknown method fails before any load
            config = replace(config, speculative=registry.resolve_config(config.speculative))
        config, why = resolve_precision(config, loaded)
        if progress and why != "set":
            print(f"precision: {config.model.precision} ({why})", file=sys.stderr)
        self.config = config
        self.rejection_sampler = rejection_sampler
        mc, cc = config.model, config.cache
        self.device = torch.device(mc.device)
        self.loaded = loaded or load_model(mc.model, mc.precision, mc.device, progress)
        cfg = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
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
                                  self.tokenizer.never_sample_ids, self.tokenizer.vocab_size, thread_tuner(mc))
        self.output_processor = OutputProcessor(self.tokenizer, self.max_model_len)
        self.grammars = GrammarCompiler(self.tokenizer)
        self.counters = EngineCounters()
        self.requests: dict[str, Request] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._ids = itertools.count()

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
        grammar = self.grammars.matcher(params.structured) if params.structured is not None else None
        method, domain = self._assign(speculative, ids, text)
        req = Request(request_id, text, ids, params, spec_method=method,
                      spec_max_k=speculative.max_k if speculative else None, spec_domain=domain,
                      spec_history=[method] if method else [], background=background, grammar=grammar)
        self.scheduler.add_request(req)  # validates length and KV-pool fit
        if method is not None:
            self.speculator.admitted(method)
        self.requests[request_id] = req
        self.output_processor.add(req)
        self._generators[request_id] = make_generator(params.seed)
        return req

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
        if spec is not None:
            spec.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        for rid in sched.preempted_request_ids if spec is not None else []:
            spec.preempted(rid)
        if sched.is_empty:
            return []
        out = self.runner.execute(sched)
        outputs = self._update(sched, out)
        if spec is not None:
            spec.end_step(sched, self.requests, out, time.perf_counter() - t0)
        return outputs

    def _update(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[RequestOutput]:
        sampled = [(i, c) for i, c in enumerate(sched.chunks) if c.num_logits]
        tokens, accepted = self._sample(sampled, out) if sampled else ([], [])
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
                row = out.logits[out.cu_num_logits[i]]
                if req.grammar is not None:
                    row = req.grammar.mask(row)
                row = process_logits(row, req.params, req.prompt_token_ids, req.output_token_ids)
                tokens.append([int(row.argmax())])
                if req.grammar is not None:
                    req.grammar.consume(tokens[-1])
            return tokens, [0] * n
        draft_ids = torch.full((n, max_k), -1, dtype=torch.long)
        num_draft = torch.zeros(n, dtype=torch.long)
        target = torch.zeros(n, max_k + 1, vocab)
        draft_probs = torch.zeros(n, max_k, vocab) if max_k else None
        greedy = torch.zeros(n, dtype=torch.bool)
        uniforms = torch.zeros(n, max_k)
        noise = torch.ones(n, max_k + 1, vocab)
        consumed = [0] * n   # drafts each request's grammar advanced over
        for r, (i, chunk) in enumerate(sampled):
            req = self.requests[chunk.request_id]
            k, p = chunk.num_drafts, req.params
            drafts = req.spec_token_ids
            rows = out.logits[out.cu_num_logits[i]:out.cu_num_logits[i + 1]]
            if req.grammar is not None:
                rows, consumed[r] = constrain(req.grammar, rows, drafts)
            for j in range(k + 1):
                target[r, j] = process_logits(rows[j], p, req.prompt_token_ids, req.output_token_ids + drafts[:j])
            if k:
                draft_ids[r, :k] = torch.tensor(drafts)
                num_draft[r] = k
                q = self.speculator.draft_probs(req)
                if q is None:  # one-hot drafts (n-gram, or a greedy draft)
                    draft_probs[r, torch.arange(k), draft_ids[r, :k]] = 1.0
                else:
                    draft_probs[r, :k, : q.shape[-1]] = q
            greedy[r] = p.greedy
            fill_random_inputs(None if p.greedy else self._generators[req.request_id], k, uniforms[r], noise[r])
        out_ids, num_accepted = self.rejection_sampler(draft_ids, num_draft, draft_probs, target, greedy, uniforms,
                                                       noise)
        tokens = [out_ids[r, : int(num_accepted[r]) + 1].tolist() for r in range(n)]
        for r, (_, chunk) in enumerate(sampled):
            grammar = self.requests[chunk.request_id].grammar
            if grammar is not None:
                settle(grammar, consumed[r], int(num_accepted[r]), tokens[r][-1])
        return tokens, num_accepted.tolist()

    def _accept(self, req: Request, chunk: ScheduledChunk, new: list[int], num_accepted: int,
                raw_logits: torch.Tensor, forward_seconds: float) -> None:
        """Append the emitted tokens one by one (a stop inside the block cuts it there), then roll
        back the K/V of rejected drafts in the target; the speculator does the same in the proposer."""
        k = chunk.num_drafts
        decoding = bool(req.output_token_ids)
        now = time.perf_counter()
        req.first_token_time = req.first_token_time or now
        req.spec.verify_seconds += forward_seconds
        if k:
            self.counters.record_spec(self.speculator.name_of(req.spec_method), k, num_accepted)
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
        self.counters.generated_tokens += j + 1
        self.counters.target_forwards += 1
        req.spec_token_ids, req.num_spec_tokens = [], 0
        rejected = k - num_accepted
        if status is not None:
            req.finish_time = now
            # its full blocks stay cached for later prompts (a rejected draft's K/V is not its token's)
            self.kv.commit(req.request_id, req.all_token_ids[: req.num_computed_tokens - rejected])
            self.scheduler.finish(req, status)
        elif rejected:
            self.kv.rollback(req.request_id, rejected)
            req.num_computed_tokens -= rejected
        if self.speculator is not None:
            self.speculator.verified(req, k, num_accepted, j + 1, decoding, finished=status is not None)

    def _stats(self, req: Request) -> RequestStats:
        spec, method = self.speculator, req.spec_method
        if spec is None:
            return RequestStats.from_request(req, self.precision)
        names = [spec.name_of(i) for i in req.spec_history]
        return RequestStats.from_request(req, self.precision, spec.kind_of(method),
                                         spec.name_of(method) if method else None, names)

    def _release(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None and req.finished:
            self.counters.requests_finished += 1
            self.counters.prompt_tokens += req.num_prompt_tokens
            self.counters.cached_prompt_tokens += max(req.num_cached_tokens, 0)
        if req is not None and self.speculator is not None:
            self.speculator.free(req)
        self.output_processor.free(request_id)
        self._generators.pop(request_id, None)

    # ---- scoring ----------------------------------------------------------------------------
    def teacher_logits(self, prompt_token_ids: list[int], output_token_ids: list[int]) -> torch.Tensor:
        """Teacher forcing: the raw float32 logits that predict each output token,
        [len(output_token_ids), vocab], through the engine's own runner and KV pool (no requests may
        be running). Quality tools score text with it."""
        if not prompt_token_ids:
            raise ValueError("score_tokens needs at least one prompt token")
        if self.has_unfinished():
            raise RuntimeError("score_tokens borrows the engine's runner: wait until its requests finish")
        all_ids = prompt_token_ids + output_token_ids
        if len(all_ids) > self.max_model_len:
            raise ValueError(f"{len(all_ids)} tokens exceed the engine's max_model_len {self.max_model_len}")
        inputs = all_ids[:-1]             # the last token predicts nothing we score
        first_scored = len(prompt_token_ids) - 1  # this position's logits predict the first output token
        kv = self.kv
        rid = f"__score-{next(self._ids)}"
        cached = kv.find_cached_prefix(prompt_token_ids)  # only ever ends before first_scored
        start = len(cached) * kv.block_size
        budget = self.config.scheduler.max_num_batched_tokens
        rows: list[torch.Tensor] = []
        try:
            kv.allocate(rid, len(inputs) - start, cached)
            for pos in range(start, len(inputs), budget):
                chunk_ids = inputs[pos:pos + budget]
                end = pos + len(chunk_ids)
                num_logits = max(0, end - max(pos, first_scored))  # the scored rows are a suffix of inputs
                chunk = ScheduledChunk(rid, chunk_ids, pos, list(kv.block_tables[rid]), num_logits)
                out = self.runner.execute(SchedulerOutput([chunk], len(chunk_ids), kv.take_pending_copies()))
                rows.append(out.logits[:num_logits].float())
        finally:
            kv.free(rid)
        logits = torch.cat(rows)
        assert logits.shape[0] == len(output_token_ids)
        return logits

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
