"""Offline Python API: LLM(model=...).generate(prompts, params) and LLM.stream(prompt, params)."""
from __future__ import annotations

from collections.abc import Iterator, Sequence

from specdec.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from specdec.engine import LLMEngine
from specdec.models.loader import LoadedModel
from specdec.request import RequestOutput
from specdec.sample.rejection_sampler import rejection_sample
from specdec.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """A model ready to generate.

    >>> llm = LLM(model="qwen2.5-coder-0.5b-instruct")
    >>> out = llm.generate(["def fib(n):"], SamplingParams(max_tokens=32))[0]
    >>> out.text, out.finish_reason, out.stats.tokens_per_second
    """

    def __init__(self, model: str = ModelConfig.model, precision: str = ModelConfig.precision, device: str = "cpu",
                 max_model_len: int | None = None, num_threads: int | None = None,
                 chat_template: str | None = None, seed: int | None = None, huge_pages: bool = True,
                 cache: CacheConfig | None = None, scheduler: SchedulerConfig | None = None,
                 speculative: SpeculativeConfig | None = None, progress: bool = True,
                 config: EngineConfig | None = None, loaded: LoadedModel | None = None,
                 draft_loaded: LoadedModel | None = None, rejection_sampler=rejection_sample) -> None:
        """`speculative=None` decodes plainly. `precision="auto"` picks the fastest mode that meets the
        precision criterion and says which. `loaded` / `draft_loaded` reuse weights already in memory
        (another engine's) instead of loading again. `rejection_sampler`: see LLMEngine.
        `chat_template`: a Jinja file or text replacing the model's; `seed`: seeds the requests that
        carry no seed of their own (in submission order), so a run reproduces. `huge_pages=False` reads the
        int4 weights through the cache file's mapping, shared with other processes, instead of copying them
        into transparent huge pages (faster steps)."""
        config = config or EngineConfig(
            model=ModelConfig(model=model, precision=precision, device=device, max_model_len=max_model_len,
                              num_threads=num_threads, chat_template=chat_template, seed=seed,
                              huge_pages=huge_pages),
            cache=cache or CacheConfig(), scheduler=scheduler or SchedulerConfig(), speculative=speculative)
        self.engine = LLMEngine(config, progress=progress, loaded=loaded, draft_loaded=draft_loaded,
                                rejection_sampler=rejection_sampler)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 batch: bool = True) -> list[RequestOutput]:
        """Generate for each prompt; outputs in input order.

        batch=True submits every prompt at once (continuous batching); batch=False runs them one
        after another, which measures latency at batch size 1. Identical tokens either way."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        plist = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        if batch:
            ids = [self.engine.add_request(p, sp).request_id for p, sp in zip(prompts, plist)]
            return self._run(ids)
        results: list[RequestOutput] = []
        for p, sp in zip(prompts, plist):
            results += self._run([self.engine.add_request(p, sp).request_id])
        return results

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield an output each time new text is safe to show (`delta_text`); a tail that may still
        become a stop string is held back until it is resolved."""
        rid = self.engine.add_request(prompt, params).request_id
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        if out.delta_text or out.finished:
                            yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort(rid)

    def chat(self, messages: list[dict[str, str]], params: SamplingParams | None = None) -> RequestOutput:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate([self.tokenizer.encode(prompt, add_special_tokens=False)], params)[0]

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        pending = set(ids)
        while pending:
            for out in self.engine.step():
                if out.finished and out.request_id in pending:
                    final[out.request_id] = out
                    pending.discard(out.request_id)
        return [final[i] for i in ids]
