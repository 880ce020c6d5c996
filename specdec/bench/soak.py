"""`specdec bench soak`: a `specdec serve` process under N concurrent clients for M minutes.

The clients (soak_clients.py) loop over a weighted mix: chat and streamed completions, streams and
non-streamed requests dropped mid-way, invalid requests (which must get a 4xx), n = 2 with logprobs,
stop strings, and speculation switched off per request; every answer is checked. Reports requests
by kind and outcome, latency p50 / p99, KV blocks in use after the run (every pool), the server's
resident memory once loaded, before (after a warm-up of the same mix, so that first-seen batch
shapes do not count as growth) and after, and the ERROR lines in its log; writes JSON and a PNG
(latency and memory over the run).
"""
from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from specdec.bench.serve_bench import percentile
from specdec.bench.soak_clients import EXPECTED, MIX, Outcome, Soak, client, request
from specdec.extras import require_plotting
from specdec.fileio import atomic_write_text
from specdec.prompts import SETS, read_set

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_clients(s: Soak, a, minutes: float, max_requests: int | None, desc: str) -> None:
    """a.clients threads sending the mix for `minutes` (or until max_requests are sent)."""
    from tqdm import tqdm
    start, budget = time.time(), [max_requests or -1]
    bar = tqdm(desc=desc, unit="req", file=sys.stderr)
    clients = [threading.Thread(target=client, args=(s, a.seed * 1000 + c, start + 60 * minutes, start, budget, bar))
               for c in range(a.clients)]
    for t in clients:
        t.start()
    for t in clients:
        t.join()
    bar.close()


def _metrics(s: Soak) -> dict[str, float]:
    conn, resp = request(s, "/metrics", b"", "GET")
    text = resp.read().decode()
    conn.close()
    from specdec.server.metrics import read_samples
    return read_samples(text)


def _served(s: Soak) -> dict:
    """/v1/models' card: the precision `auto` resolved to and the proposers loaded."""
    conn, resp = request(s, "/v1/models", b"", "GET")
    card = json.loads(resp.read())["data"][0]
    conn.close()
    return {k: card[k] for k in ("id", "precision", "speculative")}


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _wait_idle(s: Soak, timeout: float = 600) -> dict[str, float]:
    deadline = time.time() + timeout
    while True:
        m = _metrics(s)
        if not m.get("specdec_num_requests_running") and not m.get("specdec_num_requests_waiting"):
            return m
        if time.time() > deadline:
            raise TimeoutError("the server is still busy after the soak")
        time.sleep(0.5)


