"""`specdec bench soak`: a `specdec serve` process (or `--replicas N` engine replicas on Ray) under
N concurrent clients for M minutes.

The clients (soak_clients.py) loop over a weighted mix: chat and streamed completions, streams and
non-streamed requests dropped mid-way, invalid requests (which must get a 4xx), n = 2 with logprobs,
stop strings, and speculation switched off per request; every answer is checked. Reports requests
by kind and outcome, latency p50 / p99, KV blocks in use after the run (every pool, every replica),
the server's resident memory once loaded (the replicas' with --replicas), before (after a warm-up of
the same mix, so that first-seen batch shapes do not count as growth) and after, and the ERROR lines
in its log; writes JSON and a PNG (latency and memory over the run).

`--kill-replica-at S` SIGKILLs one replica S seconds into the run: the requests that failed on it
while it died are counted as `killed` (in flight on it), apart from any other failure.

`--check-outputs` soaks a fixed pool of bodies instead (greedy, seeded sampled with n = 1 and 2,
JSON schema, tools, cache salts; streamed and whole), each first recorded alone with speculation
off, and counts a completed answer that differs from its reference as `wrong` (soak_checked.py);
`--bodies-per-kind` sizes the pool.
"""
from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

from specdec.bench.serve_bench import percentile
from specdec.bench.soak_checked import build_pool, record_references
from specdec.bench.soak_clients import EXPECTED, MIX, Outcome, Soak, client, mix_of, request
from specdec.extras import require_plotting
from specdec.fileio import atomic_write_text
from specdec.prompts import SETS, read_set

_ERROR_LINE = re.compile(r"(^|\s)ERROR\s|Traceback")  # ours (" ERROR ") and Ray's ("ERROR 2026-...")
_REPLICA_INFO = re.compile(r'specdec_replica_info\{replica="(\w+)",pid="(\d+)"\}')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_clients(s: Soak, a, minutes: float, max_requests: int | None, desc: str, start: float) -> None:
    """a.clients threads sending the mix for `minutes` (or until max_requests are sent)."""
    from tqdm import tqdm
    budget = [max_requests or -1]
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


def _total(m: dict[str, float], name: str) -> float:
    """A family's value over the server: its one sample, or the sum of the replicas' (not "all")."""
    return sum(v for k, v in m.items() if (k == name or k.startswith(name + "{")) and 'replica="all"' not in k)


def _served(s: Soak) -> dict:
    """/v1/models' card: the precision `auto` resolved to and the proposers loaded."""
    conn, resp = request(s, "/v1/models", b"", "GET")
    card = json.loads(resp.read())["data"][0]
    conn.close()
    return {k: card[k] for k in ("id", "precision", "speculative")}


def _replica_pids(s: Soak) -> dict[str, int]:
    return {m.group(1): int(m.group(2)) for k in _metrics(s) if (m := _REPLICA_INFO.match(k))}


def _rss_mb(pids: list[int]) -> dict[int, float]:
    """Resident MB of each process still alive."""
    rss = {}
    for pid in pids:
        try:
            lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        except OSError:
            continue
        rss.update({pid: int(x.split()[1]) / 1024 for x in lines if x.startswith("VmRSS:")})
    return rss


def _wait_idle(s: Soak, timeout: float = 600) -> dict[str, float]:
    deadline = time.time() + timeout
    while True:
        m = _metrics(s)
        if not _total(m, "specdec_num_requests_running") and not _total(m, "specdec_num_requests_waiting"):
            return m
        if time.time() > deadline:
            raise TimeoutError("the server is still busy after the soak")
        time.sleep(0.5)


def _wait_replicas(s: Soak, n: int, killed: set[str], timeout: float = 180) -> int:
    """The number of live replicas once n report and none of them was killed (or at the timeout)."""
    deadline = time.time() + timeout
    while (len(live := _replica_pids(s)) != n or killed & set(live)) and time.time() < deadline:
        time.sleep(1.0)
    return len(set(live) - killed)


