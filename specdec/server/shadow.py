"""Shadow A/B: a configured fraction of speculative requests is decoded again, plainly, in the
background, and the pair is compared on live traffic.

The copy is queued when the original finishes, at low priority (admitted only when no client request
waits, preempted first) and is never returned to anyone. Exported: exact-match rate of greedy
pairs (speculation is lossless, so anything below 1 is a bug or a lossy mode), the similarity of
the texts (optional monitor), and the speedup of speculation (decode tokens/s of the original over
its plain copy; the copy runs at low priority, so under load this leans optimistic). Off by default.
"""
from __future__ import annotations

import logging
import random
import statistics
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specdec.engine import QueueFull
from specdec.request import RequestOutput, SpecOptions
from specdec.sampling_params import SamplingParams
from specdec.server.async_engine import AsyncEngine

log = logging.getLogger("specdec.server")
PREFIX = "shadow-"


@dataclass
class _Pending:
    prompt_token_ids: list[int]
    params: SamplingParams
    original: RequestOutput | None = None


class ShadowAB:
    def __init__(self, engine: AsyncEngine, fraction: float, registry: CollectorRegistry, similarity: bool = False,
                 seed: int = 0, window: int = 256) -> None:
        self.engine = engine
        self.fraction = fraction
        self._rng = random.Random(seed)
        self._selected: dict[str, _Pending] = {}
        self._speedups: deque[float] = deque(maxlen=window)
        self._num_greedy = self._num_exact = 0
        self._similarity_model = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-shadow") if similarity else None
        if similarity:  # fail at start-up, not on the first shadowed request
            from specdec.quality.similarity import SimilarityModel
            try:
                self._similarity_model = SimilarityModel.load()
            except ImportError as e:
                raise ValueError(f"server.shadow_similarity: {e}") from None
        self.requests = Counter("specdec_shadow_requests", "Shadow copies by outcome (compared, skipped, failed)",
                                ["outcome"], registry=registry)
        self.greedy_pairs = Counter("specdec_shadow_greedy_pairs", "Greedy shadow pairs compared", registry=registry)
        self.exact = Counter("specdec_shadow_exact_matches", "Greedy pairs with identical tokens", registry=registry)
        self.exact_rate = Gauge("specdec_shadow_exact_match_rate", "Exact matches / greedy pairs", registry=registry)
        self.speedup = Gauge("specdec_shadow_speedup", f"Median decode tokens/s ratio, speculative over plain, "
                             f"over the last {window} pairs", registry=registry)
        self.similarity = Histogram("specdec_shadow_similarity", "Cosine similarity of original and plain texts",
                                    buckets=(0.5, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98, 0.99, 1.0), registry=registry)

    # ---- hooks (see AsyncEngine) ----------------------------------------------------------------
    def select(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               spec: SpecOptions | None) -> None:
        """A request was accepted: maybe shadow it (only speculative ones can be compared)."""
        if spec is not None and not spec.enabled:
            return
        if self._rng.random() < self.fraction:
            self._selected[request_id] = _Pending(list(prompt_token_ids), params)

    def finished(self, out: RequestOutput) -> None:
        """An output finished (engine thread, outside the engine lock)."""
        if out.request_id.startswith(PREFIX):
            self._compare(out)
            return
        pending = self._selected.pop(out.request_id, None)
        if pending is None:
            return
        if out.finish_reason == "abort" or out.stats.method == "none":
            self.requests.labels("skipped").inc()
            return
        pending.original = out
        shadow_id = PREFIX + out.request_id
        try:
            self.engine.submit_background(shadow_id, pending.prompt_token_ids, pending.params,
                                          SpecOptions(enabled=False))
        except (QueueFull, ValueError) as e:
            log.info("shadow copy of %s skipped: %s", out.request_id, e)
            self.requests.labels("skipped").inc()
            return
        self._selected[shadow_id] = pending

    def aborted(self, request_id: str) -> None:
        self._selected.pop(request_id, None)

    def _compare(self, plain: RequestOutput) -> None:
        pending = self._selected.pop(plain.request_id, None)
        if pending is None or pending.original is None:
            return
        if plain.finish_reason == "abort":
            self.requests.labels("failed").inc()
            return
        original = pending.original
        self.requests.labels("compared").inc()
        if pending.params.greedy:
            same = original.token_ids == plain.token_ids
            self._num_greedy += 1
            self._num_exact += same
            self.greedy_pairs.inc()
            self.exact.inc(same)
            self.exact_rate.set(self._num_exact / self._num_greedy)
            if not same:
                log.warning("shadow A/B: greedy output of %s differs from plain decoding", original.request_id)
        spec_rate, plain_rate = original.stats.decode_tokens_per_second, plain.stats.decode_tokens_per_second
        if spec_rate > 0 and plain_rate > 0:
            self._speedups.append(spec_rate / plain_rate)
            self.speedup.set(statistics.median(self._speedups))
        if self._executor is not None:  # embeddings cost CPU: off the engine thread
            self._executor.submit(self._similar, original.text, plain.text)

    def _similar(self, a: str, b: str) -> None:
        try:
            self.similarity.observe(self._similarity_model.cosine([a], [b])[0])
        except Exception:  # noqa: BLE001 - a monitor failure never touches serving
            log.exception("shadow similarity failed")
