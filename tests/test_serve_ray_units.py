"""The pieces of the replicated deployment that need no Ray cluster: the serving config, the prefix
index behind affinity routing, the affinity text of a request, the merged /metrics page, the ASGI
relay a replica runs, and a replica whose draft fails to load serving plain decoding."""
from __future__ import annotations

import asyncio
import json
import random
from collections import Counter

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import engine_config
from specdec.config import AutoscalingConfig, ServerConfig, ServingConfig, SpeculativeConfig, load_yaml_config
from specdec.serve_ray.affinity import PrefixIndex
from specdec.serve_ray.balance import UNSENT_SECONDS, InFlight, pick_replica
from specdec.serve_ray.exposition import merge
from specdec.serve_ray.forward import Forwarded, Head, affinity_text, call_app, forwarded_headers


def test_serving_yaml_and_flags(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("serving:\n  replicas: 3\n  routing: random\n  ray_address: auto\n")
    serving = load_yaml_config(cfg)[2]
    assert serving.replicas == 3 and serving.routing == "random" and serving.on_ray
    cfg.write_text("serving:\n  autoscaling:\n    min_replicas: 1\n    max_replicas: 4\n"
                   "    target_ongoing_requests: 3\n")
    auto = load_yaml_config(cfg)[2].autoscaling
    assert auto == AutoscalingConfig(min_replicas=1, max_replicas=4, target_ongoing_requests=3)
    for text, needle in (("serving:\n  replica: 2\n", "serving.replica"),
                         ("serving:\n  autoscaling:\n    max: 2\n", "serving.autoscaling.max"),
                         ("serving:\n  replicas: 0\n", "serving.replicas"),
                         ("serving:\n  routing: nearest\n", "serving.routing"),
                         ("serving:\n  autoscaling:\n    min_replicas: 3\n    max_replicas: 2\n", "min_replicas")):
        cfg.write_text(text)
        with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
            load_yaml_config(cfg)
    assert not ServingConfig().on_ray

    from specdec.cli import build_parser
    from specdec.commands.serve import serve_configs
    a = build_parser().parse_args(["serve", "--replicas", "2", "--routing", "least_loaded", "--ray-address", "auto"])
    serving = serve_configs(a)[2]
    assert (serving.replicas, serving.routing, serving.ray_address) == (2, "least_loaded", "auto")
    cfg.write_text("serving:\n  autoscaling:\n    max_replicas: 2\n")
    with pytest.raises(ValueError, match="--replicas"):
        serve_configs(build_parser().parse_args(["serve", "--config", str(cfg), "--replicas", "2"]))
    with pytest.raises(ValueError, match="--routing picks among replicas"):
        serve_configs(build_parser().parse_args(["serve", "--routing", "random"]))


def test_replica_options_carry_scale_router_and_cpus():
    from specdec.serve_ray.launch import replica_options
    from specdec.serve_ray.router import PrefixAffinityRouter, RandomRouter
    eng = engine_config("m", max_batch_size=4, max_queued_requests=10)
    opts = replica_options(eng, ServerConfig(drain_seconds=7), ServingConfig(replicas=3, cpus_per_replica=2))
    assert opts["num_replicas"] == 3 and opts["ray_actor_options"] == {"num_cpus": 2}
    assert opts["max_ongoing_requests"] == 14 and opts["graceful_shutdown_timeout_s"] == 7
    assert opts["request_router_config"].request_router_class is PrefixAffinityRouter or \
        opts["request_router_config"].request_router_class.endswith("PrefixAffinityRouter")
    auto = replica_options(eng, ServerConfig(), ServingConfig(autoscaling=AutoscalingConfig(1, 3, 2.0, 0, 5),
                                                               routing="random"))
    assert "num_replicas" not in auto
    assert auto["autoscaling_config"]["max_replicas"] == 3 and auto["autoscaling_config"]["downscale_delay_s"] == 5
    assert str(auto["request_router_config"].request_router_class).endswith("RandomRouter") or \
        auto["request_router_config"].request_router_class is RandomRouter
    assert "request_router_config" not in replica_options(eng, ServerConfig(), ServingConfig(routing="least_loaded"))


def test_prefix_index_finds_the_replicas_of_the_longest_prefix():
    index = PrefixIndex(chunk_chars=8, max_entries=1000)
    index.insert("a" * 8 + "b" * 8 + "c" * 8, "r1")
    index.insert("a" * 8 + "x" * 8, "r2")
    assert index.match("a" * 8 + "b" * 8 + "c" * 8 + "next turn", {"r1", "r2"}) == (["r1"], 24)
    assert index.match("a" * 8 + "x" * 8 + "y" * 8, {"r1", "r2"}) == (["r2"], 16)
    assert index.match("a" * 8 + "b" * 8, {"r2"}) == (["r2"], 8)   # r1 gone: the shared chunk's other holder
    assert index.match("a" * 8, {"r1", "r2"}) == (["r1", "r2"], 8)   # first holder first
    assert index.match("short", {"r1", "r2"}) == ([], 0)       # no whole chunk
    assert index.match("z" * 30, {"r1", "r2"}) == ([], 0)
    index.forget("r2")
    assert index.match("a" * 8 + "x" * 8, {"r1", "r2"}) == (["r1"], 8)
    # a chat's first turn, shorter than a chunk, is found again when its next turn arrives
    turn1 = "<system>be brief\x1e<user>hi\x1e"
    index.insert(turn1, "r3")
    turn2 = turn1 + "<assistant>hello\x1e<user>more\x1e"
    assert index.match(turn2, {"r1", "r2", "r3"}) == (["r3"], len("<system>be brief<user>hi"))
    index.keep_only({"r3"})   # the replica set changed: r1's pieces are gone, r3's stay
    assert index.match("a" * 8, {"r1", "r3"}) == ([], 0) and index.match(turn2, {"r3"})[0] == ["r3"]
    small = PrefixIndex(chunk_chars=4, max_entries=3)
    small.insert("abcdefghijklmnop", "r1")   # 4 chunks, the oldest evicted
    assert len(small.entries) == 3 and small.match("abcdefgh", {"r1"}) == ([], 0)


def test_in_flight_counts_chosen_sent_and_finished_requests():
    now = [0.0]
    load = InFlight(clock=lambda: now[0])
    load.chosen("q1", "a")
    load.chosen("q2", "a")
    load.sent("q2", "b")      # Ray took the second choice: the count follows the request
    load.chosen("q3", "b")
    assert load.counts() == {"a": 1, "b": 2}
    load.finished("q3")
    load.finished("q-unknown")
    now[0] = UNSENT_SECONDS + 1   # q1 was never sent (cancelled while routing): it stops counting
    assert load.counts() == {"b": 1}
    load.keep_only({"a"})     # b left the replica set
    assert load.counts() == {}


def test_pick_replica_prefers_holders_within_the_imbalance_then_spreads():
    rng = random.Random(0)
    live = ["a", "b", "c"]
    assert pick_replica(["a"], live, Counter(a=4), 4, rng) == "a"        # 4 more than the idle ones: still a
    assert pick_replica(["a"], live, Counter(a=5, b=1), 4, rng) == "c"   # 5 more: the least loaded
    assert pick_replica(["a", "c"], live, Counter(a=5, c=1), 4, rng) == "c"   # the less loaded holder
    assert pick_replica(["a"], live, Counter(a=1), 0, rng) in ("b", "c")
    picks = {pick_replica([], live, Counter(a=3, b=3), 4, rng) for _ in range(50)}
    assert "c" in picks and picks <= set(live)        # new prefixes: the less loaded of two random
    assert pick_replica([], ["a"], Counter(), 4, rng) == "a"


def _deployment():
    from ray.serve._private.common import DeploymentID   # ray imports slowly: only in the tests that need it
    return DeploymentID(name="EngineReplica", app_name="specdec")


class _Replica:
    """What the router reads of a running replica: its id."""

    def __init__(self, unique_id: str) -> None:
        from ray.serve._private.common import ReplicaID
        self.replica_id = ReplicaID(unique_id, _deployment())


def _router(imbalance: int = 4):
    from ray.serve._private.common import DeploymentHandleSource
    from specdec.serve_ray.router import PrefixAffinityRouter
    router = PrefixAffinityRouter(deployment_id=_deployment(), handle_source=DeploymentHandleSource.UNKNOWN,
                                  use_replica_queue_len_cache=True)
    router.initialize_state(imbalance=imbalance)

    async def no_probe(replicas, backoff_index):   # fake replicas answer no queue-length probe
        return []
    router._probe_queue_lens = no_probe
    return router


async def _burst(router, replicas: list, text: str, n: int, first: int = 0) -> list[str]:
    """n requests of `text` routed at once (none finishes): the replica each went to."""
    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest
    served = []
    for i in range(first, first + n):
        pr = PendingRequest(args=[Forwarded("POST", "/v1/completions", affinity=text)], kwargs={},
                            metadata=RequestMetadata(request_id=f"r{i}", internal_request_id=f"q{i}"))
        ranks = await router.choose_replicas(replicas, pr)
        router.on_request_routed(pr, ranks[0][0].replica_id, None)
        served.append(ranks[0][0].replica_id.unique_id)
    return served


def test_a_restarted_replica_gets_the_hot_prefix_at_once():
    """The issue's case: 16 identical prompts per burst; after one replica dies and a new one is
    ready, the next burst is shared by the survivor and the new replica, not 16/0."""
    asyncio.run(_restart_scenario())


async def _restart_scenario() -> None:
    router, hot = _router(imbalance=4), "You are a helpful assistant. " * 10 + "Say hi."
    a, b, c = _Replica("a"), _Replica("b"), _Replica("c")
    router.update_replicas([a, b])
    first = await _burst(router, [a, b], hot, 16)
    assert 5 <= first.count("a") <= 11, first
    for i in range(16):
        router.on_request_completed(None, f"q{i}")
    router.on_replica_actor_died(b.replica_id)     # b is killed (SIGKILL) ...
    router.update_replicas([a])
    assert router.index.match(hot, {"a", "b"})[0] == ["a"]
    router.update_replicas([a, c])                 # ... and its replacement c is ready
    after = await _burst(router, [a, c], hot, 16, first=100)
    assert after.count("a") >= 5 and after.count("c") >= 5, after
    assert router.index.match(hot, {"a", "c"})[0] == ["a", "c"]    # the hot prefix now has two holders
    conversation = await _burst(router, [a, c], "a conversation of its own " * 10, 3, first=200)
    assert len(set(conversation)) == 1         # a prefix below the imbalance stays on one replica


def test_affinity_text_of_requests():
    chat = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert affinity_text("/v1/chat/completions", json.dumps(chat).encode()) == "<system>be brief\x1e<user>hi\x1e"
    assert affinity_text("/v1/completions", b'{"prompt": "def f():"}') == "def f():"
    response = {"instructions": "be brief", "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                                                      {"type": "function_call_output", "call_id": "c", "output": "3"}]}
    assert affinity_text("/v1/responses", json.dumps(response).encode()) == "<system>be brief\x1e<user>hi\x1e"
    assert affinity_text("/v1/responses", b'{"input": "hi"}') == "<user>hi\x1e"
    assert affinity_text("/v1/completions", b'{"prompt": ["first", "second"]}') == "first"
    assert affinity_text("/v1/completions", b'{"prompt": [1, 2, 3]}') == "[1, 2, 3]"
    # a cache scope comes first: requests of other scopes share no piece, so they do not follow each other
    salted = affinity_text("/v1/completions", b'{"prompt": "def f():", "cache_salt": "t1"}')
    keyed = affinity_text("/v1/completions", b'{"prompt": "def f():"}', key_scope="ab12")
    assert salted == "\x00t1\x1edef f():" and keyed == "ab12\x1edef f():"
    index = PrefixIndex(chunk_chars=4)
    index.insert(salted, "r1")
    assert index.match(keyed, {"r1"})[0] == [] and index.match(salted, {"r1"})[0] == ["r1"]
    for path, body in (("/v1/completions", b"not json"), ("/v1/models", b""), ("/v1/chat/completions", b"[1]"),
                       ("/v1/chat/completions", b'{"messages": "x"}')):
        assert affinity_text(path, body) == ""
    kept = forwarded_headers([(b"Host", b"h"), (b"Transfer-Encoding", b"chunked"), (b"content-length", b"9")], b"abc")
    assert kept == [(b"Host", b"h"), (b"content-length", b"3")]


def _page(requests: float, running: float, drafted: float, accepted: float) -> str:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    reg = CollectorRegistry()
    Counter("specdec_requests", "r", ["status"], registry=reg).labels("stop").inc(requests)
    Gauge("specdec_num_requests_running", "g", registry=reg).set(running)
    Gauge("specdec_spec_acceptance_rate", "a", ["proposer"], registry=reg).labels("ngram").set(accepted / drafted)
    Counter("specdec_spec_drafted_tokens", "d", ["proposer"], registry=reg).labels("ngram").inc(drafted)
    Counter("specdec_spec_accepted_tokens", "d", ["proposer"], registry=reg).labels("ngram").inc(accepted)
    Histogram("specdec_e2e", "h", buckets=(1, 2), registry=reg).observe(1.5)
    return generate_latest(reg).decode()


def test_merged_metrics_label_replicas_and_sum_what_adds_up():
    text = merge({"r1": _page(3, 1, 10, 5), "r2": _page(4, 2, 30, 25)}, "specdec_replicas 2\n")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples[("specdec_requests_total", (("replica", "r1"), ("status", "stop")))] == 3
    assert samples[("specdec_requests_total", (("replica", "all"), ("status", "stop")))] == 7
    assert samples[("specdec_num_requests_running", (("replica", "all"),))] == 3
    assert samples[("specdec_e2e_bucket", (("le", "2.0"), ("replica", "all")))] == 2
    assert samples[("specdec_spec_acceptance_rate", (("proposer", "ngram"), ("replica", "r2")))] == 25 / 30
    assert samples[("specdec_spec_acceptance_rate", (("proposer", "ngram"), ("replica", "all")))] == 30 / 40
    assert not any(name.endswith("_created") and ("replica", "all") in labels for name, labels in samples)
    assert samples[("specdec_replicas", ())] == 2


def _app(status: int = 200, chunks: tuple[bytes, ...] = (b"one", b"two"), fail: bool = False):
    seen = {}

    async def app(scope, receive, send):
        seen["scope"], seen["body"] = scope, (await receive())["body"]
        if fail:
            raise RuntimeError("boom")
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"x/y")]})
        for c in chunks:
            await send({"type": "http.response.body", "body": c, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        seen["disconnect"] = await receive()
    return app, seen


def test_call_app_relays_head_and_chunks_then_the_disconnect():
    async def run(app, request):
        return [item async for item in call_app(app, request, [(b"x-specdec-replica", b"r1")])]

    app, seen = _app()
    req = Forwarded("POST", "/v1/completions", b"a=1", [(b"content-type", b"application/json")], b"{}", "10.0.0.2")
    items = asyncio.run(run(app, req))
    assert items[0] == Head(200, [(b"content-type", b"x/y"), (b"x-specdec-replica", b"r1")])
    assert b"".join(items[1:]) == b"onetwo"  # chunks queued together travel as one
    assert seen["body"] == b"{}" and seen["scope"]["path"] == "/v1/completions"
    assert seen["scope"]["query_string"] == b"a=1" and seen["scope"]["client"] == ("10.0.0.2", 0)
    assert seen["disconnect"] == {"type": "http.disconnect"}

    async def first_only(app):
        gen = call_app(app, req)
        head = await gen.__anext__()
        await gen.aclose()  # the client went away after the head
        return head

    slow, seen = _app(chunks=(b"a",) * 3)
    assert asyncio.run(first_only(slow)).status == 200 and seen["disconnect"]["type"] == "http.disconnect"
    broken, _ = _app(fail=True)
    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(run(broken, req))


def test_a_replica_whose_draft_fails_to_load_serves_plain(tiny_qwen, tmp_path, caplog):
    from specdec.serve_ray.replica import build_engine
    bad = tmp_path / "draft.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)  # a corrupt draft file
    cfg = engine_config(str(tiny_qwen))
    cfg = type(cfg)(model=cfg.model, cache=cfg.cache, scheduler=cfg.scheduler,
                    speculative=SpeculativeConfig(draft_model=str(bad), num_speculative_tokens=2))
    engine, reason = build_engine(cfg)
    assert reason is not None and "failed to load" in reason and engine.config.speculative is None
    assert "serves plain decoding" in caplog.text
    engine, reason = build_engine(engine_config(str(tiny_qwen)))
    assert reason is None


def test_scale_out_bench_summaries_and_tables():
    import sys
    from pathlib import Path

    from specdec.bench.scale_out import _affinity_run, _replicas_summary
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # the docs generator: a repo tool
    import docs_report as report

    def turn(prompt, cached, replica, ttft=0.2):
        return {"ttft": ttft, "seconds": 1.0, "prompt_tokens": prompt, "cached_tokens": cached, "replica": replica}

    sticky = _affinity_run([[turn(40, 0, "a"), turn(80, 32, "a"), turn(120, 80, "a")], RuntimeError("HTTP 503")])
    assert sticky["failed"] == 1 and sticky["same_replica"] == 1.0
    assert sticky["hit_rate"] == 112 / 240 and sticky["later_hit_rate"] == 112 / 200
    moved = _affinity_run([[turn(40, 0, "a"), turn(80, 0, "b", 0.4), turn(120, 32, "a", 0.5)]])
    assert moved["same_replica"] == 0.0 and moved["later_ttft_p50"] == 0.4

    load = {"tokens_per_second": 100.0, "requests_per_second": 2.0, "ttft_p50": 0.1, "ttft_p99": 0.3,
            "e2e_p50": 1.0, "e2e_p99": 2.0, "failed": 0}
    runs = {"single": [load, load], "ray2": [{**load, "tokens_per_second": 150.0}, {"failed_to_start": "x"}]}
    summary = _replicas_summary(runs, ["single", "ray2"])
    assert summary["ray2"]["throughput_ratio"] == {"median": 1.5, "min": 1.5, "max": 1.5}
    data = {"mode": "replicas", "model": "m", "precision": "auto", "clients": 8, "max_tokens": 64,
            "cpus_per_replica": 1.0, "num_requests": 48, "routing": "affinity", "runs": runs, "summary": summary}
    assert "1.50× (1.50–1.50)" in report.view_replicas(data)
    assert report.command(data).startswith("specdec bench replicas --model m")
    spread = {"median": 0.5, "min": 0.4, "max": 0.6}
    arm = {k: spread for k in ("hit_rate", "later_hit_rate", "same_replica", "later_ttft_p50", "later_ttft_p99")}
    aff = {"mode": "affinity", "model": "m", "precision": "auto", "clients": 4, "max_tokens": 48,
           "cpus_per_replica": 0.5, "replicas": 4, "conversations": 16, "turns": 4,
           "runs": {"affinity": [{}], "random": [{}]},
           "summary": {"affinity": arm, "random": arm, "hit_rate_ratio": spread, "later_ttft_p50_ratio": spread}}
    assert "50 % (40–60)" in report.view_affinity(aff)
    assert "--replicas 4 --conversations 16 --turns 4" in report.command(aff)


def test_the_application_builder_reads_a_serve_config(tmp_path, monkeypatch):
    """`specdec.serve_ray.launch:app` (a RayService's import_path) builds the same deployment as
    `specdec serve --config`: replicas, autoscaling and router from the file's `serving` section."""
    from specdec.serve_ray import launch
    monkeypatch.setattr(launch, "metrics_board", lambda: "board")
    monkeypatch.setenv("SPECDEC_API_KEY", "sk-env")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("execution_config:\n  target_model: smollm2-135m-instruct\n  max_batch_size: 4\n"
                   "serving:\n  autoscaling: {min_replicas: 1, max_replicas: 3}\n  cpus_per_replica: 2\n")
    ingress = launch.app({"config": str(cfg)})._bound_deployment
    replica_app, board, server_cfg = ingress.init_args
    replicas = replica_app._bound_deployment
    engine_cfg, replica_server_cfg, model_name, replica_board = replicas.init_args
    assert (ingress.name, replicas.name, board, replica_board) == ("Ingress", "EngineReplica", "board", "board")
    assert replicas._deployment_config.autoscaling_config.max_replicas == 3
    assert replicas.ray_actor_options["num_cpus"] == 2 and engine_cfg.model.num_threads == 2
    assert server_cfg.api_key == replica_server_cfg.api_key == "sk-env" and model_name == "smollm2-135m-instruct"
