"""Prometheus metrics for the server (prometheus_client, its own registry).

Latency histograms and request counters are observed as requests finish; everything the engine
already counts (tokens, queue, blocks, preemptions, speculation per proposer) is read from it at
scrape time by a custom collector, so the engine itself carries no Prometheus code."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specdec.request import RequestOutput
from specdec.server.async_engine import AsyncEngine

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4)


class ServerMetrics:
    def __init__(self, engine: AsyncEngine) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("specdec_requests", "Requests by final status (stop, length, abort, rejected_4xx)",
                                ["status"], registry=self.registry)
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "Submission to first token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("specdec_time_per_output_token_seconds", "Decode time per output token after the first",
                              buckets=_TPOT_BUCKETS, registry=self.registry)
        self.by_proposer = Counter("specdec_requests_by_proposer", "Finished requests by the proposer(s) that "
                                   "drafted for them (none: plain decoding)", ["proposer"], registry=self.registry)
        self.e2e = Histogram("specdec_e2e_request_latency_seconds", "Submission to last token",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(engine))

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


class _EngineCollector:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def collect(self):
        eng = self.engine.engine
        if eng is None:
            return
        with self.engine.lock:  # a consistent snapshot between two steps
            c = eng.counters
            sched = eng.scheduler
            pools = {"target": eng.kv, **{f"draft:{m}": kv for m, kv in sched.draft_pools.items()}}
            blocks = {name: (kv.num_blocks - kv.num_free_blocks(), kv.num_free_blocks()) for name, kv in pools.items()}
            spec = {name: (st.drafted_tokens, st.accepted_tokens, list(st.reached), list(st.accepted_at))
                    for name, st in c.by_proposer.items()}
            ctrl = {p.name: (eng.controllers[m].num_fallbacks, eng.controllers[m].num_reprobes,
                             eng.controllers[m].num_resumes) for m, p in eng.proposers.items()}
            drafts = [(d.id, d.state) for d in eng.draft_status()]
            ds = eng.drafts
            lifecycle = (ds.num_loads, ds.num_unloads, ds.num_load_failures) if ds else (0, 0, 0)
            router = eng.router.snapshot() if eng.router else {}
            switches = eng.router.num_switches if eng.router else 0
            snap = (c.prompt_tokens, c.generated_tokens, c.target_forwards, c.proposer_errors,
                    len(sched.waiting), len(sched.running), sched.num_preemptions)
        prompt, generated, forwards, errors, waiting, running, preemptions = snap
        yield _counter("specdec_prompt_tokens", "Prompt tokens of finished requests", prompt)
        yield _counter("specdec_generation_tokens", "Generated tokens", generated)
        yield _counter("specdec_target_forwards", "Target forward passes that produced tokens", forwards)
        yield _counter("specdec_preemptions", "Requests preempted (recomputed later)", preemptions)
        yield _counter("specdec_proposer_errors", "Proposer failures (speculation disabled for the requests)", errors)
        yield _gauge("specdec_num_requests_waiting", "Requests waiting to be scheduled", waiting)
        yield _gauge("specdec_num_requests_running", "Requests running", running)
        used = GaugeMetricFamily("specdec_kv_blocks_used", "KV blocks in use", labels=["pool"])
        free = GaugeMetricFamily("specdec_kv_blocks_free", "KV blocks free (cached prefix blocks count as free)",
                                 labels=["pool"])
        for name, (u, f) in blocks.items():
            used.add_metric([name], u)
            free.add_metric([name], f)
        yield used
        yield free
        drafted = CounterMetricFamily("specdec_spec_drafted_tokens", "Draft tokens proposed", labels=["proposer"])
        accepted = CounterMetricFamily("specdec_spec_accepted_tokens", "Draft tokens accepted", labels=["proposer"])
        rate = GaugeMetricFamily("specdec_spec_acceptance_rate", "Accepted / drafted", labels=["proposer"])
        mal = GaugeMetricFamily("specdec_spec_mean_accepted_length",
                                "Tokens per target forward in rounds that drafted", labels=["proposer"])
        pos = GaugeMetricFamily("specdec_spec_position_acceptance",
                                "Acceptance at draft position i given position i was reached",
                                labels=["proposer", "position"])
        for name, (d, a, reached, acc_at) in spec.items():
            drafted.add_metric([name], d)
            accepted.add_metric([name], a)
            rate.add_metric([name], a / d if d else 0.0)
            rounds = reached[0] if reached else 0
            mal.add_metric([name], (a + rounds) / rounds if rounds else 1.0)
            for i, (r, h) in enumerate(zip(reached, acc_at)):
                pos.add_metric([name, str(i)], h / r if r else 0.0)
        fallbacks = CounterMetricFamily("specdec_spec_fallbacks", "Health-check fallbacks to plain decoding",
                                        labels=["proposer"])
        reprobes = CounterMetricFamily("specdec_spec_reprobes", "Re-probes with a small k", labels=["proposer"])
        resumes = CounterMetricFamily("specdec_spec_resumes", "Speculation resumed after a fallback",
                                      labels=["proposer"])
        for name, (fb, rp, rs) in ctrl.items():
            fallbacks.add_metric([name], fb)
            reprobes.add_metric([name], rp)
            resumes.add_metric([name], rs)
        yield from (drafted, accepted, rate, mal, pos, fallbacks, reprobes, resumes)
        state = GaugeMetricFamily("specdec_draft_state", "1 for each draft's current state", labels=["draft", "state"])
        for draft, st in drafts:
            state.add_metric([draft, st], 1)
        yield state
        for name, doc, value in zip(("specdec_draft_loads", "specdec_draft_unloads", "specdec_draft_load_failures"),
                                    ("Drafts loaded at run time", "Drafts unloaded", "Draft loads that failed"),
                                    lifecycle):
            yield _counter(name, doc, value)
        gain = GaugeMetricFamily("specdec_router_gain", "Router: discounted mean decode tokens per unit cost",
                                 labels=["domain", "proposer"])
        choices = CounterMetricFamily("specdec_router_choices", "Router: requests routed", labels=["domain", "proposer"])
        for domain, arms in router.items():
            for proposer, a in arms.items():
                gain.add_metric([domain, proposer], a["gain"])
                choices.add_metric([domain, proposer], a["choices"])
        yield from (gain, choices, _counter("specdec_router_switches", "Router: mid-request switches after an "
                                                                       "acceptance collapse", switches))


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)
