"""Autoscaling on ongoing requests (serving.autoscaling): one replica of SmolLM2-135M idle, a second
under a load above the target, back to one when the load is gone."""
from __future__ import annotations

import time
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

        with ThreadPoolExecutor(4) as pool:
            load = [pool.submit(long_request, i) for i in range(4)]  # 4 ongoing against a target of 1
            scaled = server.wait_replicas(2, timeout=90)
            assert [f.result() for f in load] == ["length"] * 4
        assert len(scaled) == 2
        assert len(server.wait_replicas(1, timeout=90)) == 1   # idle: back to the minimum
    finally:
        assert server.stop() == [], "processes of the Ray instance outlived the server"
