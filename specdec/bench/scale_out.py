"""`specdec bench replicas` and `specdec bench affinity`: `specdec serve` processes under HTTP load.

replicas: the same closed-loop load (--clients concurrent streamed chat requests, --num-requests in
all, each generating --max-tokens) against one server process without Ray (`single`) and N engine
replicas on Ray (`rayN`); throughput, time to first token and end-to-end latency, arms interleaved
per repeat, ratios against `single`.

affinity: multi-turn conversations (a chat prompt, then follow-up questions, each turn sending the
whole conversation so far) against --replicas replicas routed by prefix affinity and at random; the
prefix-cache hit rate (cached prompt tokens / prompt tokens, from each answer's usage) and the time
to first token of the later turns. Each arm starts a fresh deployment (cold caches)."""
from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from specdec.bench.serve_bench import percentile
from specdec.bench.soak import free_port
from specdec.extras import require_plotting
from specdec.fileio import atomic_write_text
from specdec.prompts import read_set

FOLLOW_UPS = ("Can you explain that in more detail?", "Give me one concrete example.",
              "What is a common mistake people make here?", "Summarize all of this in one sentence.",
              "How would you explain it to a child?", "What should I read to learn more?")
SYSTEM = "You are a helpful assistant. Answer clearly and briefly."


class Server:
    """A `specdec serve --config` process (its own process group, Ray's files in a temporary folder)."""

    def __init__(self, a, serving: str | None, log_path: Path, replicas: int) -> None:
        self.port = free_port()
        self.ray_dir = tempfile.mkdtemp(prefix="sdray")
        cfg = log_path.with_suffix(".yaml")
        cfg.write_text(f"execution_config:\n  target_model: {a.model}\n  precision: {a.precision}\n"
                       f"  draft_model: {a.draft or 'ngram'}\n  max_batch_size: {a.max_batch_size}\n"
                       + (f"serving:\n{serving}" if serving else ""))
        cmd = [sys.executable, "-m", "specdec.cli", "serve", "--config", str(cfg), "--port", str(self.port)]
        if a.threads and not serving:
            cmd += ["--threads", str(a.threads)]
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "RAY_TMPDIR": self.ray_dir, "RAY_USAGE_STATS_ENABLED": "0"})
        self._wait(replicas if serving else 0, log_path)

    def _wait(self, replicas: int, log_path: Path, timeout: float = 900) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited early:\n{log_path.read_text()[-3000:]}")
            try:
                if get(self.port, "/health")[0] == 200 and (
                        not replicas or len(re.findall(r"^specdec_replica_info", get(self.port, "/metrics")[1],
                                                       re.M)) == replicas):
                    return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError("the server did not get ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._log.close()
        shutil.rmtree(self.ray_dir, ignore_errors=True)


def get(port: int, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path)
    resp = conn.getresponse()
    out = resp.status, resp.read().decode()
    conn.close()
    return out


def chat(port: int, model: str, messages: list[dict], max_tokens: int, ignore_eos: bool) -> dict:
    """One streamed chat request: its text, TTFT, latency, usage and the replica that served it."""
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": ignore_eos, "stream": True, "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    text, ttft, usage = [], None, {}
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            raise RuntimeError(event["error"]["message"])
        for c in event.get("choices", ()):
            if c["delta"].get("content"):
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                text.append(c["delta"]["content"])
        usage = event.get("usage") or usage
    conn.close()
    return {"text": "".join(text), "ttft": ttft or 0.0, "seconds": time.perf_counter() - t0,
            "prompt_tokens": usage.get("prompt_tokens", 0), "completion_tokens": usage.get("completion_tokens", 0),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "replica": resp.getheader("x-specdec-replica")}


def _pool(jobs: list, workers: int, run) -> list:
    """run(job) for every job on `workers` threads; results in job order (an exception is kept)."""
    results, lock, nxt = [None] * len(jobs), threading.Lock(), [0]

    def worker() -> None:
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(jobs):
                return
            try:
                results[i] = run(jobs[i])
            except Exception as e:  # noqa: BLE001 - a failed request is recorded, the run goes on
                results[i] = e

    threads = [threading.Thread(target=worker) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else {}


def _serving(replicas: int, routing: str, cpus: float) -> str:
    return f"  replicas: {replicas}\n  routing: {routing}\n  cpus_per_replica: {cpus}\n"


def _load(port: int, a, prompts: list[str]) -> dict:
    """The closed-loop load of `bench replicas` on one server."""
    jobs = [prompts[i % len(prompts)] for i in range(a.num_requests)]
    t0 = time.perf_counter()
    outs = _pool(jobs, a.clients, lambda p: chat(port, a.model, [{"role": "user", "content": p}],
                                                 a.max_tokens, True))
    wall = time.perf_counter() - t0
    ok = [o for o in outs if isinstance(o, dict)]
    return {"requests": len(outs), "failed": len(outs) - len(ok), "seconds": wall,
            "requests_per_second": len(ok) / wall,
            "tokens_per_second": sum(o["completion_tokens"] for o in ok) / wall,
            "ttft_p50": percentile([o["ttft"] for o in ok], 0.5), "ttft_p99": percentile([o["ttft"] for o in ok], 0.99),
            "e2e_p50": percentile([o["seconds"] for o in ok], 0.5),
            "e2e_p99": percentile([o["seconds"] for o in ok], 0.99),
            "replicas_serving": len({o["replica"] for o in ok if o["replica"]}),
            "errors": [str(o) for o in outs if not isinstance(o, dict)][:10]}


def run_replicas_bench(a) -> dict:
    require_plotting(a.plot, "specdec bench replicas")
    from tqdm import tqdm
    arms = a.arms.split(",")
    prompts = read_set("chat")
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    out = Path(a.out)
    bar = tqdm(total=a.repeats * len(arms), desc="bench replicas", unit="arm", file=sys.stderr)
    for repeat in range(a.repeats):
        for arm in arms:
            n = 0 if arm == "single" else int(arm.removeprefix("ray"))
            serving = _serving(n, a.routing, a.cpus_per_replica) if n else None
            try:
                server = Server(a, serving, out.with_name(f"{out.stem}.{arm}.{repeat}.log"), n)
            except Exception as e:  # noqa: BLE001 - an arm that fails to start is recorded
                runs[arm].append({"failed_to_start": str(e)[-500:]})
                bar.update()
                continue
            try:
                _load(server.port, a, prompts[:2])  # warm-up: first batch shapes
                runs[arm].append(_load(server.port, a, prompts))
            finally:
                server.stop()
            bar.update()
    bar.close()
    report = {"mode": "replicas", "model": a.model, "precision": a.precision, "clients": a.clients,
              "num_requests": a.num_requests, "max_tokens": a.max_tokens, "cpus": os.cpu_count(),
              "cpus_per_replica": a.cpus_per_replica, "routing": a.routing, "runs": runs,
              "summary": _replicas_summary(runs, arms)}
    _write(report, out, a.plot, _plot_replicas)
    return report


def _replicas_summary(runs: dict[str, list[dict]], arms: list[str]) -> dict:
    base = runs.get("single") or runs[arms[0]]
    summary = {}
    for arm in arms:
        ok = [(r, b) for r, b in zip(runs[arm], base) if "tokens_per_second" in r and "tokens_per_second" in b]
        summary[arm] = {k: _spread([r[k] for r, _ in ok]) for k in
                        ("tokens_per_second", "requests_per_second", "ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99")}
        summary[arm]["throughput_ratio"] = _spread([r["tokens_per_second"] / b["tokens_per_second"] for r, b in ok])
        summary[arm]["failed"] = sum(r.get("failed", 0) for r in runs[arm])
    return summary


def _conversation(port: int, a, first: str) -> list[dict]:
    messages, turns = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": first}], []
    for t in range(a.turns):
        r = chat(port, a.model, messages, a.max_tokens, False)
        turns.append({k: r[k] for k in ("ttft", "seconds", "prompt_tokens", "cached_tokens", "replica")})
        messages += [{"role": "assistant", "content": r["text"]},
                     {"role": "user", "content": FOLLOW_UPS[t % len(FOLLOW_UPS)]}]
    return turns


def run_affinity_bench(a) -> dict:
    require_plotting(a.plot, "specdec bench affinity")
    from tqdm import tqdm
    firsts = read_set("chat")[: a.conversations]
    arms, out = ("affinity", "random"), Path(a.out)
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    bar = tqdm(total=a.repeats * len(arms), desc="bench affinity", unit="arm", file=sys.stderr)
    for repeat in range(a.repeats):
        for arm in arms:
            server = Server(a, _serving(a.replicas, arm, a.cpus_per_replica),
                            out.with_name(f"{out.stem}.{arm}.{repeat}.log"), a.replicas)
            try:
                convs = _pool(firsts, a.clients, lambda first: _conversation(server.port, a, first))
            finally:
                server.stop()
            runs[arm].append(_affinity_run(convs))
            bar.update()
    bar.close()
    summary = {arm: {k: _spread([r[k] for r in runs[arm] if r.get(k) is not None])
                     for k in ("hit_rate", "later_hit_rate", "later_ttft_p50", "later_ttft_p99", "same_replica")}
               for arm in arms}
    pairs = list(zip(runs["affinity"], runs["random"]))
    summary["hit_rate_ratio"] = _spread([x["hit_rate"] / y["hit_rate"] for x, y in pairs if y["hit_rate"]])
    summary["later_ttft_p50_ratio"] = _spread([y["later_ttft_p50"] / x["later_ttft_p50"] for x, y in pairs
                                               if x["later_ttft_p50"]])
    report = {"mode": "affinity", "model": a.model, "precision": a.precision, "replicas": a.replicas,
              "cpus_per_replica": a.cpus_per_replica, "conversations": len(firsts), "turns": a.turns,
              "clients": a.clients, "max_tokens": a.max_tokens, "runs": runs, "summary": summary}
    _write(report, out, a.plot, _plot_affinity)
    return report


def _affinity_run(convs: list) -> dict:
    ok = [c for c in convs if isinstance(c, list)]
    turns = [t for c in ok for t in c]
    later = [t for c in ok for t in c[1:]]
    same = [c[i]["replica"] == c[i - 1]["replica"] for c in ok for i in range(1, len(c))]
    return {"failed": len(convs) - len(ok), "requests": len(turns),
            "hit_rate": sum(t["cached_tokens"] for t in turns) / max(1, sum(t["prompt_tokens"] for t in turns)),
            "later_hit_rate": sum(t["cached_tokens"] for t in later) / max(1, sum(t["prompt_tokens"] for t in later)),
            "later_ttft_p50": percentile([t["ttft"] for t in later], 0.5),
            "later_ttft_p99": percentile([t["ttft"] for t in later], 0.99),
            "same_replica": sum(same) / max(1, len(same)),
            "errors": [str(c) for c in convs if not isinstance(c, list)][:10]}


def _write(report: dict, out: Path, plot_path: str, plot) -> None:
    atomic_write_text(out, json.dumps(report, indent=1))
    print(json.dumps(report["summary"], indent=1))
    if plot_path:
        plot(report, Path(plot_path))


def _bars(ax, names: list[str], spreads: list[dict], title: str) -> None:
    meds = [s.get("median", 0) for s in spreads]
    lo = [m - s.get("min", m) for m, s in zip(meds, spreads)]
    hi = [s.get("max", m) - m for m, s in zip(meds, spreads)]
    ax.bar(names, meds, yerr=[lo, hi], capsize=4, color="#4C72B0")
    ax.set_title(title, fontsize=9)


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


def _plot_replicas(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = report["summary"]
    names = list(s)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    _bars(axes[0], names, [s[n]["tokens_per_second"] for n in names], "output tokens/s")
    _bars(axes[1], names, [s[n]["ttft_p50"] for n in names], "time to first token p50 (s)")
    _bars(axes[2], names, [s[n]["e2e_p50"] for n in names], "request latency p50 (s)")
    fig.suptitle(f"{report['model']} ({report['precision']}), {report['clients']} clients, "
                 f"{report['max_tokens']} tokens/request, {report['cpus']} CPUs", fontsize=9)
    _save(fig, path)


def _plot_affinity(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = report["summary"]
    names = ["affinity", "random"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    _bars(axes[0], names, [s[n]["hit_rate"] for n in names], "prefix-cache hit rate (cached / prompt tokens)")
    _bars(axes[1], names, [s[n]["later_ttft_p50"] for n in names], "time to first token p50, turns 2+ (s)")
    fig.suptitle(f"{report['model']}, {report['replicas']} replicas, {report['conversations']} conversations x "
                 f"{report['turns']} turns", fontsize=9)
    _save(fig, path)
