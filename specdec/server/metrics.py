"""Prometheus metrics for the server (prometheus_client, its own registry).

Latency histograms and request counters are observed as requests finish; everything the engine
already counts (tokens, queue, blocks, preemptions, speculation per proposer) is read at scrape time
from its stats snapshot (`LLMEngine.stats()`, plain dataclasses) by a custom collector, so the
engine itself carries no Prometheus code and the server reads none of its internals.

Every series carries `model_name` (the served model, vLLM's label name), added as the page is
collected, so no family, the shadow A/B's included, can forget it."""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from specdec.metrics import EngineStats, SpeculationStats
from specdec.request import RequestOutput

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4)


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], EngineStats | None], model_name: str) -> None:
        """`snapshot`: the engine's stats between two steps, None while it loads (AsyncEngine.stats).
        `source` holds the series (register more there); `registry` is the page served, each series
        labelled model_name=`model_name`."""
        self.source = CollectorRegistry()
        self.registry = CollectorRegistry()
        self.registry.register(_ModelLabel(self.source, model_name))
        self.requests = Counter("specdec_requests", "Requests by final status (stop, length, abort, rejected_4xx)",
                                ["status"], registry=self.source)
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "Submission to first token",
                              buckets=_LATENCY_BUCKETS, registry=self.source)
        self.tpot = Histogram("specdec_time_per_output_token_seconds", "Decode time per output token after the first",
                              buckets=_TPOT_BUCKETS, registry=self.source)
        self.by_proposer = Counter("specdec_requests_by_proposer", "Finished requests by the proposer(s) that "
                                   "drafted for them (none: plain decoding)", ["proposer"], registry=self.source)
        self.e2e = Histogram("specdec_e2e_request_latency_seconds", "Submission to last token",
                             buckets=_LATENCY_BUCKETS, registry=self.source)
        self.source.register(_EngineCollector(snapshot))

    def finished(self, out: RequestOutput) -> None:
        s = out.stats
        self.requests.labels(out.finish_reason or "unknown").inc()
        for name in s.proposers_used or ["none"]:
            self.by_proposer.labels(name).inc()
        self.ttft.observe(s.ttft_seconds)
        self.e2e.observe(s.seconds)
        if s.generated_tokens > 1:
            self.tpot.observe((s.seconds - s.ttft_seconds) / (s.generated_tokens - 1))

    def rejected(self, status_code: int) -> None:
        self.requests.labels(f"rejected_{status_code}").inc()


class _ModelLabel:
    """A collector re-yielding every family of `source` with model_name added to each sample."""

    def __init__(self, source: CollectorRegistry, model_name: str) -> None:
        self.source, self.model_name = source, model_name

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            labelled.samples = [s._replace(labels={"model_name": self.model_name, **s.labels})
                                for s in family.samples]
            yield labelled