def _start_server(a, port: int, log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "specdec.cli", "serve", "--model", a.model, "--precision", a.precision,
           "--port", str(port), "--max-batch-size", str(a.max_batch_size)]
    if a.draft:
        cmd += ["--draft", a.draft]
    if a.threads:
        cmd += ["--threads", str(a.threads)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited early:\n{log_path.read_text()[-3000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError("the server did not get ready")


def summarize(outcomes: list[Outcome]) -> dict:
    by = {o: sum(x.outcome == o for x in outcomes) for o in ("ok", "rejected", "dropped", "failed")}
    kinds = {}
    for kind in MIX:
        mine = [x for x in outcomes if x.kind == kind]
        done = [x.seconds for x in mine if x.outcome == "ok"]
        kinds[kind] = {"requests": len(mine), "ok": len(done), "expected": sum(x.outcome == EXPECTED.get(kind, "ok")
                                                                              for x in mine),
                       "failed": sum(x.outcome == "failed" for x in mine),
                       "p50": percentile(done, 0.5), "p99": percentile(done, 0.99)}
    latencies = [x.seconds for x in outcomes if x.outcome == "ok"]
    return {"requests": len(outcomes), "by_outcome": by, "by_kind": kinds,
            "latency_p50": percentile(latencies, 0.5), "latency_p99": percentile(latencies, 0.99),
            "failures": [asdict(x) for x in outcomes if x.outcome == "failed"][:50]}


def run_soak_bench(a) -> dict:
    require_plotting(a.plot, "specdec bench soak")
    port = free_port()
    log_path = Path(a.out).with_suffix(".server.log")
    proc = _start_server(a, port, log_path)
    prompts = [p for name in a.sets.split(",") for p in read_set(name)[: a.num_prompts] if name in SETS]
    s = Soak(f"http://127.0.0.1:{port}", "127.0.0.1", port, a.max_tokens, prompts)
    try:
        rss_ready = _rss_mb(proc.pid)
        served = _served(s)
        # warm-up, not counted: the batch shapes, buffers and allocator arenas of a full mix, before the baseline
        _run_clients(s, a, a.warmup_minutes, None, "soak warm-up")
        s.outcomes.clear()
        _wait_idle(s)
        rss_before, start = _rss_mb(proc.pid), time.time()
        samples: list[tuple[float, float, float]] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(5):
                used = sum(v for k, v in _metrics(s).items() if k.startswith("specdec_kv_blocks_used"))
                samples.append((time.time() - start, _rss_mb(proc.pid), used))
        threading.Thread(target=sample, daemon=True).start()
        _run_clients(s, a, a.minutes, a.max_requests or None, "bench soak")
        _wait_idle(s)
        time.sleep(1.0)  # the last aborts reach the pools
        m, rss_after = _metrics(s), _rss_mb(proc.pid)
        stop.set()
    finally:
        proc.terminate()
        code = proc.wait(120)
    log = log_path.read_text(errors="replace").splitlines()
    report = {"model": a.model, "draft": a.draft, "precision": a.precision, "served": served, "clients": a.clients,
              "minutes": a.minutes, "max_requests": a.max_requests, "max_tokens": a.max_tokens,
              "max_batch_size": a.max_batch_size, "sets": a.sets, "num_prompts": a.num_prompts, "seed": a.seed,
              "warmup_minutes": a.warmup_minutes, "mix": MIX, "wall_seconds": time.time() - start,
              **summarize(s.outcomes),
              "kv_blocks_used_after": {k: v for k, v in m.items() if k.startswith("specdec_kv_blocks_used")},
              "rss_mb_ready": rss_ready, "rss_mb_before": rss_before, "rss_mb_after": rss_after,
              "rss_growth": rss_after / rss_before - 1, "error_log_lines": sum(" ERROR " in x or "Traceback" in x
                                                                                for x in log),
              "server_exit_code": code, "samples": samples}
    atomic_write_text(Path(a.out), json.dumps(report, indent=1))
    if a.plot:
        plot(report, s.outcomes, Path(a.plot))
    print(f"soak: {report['requests']} requests {report['by_outcome']}, p50 {report['latency_p50']}, "
          f"p99 {report['latency_p99']}, KV used after {report['kv_blocks_used_after']}, RSS "
          f"{rss_before:.0f} -> {rss_after:.0f} MB ({100 * report['rss_growth']:+.1f} %), "
          f"{report['error_log_lines']} ERROR lines; wrote {a.out}", file=sys.stderr)
    return report


def plot(report: dict, outcomes: list[Outcome], path: Path) -> None:
    import os

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lat, mem) = plt.subplots(1, 2, figsize=(12, 3.8))
    for kind in MIX:
        pts = [(o.at, o.seconds) for o in outcomes if o.kind == kind and o.outcome == "ok"]
        if pts:
            lat.scatter(*zip(*pts), s=6, label=kind)
    bad = [(o.at, o.seconds) for o in outcomes if o.outcome == "failed"]
    if bad:
        lat.scatter(*zip(*bad), s=20, marker="x", color="red", label="failed")
    lat.set_xlabel("start (s into the soak)")
    lat.set_ylabel("latency (s)")
    lat.legend(fontsize=6, ncol=2)
    if report["samples"]:
        t, rss, used = zip(*report["samples"])
        mem.plot(t, rss, label="server RSS (MB)")
        kv = mem.twinx()
        kv.plot(t, used, color="gray", alpha=0.6, label="KV blocks in use")
        kv.set_ylabel("KV blocks in use")
    mem.set_xlabel("s into the soak")
    mem.set_ylabel("RSS (MB)")
    fig.suptitle(f"soak: {report['clients']} clients, {report['requests']} requests, {report['by_outcome']}",
                 fontsize=9)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)