def _start_server(a, s: Soak, log_path: Path, ray_dir: str | None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "specdec.cli", "serve", "--model", a.model, "--precision", a.precision,
           "--port", str(s.port), "--max-batch-size", str(a.max_batch_size)]
    if a.draft:
        cmd += ["--draft", a.draft]
    if a.policy != "cost_model":  # e.g. fixed: every step drafts k, so every output carries verified drafts
        cmd += ["--spec-policy", a.policy, "-k", str(a.k)]
    if a.threads:
        cmd += ["--threads", str(a.threads)]
    env = dict(os.environ)
    if ray_dir is not None:  # Ray's files (and logs) under a folder of this run's own
        cmd += ["--replicas", str(a.replicas)]
        env.update(RAY_TMPDIR=ray_dir, RAY_USAGE_STATS_ENABLED="0")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited early:\n{log_path.read_text()[-3000:]}")
        try:
            conn = http.client.HTTPConnection(s.host, s.port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200 and (ray_dir is None or len(_replica_pids(s)) == a.replicas):
                return proc
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError("the server did not get ready")


def _kill_later(s: Soak, at: float, kills: list[dict]) -> threading.Timer:
    """SIGKILL one replica (the first by id) at `at` (time.time()); recorded in `kills`."""
    def kill() -> None:
        replica, pid = sorted(_replica_pids(s).items())[0]
        os.kill(pid, signal.SIGKILL)
        kills.append({"replica": replica, "pid": pid, "at": time.time()})
    timer = threading.Timer(max(0.0, at - time.time()), kill)
    timer.start()
    return timer


def summarize(outcomes: list[Outcome], mix: dict[str, int] = MIX) -> dict:
    by = {o: sum(x.outcome == o for x in outcomes) for o in ("ok", "rejected", "dropped", "wrong", "failed", "killed")}
    kinds = {}
    for kind in mix:
        mine = [x for x in outcomes if x.kind == kind]
        done = [x.seconds for x in mine if x.outcome == "ok"]
        kinds[kind] = {"requests": len(mine), "ok": len(done), "expected": sum(x.outcome == EXPECTED.get(kind, "ok")
                                                                              for x in mine),
                       "wrong": sum(x.outcome == "wrong" for x in mine),
                       "failed": sum(x.outcome == "failed" for x in mine),
                       "p50": percentile(done, 0.5), "p99": percentile(done, 0.99)}
    latencies = [x.seconds for x in outcomes if x.outcome == "ok"]
    return {"requests": len(outcomes), "by_outcome": by, "by_kind": kinds,
            "latency_p50": percentile(latencies, 0.5), "latency_p99": percentile(latencies, 0.99),
            "failures": [asdict(x) for x in outcomes if x.outcome == "failed"][:50],
            "killed_requests": [asdict(x) for x in outcomes if x.outcome == "killed"][:50]}


def mark_killed(outcomes: list[Outcome], kill: dict, start: float) -> None:
    """A failed request answered by the killed replica and running when it died was in flight on it.
    A wrong one stays wrong: a complete answer must be right whoever served it."""
    at = kill["at"] - start
    for o in outcomes:
        if o.outcome == "failed" and o.replica == kill["replica"] and o.at <= at <= o.at + o.seconds:
            o.outcome = "killed"


def soak(s: Soak, a, server_pid: int | None) -> dict:
    """The warm-up, then the measured run (killing a replica if a.kill_replica_at), on the server at
    `s`: one process (`server_pid`) or replicas (None: their pids from /metrics)."""
    pids = (lambda: [server_pid]) if server_pid is not None else (lambda: list(_replica_pids(s).values()))
    rss_ready = sum(_rss_mb(pids()).values())
    reference_seconds = record_references(s, s.checked) if s.checked is not None else 0.0
    # warm-up, not counted: the batch shapes, buffers and allocator arenas of a full mix, before the baseline
    _run_clients(s, a, a.warmup_minutes, None, "soak warm-up", time.time())
    warmup_wrong = sum(o.outcome == "wrong" for o in s.outcomes)   # not counted, but never hidden
    s.outcomes.clear()
    idle = _wait_idle(s)
    rss_before, start, kills = _rss_mb(pids()), time.time(), []
    samples: list[tuple[float, float, float]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(5):
            used = _total(_metrics(s), "specdec_kv_blocks_used")
            samples.append((time.time() - start, sum(_rss_mb(pids()).values()), used))
    threading.Thread(target=sample, daemon=True).start()
    timer = _kill_later(s, start + a.kill_replica_at, kills) if a.kill_replica_at is not None else None
    _run_clients(s, a, a.minutes, a.max_requests or None, "bench soak", start)
    if timer is not None:
        timer.cancel()
    wall = time.time() - start
    replicas_after = _wait_replicas(s, a.replicas, {k["replica"] for k in kills}) if server_pid is None else 1
    _wait_idle(s)
    time.sleep(1.5)  # the last aborts reach the pools, and each replica pushes its page
    m, rss_after = _metrics(s), _rss_mb(pids())
    stop.set()
    for kill in kills:
        mark_killed(s.outcomes, kill, start)
    used = lambda page: {k: v for k, v in page.items() if k.startswith("specdec_kv_blocks_used")}  # noqa: E731
    common = set(rss_before) & set(rss_after)
    checked = ({**s.checked.report(reference_seconds), "warmup_wrong": warmup_wrong} if s.checked is not None
               else {"check_outputs": False})
    return {"wall_seconds": wall, **summarize(s.outcomes, mix_of(s)), **checked,
            "kill_replica_at": a.kill_replica_at,
            "killed_replicas": [{**k, "at": k["at"] - start} for k in kills], "replicas_after": replicas_after,
            "kv_blocks_used_idle": used(idle), "kv_blocks_used_after": used(m),
            "kv_blocks_leaked": {k: v for k, v in used(m).items() if v > used(idle).get(k, 0.0)},
            "ingress": {k: v for k, v in m.items() if k.startswith("specdec_ingress_")},  # replica failures, retries
            "spec_tokens": {k: v - idle.get(k, 0.0) for k, v in m.items()   # drafted, accepted in the run
                            if k.startswith(("specdec_spec_drafted_tokens", "specdec_spec_accepted_tokens"))},
            "rss_mb_ready": rss_ready, "rss_mb_before": sum(rss_before.values()),
            "rss_mb_after": sum(rss_after.values()),
            "rss_growth": sum(rss_after[p] for p in common) / max(1e-9, sum(rss_before[p] for p in common)) - 1,
            "samples": samples}


def _error_lines(paths: list[Path]) -> int:
    return sum(bool(_ERROR_LINE.search(line)) for p in paths for line in p.read_text(errors="replace").splitlines())


def _leftovers(marker: str) -> list[int]:
    """Processes still running whose command line names `marker` (this run's Ray folder)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found


def run_soak_bench(a) -> dict:
    require_plotting(a.plot, "specdec bench soak")
    port, log_path = free_port(), Path(a.out).with_suffix(".server.log")
    ray_dir = tempfile.mkdtemp(prefix="sdsoak") if a.replicas > 1 else None
    prompts = [p for name in a.sets.split(",") for p in read_set(name)[: a.num_prompts] if name in SETS]
    s = Soak(f"http://127.0.0.1:{port}", "127.0.0.1", port, a.max_tokens, prompts)
    if a.check_outputs:
        s.checked = build_pool(prompts, a.bodies_per_kind, a.max_tokens, a.seed)
    proc = _start_server(a, s, log_path, ray_dir)
    try:
        served = _served(s)
        result = soak(s, a, proc.pid if ray_dir is None else None)
    finally:
        proc.terminate()
        code = proc.wait(180)
    ray_logs = sorted(Path(ray_dir).glob("ray/session_*/logs/serve/replica_*.log")) if ray_dir else []
    report = {"model": a.model, "draft": a.draft, "precision": a.precision, "served": served, "clients": a.clients,
              "minutes": a.minutes, "max_requests": a.max_requests, "max_tokens": a.max_tokens,
              "max_batch_size": a.max_batch_size, "sets": a.sets, "num_prompts": a.num_prompts, "seed": a.seed,
              "warmup_minutes": a.warmup_minutes, "replicas": a.replicas, "policy": a.policy, "k": a.k, "mix": mix_of(s), **result,
              "error_log_lines": _error_lines([log_path]), "ray_serve_error_log_lines": _error_lines(ray_logs),
              "ray_serve_log_files": len(ray_logs),
              "server_exit_code": code}
    if ray_dir is not None:
        time.sleep(1.0)
        report["leftover_processes"] = len(_leftovers(ray_dir))
        shutil.rmtree(ray_dir, ignore_errors=True)
    atomic_write_text(Path(a.out), json.dumps(report, indent=1))
    if a.plot:
        plot(report, s.outcomes, Path(a.plot))
    checked = (f"{report['by_outcome']['wrong']} wrong against {report['references']} references, "
               if a.check_outputs else "")
    print(f"soak: {report['requests']} requests {report['by_outcome']}, {checked}p50 {report['latency_p50']}, "
          f"p99 {report['latency_p99']}, KV used after {report['kv_blocks_used_after']} (leaked: "
          f"{report['kv_blocks_leaked'] or 'none'}), RSS {report['rss_mb_before']:.0f} -> "
          f"{report['rss_mb_after']:.0f} MB ({100 * report['rss_growth']:+.1f} %), "
          f"{report['error_log_lines']} ERROR lines; wrote {a.out}", file=sys.stderr)
    return report


def plot(report: dict, outcomes: list[Outcome], path: Path) -> None:
    import os

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lat, mem) = plt.subplots(1, 2, figsize=(12, 3.8))
    for kind in report["mix"]:
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
