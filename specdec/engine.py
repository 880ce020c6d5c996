"""LLMEngine: add_request / abort / step over the scheduler, the model runner and the sampler.

step() is the whole loop: schedule -> run the target -> sample -> update. Everything else here is
bookkeeping of requests: detokenization, stop conditions, and outputs.
"""
from __future__ import annotations

import itertools
import time

import torch

from specdec.config import EngineConfig
from specdec.core.kv_cache_manager import KVCacheManager
from specdec.core.outputs import ModelRunnerOutput, SchedulerOutput
from specdec.core.scheduler import Scheduler
from specdec.models.llama import LlamaModel
from specdec.models.loader import LoadedModel, load_model
from specdec.models.tokenizer import IncrementalDetokenizer
from specdec.request import Request, RequestOutput, RequestStats, RequestStatus
from specdec.runner.model_runner import ModelRunner
from specdec.sample.logits_processors import process_logits
from specdec.sample.sampler import make_generator, sample_token, top_logprobs
from specdec.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = True, loaded: LoadedModel | None = None) -> None:
        self.config = config
        mc = config.model
        if mc.num_threads:
            torch.set_num_threads(mc.num_threads)
        self.device = torch.device(mc.device)
        self.loaded = loaded or load_model(mc.model, mc.precision, mc.device, progress)
        cfg = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = min(mc.max_model_len or cfg.max_position, cfg.max_position)
        model = LlamaModel(cfg, self.loaded.weights, self.max_model_len, self.device)
        cc = config.cache
        self.kv = KVCacheManager(cc.target_cache_blocks, cc.block_size, cc.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, cc, self.kv, self.max_model_len)
        self.runner = ModelRunner(model, cc.target_cache_blocks, cc.block_size, self.device,
                                  self.tokenizer.never_sample_ids, self.tokenizer.vocab_size)
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._emitted: dict[str, int] = {}
        self._text_end: dict[str, int] = {}  # where a stop string cut the text
        self._generators: dict[str, torch.Generator] = {}
        self._ids = itertools.count()

    @property
    def precision(self) -> str:
        return self.config.model.precision

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> Request:
        """Tokenize and queue a prompt. Raises ValueError (and queues nothing) on a bad request."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            text: str | None = prompt
        else:
            ids, text = list(prompt), None
            bad = [t for t in ids if not 0 <= t < self.tokenizer.vocab_size]
            if bad:
                raise ValueError(f"token ids outside the vocabulary (0..{self.tokenizer.vocab_size - 1}): {bad[:5]}")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        req = Request(request_id, text, ids, params)
        self.scheduler.add_request(req)  # validates length and KV-pool fit
        self.requests[request_id] = req
        self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        self._emitted[request_id] = 0
        self._generators[request_id] = make_generator(params.seed)
        return req

    def abort(self, request_id: str) -> None:
        if self.scheduler.abort(request_id) is not None:
            self._release(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        out = self.runner.execute(sched)
        return self._update(sched, out)

    def _update(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[RequestOutput]:
        outputs = []
        for i, chunk in enumerate(sched.chunks):
            req = self.requests[chunk.request_id]
            self.scheduler.advance(chunk, req)
            if chunk.num_logits:
                self._append_token(req, out.logits[out.cu_num_logits[i]])
            if not req.finished:
                self.kv.commit(req.request_id, req.all_token_ids[: req.num_computed_tokens])
            if chunk.num_logits or req.finished:
                outputs.append(self._output(req))
            if req.finished:
                self._release(req.request_id)
        return outputs

    def _append_token(self, req: Request, raw_logits: torch.Tensor) -> None:
        p = req.params
        processed = process_logits(raw_logits, p, req.prompt_token_ids, req.output_token_ids)
        token = sample_token(processed, p, self._generators[req.request_id])
        now = time.perf_counter()
        req.first_token_time = req.first_token_time or now
        req.output_token_ids.append(token)
        if p.logprobs is not None:
            req.logprobs.append(top_logprobs(raw_logits, token, p.logprobs))
        status = self._check_stop(req, token)
        if status is not None:
            req.finish_time = now
            self.scheduler.finish(req, status)

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        p = req.params
        detok = self._detok[req.request_id]
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.tokenizer.eos_token_ids):
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        before = len(detok.text)
        detok.add([token])
        if p.stop:
            text = detok.text
            window = max(map(len, p.stop)) - 1
            start = max(0, before - window)
            hits = [(text.find(s, start), s) for s in p.stop]
            hits = [(pos, s) for pos, s in hits if pos >= 0]
            if hits:
                pos, s = min(hits)
                self._text_end[req.request_id] = pos
                req.stop_reason = s
                return RequestStatus.FINISHED_STOPPED
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _output(self, req: Request) -> RequestOutput:
        text = self._detok[req.request_id].text[: self._text_end.get(req.request_id)]
        visible = len(text) if req.finished else len(text) - _stop_prefix_len(text, req.params.stop)
        start = self._emitted[req.request_id]
        delta = text[start:visible] if visible > start else ""
        self._emitted[req.request_id] = max(start, visible)
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids), text=text[:max(start, visible)], finished=req.finished,
            finish_reason=req.status.value if req.finished else None,
            stats=RequestStats.from_request(req, self.precision),
            logprobs=list(req.logprobs) if req.params.logprobs is not None else None, delta_text=delta)

    def _release(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self._detok.pop(request_id, None)
        self._emitted.pop(request_id, None)
        self._text_end.pop(request_id, None)
        self._generators.pop(request_id, None)


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of text that could still grow into a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