class _EngineCollector:
    def __init__(self, snapshot: Callable[[], EngineStats | None]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        if s is None:
            return
        spec = s.speculation
        yield from _engine_families(s, spec.num_proposer_errors if spec else 0)
        yield from _pool_families(s)
        yield from _acceptance_families(s)
        yield from _health_families(spec)
        yield from _draft_families(spec)
        yield from _router_families(spec)
        yield from _cache_families(spec)


def _engine_families(s: EngineStats, proposer_errors: int) -> Iterator[Metric]:
    c = s.counters
    yield _counter("specdec_prompt_tokens", "Prompt tokens of finished requests", c.prompt_tokens)
    yield _counter("specdec_prefix_cache_hit_tokens", "Prompt tokens of finished requests found in the prefix cache",
                   c.cached_prompt_tokens)
    yield _counter("specdec_generation_tokens", "Generated tokens", c.generated_tokens)
    yield _counter("specdec_target_forwards", "Target forward passes that produced tokens", c.target_forwards)
    yield _counter("specdec_preemptions", "Requests preempted (recomputed later)", s.num_preemptions)
    yield _counter("specdec_proposer_errors", "Proposer failures (speculation disabled for the requests)",
                   proposer_errors)
    yield _gauge("specdec_num_requests_waiting", "Requests waiting to be scheduled", s.num_waiting)
    yield _gauge("specdec_num_requests_running", "Requests running", s.num_running)


def _pool_families(s: EngineStats) -> Iterator[Metric]:
    """KV blocks per pool: the target's, and each draft's as `draft:<proposer id>`."""
    pools = {"target": s.target_pool,
             **{f"draft:{m}": p for m, p in (s.speculation.pools.items() if s.speculation else ())}}
    used = GaugeMetricFamily("specdec_kv_blocks_used", "KV blocks in use", labels=["pool"])
    free = GaugeMetricFamily("specdec_kv_blocks_free", "KV blocks free (cached prefix blocks count as free)",
                             labels=["pool"])
    for name, pool in pools.items():
        used.add_metric([name], pool.num_used)
        free.add_metric([name], pool.num_free)
    yield used
    yield free


def _acceptance_families(s: EngineStats) -> Iterator[Metric]:
    """Drafted and accepted tokens per proposer name, and acceptance by draft position."""
    drafted = CounterMetricFamily("specdec_spec_drafted_tokens", "Draft tokens proposed", labels=["proposer"])
    accepted = CounterMetricFamily("specdec_spec_accepted_tokens", "Draft tokens accepted", labels=["proposer"])
    rate = GaugeMetricFamily("specdec_spec_acceptance_rate", "Accepted / drafted", labels=["proposer"])
    mal = GaugeMetricFamily("specdec_spec_mean_accepted_length",
                            "Tokens per target forward in rounds that drafted", labels=["proposer"])
    pos = GaugeMetricFamily("specdec_spec_position_acceptance",
                            "Acceptance at draft position i given position i was reached",
                            labels=["proposer", "position"])
    for name, st in s.counters.by_proposer.items():
        d, a = st.drafted_tokens, st.accepted_tokens
        drafted.add_metric([name], d)
        accepted.add_metric([name], a)
        rate.add_metric([name], a / d if d else 0.0)
        rounds = st.reached[0] if st.reached else 0
        mal.add_metric([name], (a + rounds) / rounds if rounds else 1.0)
        for i, (r, h) in enumerate(zip(st.reached, st.accepted_at)):
            pos.add_metric([name, str(i)], h / r if r else 0.0)
    yield from (drafted, accepted, rate, mal, pos)


def _health_families(spec: SpeculationStats | None) -> Iterator[Metric]:
    """The health check's fallbacks, re-probes and resumes per loaded proposer (by name)."""
    fallbacks = CounterMetricFamily("specdec_spec_fallbacks", "Health-check fallbacks to plain decoding",
                                    labels=["proposer"])
    reprobes = CounterMetricFamily("specdec_spec_reprobes", "Re-probes with a small k", labels=["proposer"])
    resumes = CounterMetricFamily("specdec_spec_resumes", "Speculation resumed after a fallback",
                                  labels=["proposer"])
    for p in spec.proposers if spec else ():
        fallbacks.add_metric([p.name], p.num_fallbacks)
        reprobes.add_metric([p.name], p.num_reprobes)
        resumes.add_metric([p.name], p.num_resumes)
    yield from (fallbacks, reprobes, resumes)


def _draft_families(spec: SpeculationStats | None) -> Iterator[Metric]:
    state = GaugeMetricFamily("specdec_draft_state", "1 for each draft's current state", labels=["draft", "state"])
    for d in spec.drafts if spec else ():
        state.add_metric([d.id, d.state], 1)
    yield state
    lifecycle = (spec.num_loads, spec.num_unloads, spec.num_load_failures) if spec else (0, 0, 0)
    for name, doc, value in zip(("specdec_draft_loads", "specdec_draft_unloads", "specdec_draft_load_failures"),
                                ("Drafts loaded at run time", "Drafts unloaded", "Draft loads that failed"),
                                lifecycle):
        yield _counter(name, doc, value)


def _router_families(spec: SpeculationStats | None) -> Iterator[Metric]:
    router = (spec.router if spec else None) or {}
    gain = GaugeMetricFamily("specdec_router_gain", "Router: discounted mean decode tokens per unit cost",
                             labels=["domain", "proposer"])
    choices = CounterMetricFamily("specdec_router_choices", "Router: requests routed", labels=["domain", "proposer"])
    for domain, arms in router.items():
        for proposer, a in arms.items():
            gain.add_metric([domain, proposer], a["gain"])
            choices.add_metric([domain, proposer], a["choices"])
    yield from (gain, choices, _counter("specdec_router_switches", "Router: mid-request switches after an "
                                                                   "acceptance collapse",
                                        spec.num_router_switches if spec else 0))


def _cache_families(spec: SpeculationStats | None) -> Iterator[Metric]:
    """Shared draft caches (size and memory) and the drafts proposers took from lookups."""
    tokens = GaugeMetricFamily("specdec_draft_cache_tokens", "Tokens held by a shared draft cache", labels=["cache"])
    budget = GaugeMetricFamily("specdec_draft_cache_max_tokens", "A shared draft cache's token budget (per scope)",
                               labels=["cache"])
    scopes = GaugeMetricFamily("specdec_draft_cache_scopes", "Cache scopes (cache_salt or API key) a shared draft "
                               "cache keeps apart", labels=["cache"])
    memory = GaugeMetricFamily("specdec_draft_cache_bytes", "Approximate host memory of a shared draft cache",
                               labels=["cache"])
    seqs = GaugeMetricFamily("specdec_draft_cache_sequences", "Finished outputs held by a shared draft cache",
                             labels=["cache"])
    evicted = CounterMetricFamily("specdec_draft_cache_evictions", "Outputs evicted from a shared draft cache",
                                  labels=["cache"])
    for c in spec.caches if spec else ():
        tokens.add_metric([c.name], c.num_tokens)
        budget.add_metric([c.name], c.max_tokens)
        scopes.add_metric([c.name], c.num_scopes)
        memory.add_metric([c.name], c.approx_bytes)
        seqs.add_metric([c.name], c.num_sequences)
        evicted.add_metric([c.name], c.num_evicted)
    free_d = CounterMetricFamily("specdec_spec_free_drafted_tokens", "Draft tokens taken from a lookup, not a "
                                 "model forward (part of specdec_spec_drafted_tokens)", labels=["proposer"])
    free_a = CounterMetricFamily("specdec_spec_free_accepted_tokens", "Accepted draft tokens taken from a lookup",
                                 labels=["proposer"])
    for name, st in (spec.free_drafts if spec else {}).items():
        free_d.add_metric([name], st.drafted_tokens)
        free_a.add_metric([name], st.accepted_tokens)
    yield from (tokens, budget, scopes, memory, seqs, evicted, free_d, free_a)


def read_samples(text: str, keep_model_name: bool = False) -> dict[str, float]:
    """A /metrics page as {'name{labels}': value}, for clients that compare figures (the soak bench,
    the tests); the model_name label every series carries is dropped unless kept."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)$", line)
        if m:
            key = m.group(1) if keep_model_name else re.sub(r'model_name="[^"]*",?', "", m.group(1))
            out[key.replace(",}", "}").replace("{}", "")] = float(m.group(2))
    return out


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)
