"""`specdec serve` on a local Ray instance of its own, for the replicated-deployment tests: Ray's
files under a short temporary folder (its sockets' paths must stay short), and on stop a check that
none of that instance's processes outlived the server."""
from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path

from server_process import ServerProcess

SMOLLM = "smollm2-135m-instruct"


class RayServer(ServerProcess):
    def __init__(self, directory: Path, yaml: str, replicas: int, api_key: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.ray_dir = tempfile.mkdtemp(prefix="sdray")
        cfg = directory / "config.yaml"
        cfg.write_text(yaml)
        super().__init__(["--config", str(cfg)], directory / "server.log", api_key=api_key, timeout=400,
                         env={"RAY_TMPDIR": self.ray_dir, "RAY_USAGE_STATS_ENABLED": "0", **(env or {})})
        self.wait_replicas(replicas)

    def wait_replicas(self, n: int, timeout: float = 120) -> dict[str, int]:
        """{replica id: pid} once exactly n replicas report metrics."""
        deadline = time.time() + timeout
        while True:
            live = self.replicas()
            if len(live) == n:
                return live
            if time.time() > deadline:
                raise TimeoutError(f"{len(live)} replicas, not {n}, after {timeout}s: {live}")
            time.sleep(0.5)

    def replicas(self) -> dict[str, int]:
        return {m.group(1): int(m.group(2)) for key in self.metrics()
                if (m := re.match(r'specdec_replica_info\{replica="(\w+)",pid="(\d+)"\}', key))}

    def leftovers(self) -> list[int]:
        """Processes still running from this server's Ray instance."""
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if self.ray_dir.encode() in cmd:
                found.append(int(pid))
        return found

    def stop(self, timeout: float = 90) -> list[int]:
        """Stop (SIGTERM, as a user would); returns the processes that outlived it (then killed)."""
        super().stop(timeout)
        time.sleep(1)
        left = self.leftovers()
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.ray_dir, ignore_errors=True)
        return left


def config_yaml(serving: str, max_body: int = 1 << 20) -> str:
    return (f"execution_config:\n  target_model: {SMOLLM}\n  precision: float32\n  draft_model: ngram\n"
            f"  speculation_length: 3\n  max_batch_size: 8\n  max_queued_requests: 32\n"
            f"  cache_config:\n    target_cache_blocks: 512\n"
            f"server:\n  max_body_bytes: {max_body}\n  drain_seconds: 2\n"
            f"serving:\n{serving}")
