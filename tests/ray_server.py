"""`specdec serve` on a local Ray instance of its own, for the replicated-deployment tests: Ray's
files under a short temporary folder (its sockets' paths must stay short), and on stop a check that
none of that instance's processes outlived the server. Also the hostile requests sent to it and to the
single process, as raw bytes."""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
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


def config_yaml(serving: str, max_body: int = 1 << 20, server: str = "") -> str:
    """`server`: more lines of the server section (indented)."""
    return (f"execution_config:\n  target_model: {SMOLLM}\n  precision: float32\n  draft_model: ngram\n"
            f"  speculation_length: 3\n  max_batch_size: 8\n  max_queued_requests: 32\n"
            f"  cache_config:\n    target_cache_blocks: 512\n"
            # k fixed: whether the cost model drafts depends on measured time, and the tests need drafts
            f"speculative:\n  policy: fixed\n"
            f"server:\n  max_body_bytes: {max_body}\n  drain_seconds: 2\n{server}"
            f"serving:\n{serving}")


# Hostile requests, as raw bytes (the single process's hardening probes and more): name -> request.
def _raw(method: str, path: str, body: bytes = b"", content_type: bytes = b"application/json", extra: bytes = b"",
         length: int | None = None, key: str = "sk-ray-test", no_length: bool = False) -> bytes:
    length = len(body) if length is None else length
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n".encode()
            + (f"Authorization: Bearer {key}\r\n".encode() if key else b"")
            + b"Content-Type: " + content_type + b"\r\n" + extra
            + (b"" if no_length else f"Content-Length: {length}\r\n".encode()) + b"\r\n" + body)


_C = "/v1/completions"
_ONE = b'{"prompt": "x", "max_tokens": 1}'
_CHUNKED = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer sk-ray-test\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"".join(b"2710\r\n" + b"x" * 10000 + b"\r\n" for _ in range(8)) + b"0\r\n\r\n")
PROBES = {
    "malformed_json": _raw("POST", _C, b"{not json"),
    "json_array": _raw("POST", _C, b"[1, 2]"),
    "wrong_content_type": _raw("POST", _C, _ONE, content_type=b"text/plain"),
    "form_body": _raw("POST", _C, b"prompt=x", content_type=b"application/x-www-form-urlencoded"),
    "oversized_body": _raw("POST", _C, b'{"prompt": "' + b"x" * 70_000 + b'"}'),
    "oversized_chunked_body": _CHUNKED,
    "unknown_field": _raw("POST", _C, b'{"prompt": "x", "bogus": 1}'),
    "bad_temperature": _raw("POST", _C, b'{"prompt": "x", "temperature": 9}'),
    "zero_max_tokens": _raw("POST", _C, b'{"prompt": "x", "max_tokens": 0}'),
    "unknown_model": _raw("POST", _C, b'{"prompt": "x", "model": "gpt-4o", "max_tokens": 2}'),
    "invalid_utf8": _raw("POST", _C, b'{"prompt": "a\xff\xfeb"}'),
    "lone_surrogate": _raw("POST", _C, b'{"prompt": "a\\ud800b"}'),
    "empty_messages": _raw("POST", "/v1/chat/completions", b'{"messages": []}'),
    "get_on_a_post_route": _raw("GET", _C),
    "delete_health": _raw("DELETE", "/health"),
    "unknown_path": _raw("GET", "/v2/nothing"),
    "no_api_key": _raw("POST", _C, _ONE, key=""),
    "huge_header": _raw("POST", _C, _ONE, extra=b"X-Big: " + b"a" * 100_000 + b"\r\n"),
    "many_headers": _raw("POST", _C, _ONE, extra=b"".join(b"X-H%d: v\r\n" % i for i in range(2000))),
    # framing Ray's proxy rejects before any specdec code runs (docs/scale-out.md lists them)
    "negative_content_length": _raw("POST", _C, b"{}", length=-5),
    "non_numeric_content_length": _raw("POST", _C, b"{}", extra=b"Content-Length: abc\r\n", no_length=True),
    "garbage_request_line": b"HELLO THERE\r\n\r\n",
    "space_in_header_name": _raw("POST", _C, _ONE, extra=b"Bad Header: v\r\n"),
    "nul_in_header_value": _raw("POST", _C, _ONE, extra=b"X-N: a\x00b\r\n"),
    "huge_request_target": _raw("GET", "/" + "a" * 100_000),
}
# Ray's proxy (uvicorn with httptools) answers these itself: (status, content type, body)
PROXY_ANSWERS = {name: (400, "text/plain; charset=utf-8", b"Invalid HTTP request received.")
                 for name in ("negative_content_length", "non_numeric_content_length", "garbage_request_line",
                              "space_in_header_name", "nul_in_header_value", "huge_request_target")}


def probe(port: int, request: bytes, attempts: int = 5) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes; (status, the headers that matter, body). A server that answers and closes with
    part of the request unread (a huge header) resets the connection, and a reset that arrives before
    the answer is read discards it (TCP): then the probe is sent again."""
    for attempt in range(attempts):
        try:
            answer = _exchange(port, request)
            break
        except ConnectionResetError:
            if attempt == attempts - 1:
                raise
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), {k: headers[k] for k in ("content-type", "allow") if k in headers}, body


def _exchange(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer
