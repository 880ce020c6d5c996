"""`specdec serve --replicas N`: the Ray Serve application (ingress + engine replicas + metrics
board), on a local Ray instance started and stopped here, or on a running cluster (--ray-address)."""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import sys
import threading
import time

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from specdec.config import EngineConfig, ServerConfig, ServingConfig, load_yaml_config
from specdec.serve_ray.ingress import IngressDeployment
from specdec.serve_ray.replica import PUSH_SECONDS, EngineReplica, MetricsBoard
from specdec.serve_ray.router import ROUTERS

log = logging.getLogger("specdec.serve_ray")
APP_NAME = "specdec"
_SETTLE_SECONDS = 5.0 + 2 * PUSH_SECONDS  # a drain's settling (server/lifecycle.py) and two metric pushes


def replica_options(engine: EngineConfig, server: ServerConfig, serving: ServingConfig) -> dict:
    """Ray Serve options of the replica deployment: CPUs, scale, router, health, drain."""
    sched = engine.scheduler
    options = {"name": "EngineReplica", "ray_actor_options": {"num_cpus": serving.cpus_per_replica},
               # Ray holds back nothing the engine would queue itself (its own queue answers 429)
               "max_ongoing_requests": sched.max_batch_size + sched.max_queued_requests,
               "health_check_period_s": 5, "health_check_timeout_s": 30,
               "graceful_shutdown_timeout_s": server.drain_seconds, "graceful_shutdown_wait_loop_s": 0.5}
    if serving.autoscaling is not None:
        a = serving.autoscaling
        options["autoscaling_config"] = {
            "min_replicas": a.min_replicas, "max_replicas": a.max_replicas, "initial_replicas": max(a.min_replicas, 1),
            "target_ongoing_requests": a.target_ongoing_requests, "upscale_delay_s": a.upscale_delay_s,
            "downscale_delay_s": a.downscale_delay_s, "look_back_period_s": 2.0}
    else:
        options["num_replicas"] = serving.replicas
    if serving.routing in ROUTERS:
        kwargs = {"imbalance": serving.imbalance} if serving.routing == "affinity" else {}
        options["request_router_config"] = RequestRouterConfig(request_router_class=ROUTERS[serving.routing],
                                                               request_router_kwargs=kwargs)
    return options


def build_application(engine: EngineConfig, server: ServerConfig, serving: ServingConfig, model_name: str, board):
    if engine.model.num_threads is None:  # each replica computes on the CPUs it reserved
        threads = max(1, int(serving.cpus_per_replica))
        engine = dataclasses.replace(engine, model=dataclasses.replace(engine.model, num_threads=threads))
    options = replica_options(engine, server, serving)
    replicas = serve.deployment(EngineReplica).options(**options)
    # the ingress only relays: Ray's default limit (5) would queue the sixth client behind a whole answer
    relayed = serving.max_replicas * options["max_ongoing_requests"]
    ingress = serve.deployment(IngressDeployment).options(name="Ingress", ray_actor_options={"num_cpus": 0},
                                                          max_ongoing_requests=relayed)
    return ingress.bind(replicas.bind(engine, server, model_name, board), board, server)


def metrics_board():
    """The deployment's MetricsBoard: a named detached actor, so that a builder run by Ray itself
    (a RayService) and `specdec serve` find the same one; taken down with the application."""
    return ray.remote(MetricsBoard).options(name=f"{APP_NAME}-metrics", namespace=APP_NAME, lifetime="detached",
                                            get_if_exists=True, num_cpus=0).remote()


def app(args: dict):
    """Ray Serve application builder: `serve run specdec.serve_ray.launch:app config=FILE`, or a
    RayService's import_path (deploy/rayservice.yaml). FILE is a `specdec serve --config` YAML."""
    engine, server, serving = load_yaml_config(args["config"])
    if server.api_key is None and os.environ.get("SPECDEC_API_KEY"):
        server = dataclasses.replace(server, api_key=os.environ["SPECDEC_API_KEY"])
    return build_application(engine, server, serving, engine.model.model.rsplit("/", 1)[-1], metrics_board())


def _connect(serving: ServingConfig) -> bool:
    """Join the cluster at serving.ray_address, or start a local one; True when it is ours to stop."""
    if serving.ray_address is not None:
        ray.init(address=serving.ray_address, namespace=APP_NAME, log_to_driver=False)
        return False
    ray.init(num_cpus=max(os.cpu_count() or 1, math.ceil(serving.max_replicas * serving.cpus_per_replica)),
             object_store_memory=serving.object_store_mb << 20, include_dashboard=serving.dashboard,
             namespace=APP_NAME, log_to_driver=False)
    return True


def run(engine: EngineConfig, server: ServerConfig, serving: ServingConfig, model_name: str) -> int:
    """Deploy, serve until SIGINT / SIGTERM, then take the application (and a local Ray) down."""
    local = _connect(serving)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs handlers of its own
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": server.host, "port": server.port})
        board = metrics_board()
        serve.run(build_application(engine, server, serving, model_name, board), name=APP_NAME, route_prefix="/",
                  blocking=False)
        scale = (f"{serving.autoscaling.min_replicas}-{serving.autoscaling.max_replicas} replicas (autoscaling)"
                 if serving.autoscaling else f"{serving.replicas} replica(s)")
        print(f"serving {engine.model.model} on http://{server.host}:{server.port} with {scale} on Ray "
              f"({'local' if local else serving.ray_address}), routing: {serving.routing}", file=sys.stderr)
        while not stop.wait(0.5):
            pass
        print("shutting down", file=sys.stderr)
        _drain(board, server.drain_seconds)
    finally:
        _teardown(local)
    return 0


def _drain(board, seconds: float) -> None:
    """Drain every replica's app as `specdec serve` drains its own: new work gets 503 with
    Retry-After, the requests in flight get `seconds`, then the rest end with an error event and
    `data: [DONE]`. Ray's own replica shutdown would cut the streams through its proxy."""
    try:
        ray.get(board.drain.remote())
        deadline = time.monotonic() + seconds + _SETTLE_SECONDS
        while not ray.get(board.drained.remote()) and time.monotonic() < deadline:
            time.sleep(0.2)
    except Exception as e:  # noqa: BLE001 - the teardown still runs
        log.warning("drain: %s", e)


def _teardown(local: bool) -> None:
    """Drain and remove the application; stop a local Ray instance (a cluster we joined stays)."""
    try:
        if local:
            serve.shutdown()
        else:
            serve.delete(APP_NAME)
            ray.kill(ray.get_actor(f"{APP_NAME}-metrics", namespace=APP_NAME))
    except Exception as e:  # noqa: BLE001 - still disconnect below
        log.warning("shutdown: %s", e)
    ray.shutdown()
