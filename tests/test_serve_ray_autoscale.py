"""Autoscaling on ongoing requests (serving.autoscaling): one replica of SmolLM2-135M idle, a second
under a load above the target, back to one when the load is gone."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from ray_server import SMOLLM, RayServer, config_yaml

pytestmark = pytest.mark.real_model


def test_replicas_follow_the_load(tmp_path):
    serving = ("  autoscaling:\n    min_replicas: 1\n    max_replicas: 2\n    target_ongoing_requests: 1\n"
               "    upscale_delay_s: 0\n    downscale_delay_s: 3\n")
    # Ray pushes the load figures autoscaling reads every 10 s by default: every second here
    push = {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
            "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1"}
    server = RayServer(tmp_path, config_yaml(serving), 1, env=push)
    try:
        c = server.client()

        def long_request(i: int) -> str:
            out = c.completions.create(model=SMOLLM, prompt=f"Chapter {i}. It was a dark night", max_tokens=300,
                                       temperature=0, extra_body={"ignore_eos": True})
            return out.choices[0].finish_reason

        # 4 ongoing against a target of 1, each thread sending the next as one ends, until the second
        # replica is up: a slow start of the replica never outlasts the load
        stop = threading.Event()

        def keep_loading(i: int) -> list[str]:
            done = []
            while not stop.is_set() and len(done) < 20:
                done.append(long_request(i))
            return done

        with ThreadPoolExecutor(4) as pool:
            load = [pool.submit(keep_loading, i) for i in range(4)]
            try:
                scaled = server.wait_replicas(2, timeout=90)
            finally:
                stop.set()  # each loader ends after its request in flight
            assert all(f.result() and set(f.result()) == {"length"} for f in load)
        assert len(scaled) == 2
        assert len(server.wait_replicas(1, timeout=90)) == 1   # idle: back to the minimum
    finally:
        assert server.stop() == [], "processes of the Ray instance outlived the server"
