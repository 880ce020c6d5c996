"""`specdec bench soak --check-outputs`: every completed answer compared with its reference.

A fixed pool of distinct request bodies is built from the prompt sets and the structured set:
greedy chat and completions, seeded sampled requests (temperature 0.7-1.0, with and without top_p,
n = 1 and n = 2), JSON-schema response formats, tool calls (tool_choice auto, and the item's own
required or named choice), cache salts; half of each kind streamed. Once the server is up, each
body is sent alone, one after another, with speculation off: its choices (text, tool calls, finish
reason) are its reference. In the soak, a completed answer whose choices differ from its body's
reference is `wrong`, apart from `failed`; the first MAX_MISMATCHES (the warm-up's included) are
kept with where they differ. Dropped streams are not compared. The promise checked: greedy decoding is batch invariant
and seeded sampling is keyed by (seed, choice, position), so neither speculation nor load changes
an output. A wrong answer stays wrong whoever served it (a killed replica's in-flight requests fail,
they do not come back changed).
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field

from specdec.bench.soak_clients import Soak, _check_stream, headers, one, request
from specdec.prompts import set_path

# kind -> weight in the checked mix; the last three as in the plain mix (not compared)
CHECKED_MIX = {"greedy_chat": 2, "greedy_text": 2, "sampled": 2, "sampled_n2": 1, "salted": 1, "json_schema": 2,
               "tool_auto": 1, "tool_required": 1, "drop_stream": 2, "drop_wait": 1, "invalid": 2}
SALTS = ("tenant-a", "tenant-b", "tenant-c")
MAX_MISMATCHES = 20
_PROMPT_KINDS = ("greedy_chat", "greedy_text", "sampled", "sampled_n2", "salted")
_FINISHED = ("stop", "length", "tool_calls")


@dataclass
class Body:
    key: str      # kind/index[/stream]: names the body in the report
    kind: str
    path: str
    body: dict    # as the soak sends it (speculation as the server is configured)


@dataclass
class CheckedPool:
    """The bodies by kind, their references (key -> choices) and the first mismatches seen."""
    bodies: dict[str, list[Body]]
    references: dict[str, list[dict]] = field(default_factory=dict)
    mismatches: list[dict] = field(default_factory=list)
    mix: dict[str, int] = field(default_factory=lambda: dict(CHECKED_MIX))

    def all(self) -> list[Body]:
        return [b for kind in self.bodies.values() for b in kind]

    def report(self, reference_seconds: float) -> dict:
        """The report's fields: the pool by kind, its references and the first wrong outputs."""
        return {"check_outputs": True, "references": len(self.references), "reference_seconds": reference_seconds,
                "pool": {kind: [b.key for b in bodies] for kind, bodies in self.bodies.items()},
                "bodies_per_kind": max((len(b) for b in self.bodies.values()), default=0),
                "wrong_outputs": self.mismatches}

    def one(self, s: Soak, kind: str, rng: random.Random, replica: list[str]) -> tuple[str, str]:
        """(outcome, detail) of one request of `kind`, compared with its reference when it completes."""
        if kind == "invalid":
            return one(s, kind, rng, replica)
        if kind == "drop_wait":
            return _drop_wait(s, rng.choice(self.all()), rng)
        streamed = [b for b in self.all() if b.body.get("stream")]
        b = rng.choice(streamed) if kind == "drop_stream" else rng.choice(self.bodies[kind])
        problem, choices = send(s, b, replica, rng.randint(1, 4) if kind == "drop_stream" else None)
        if problem:
            return ("dropped", "") if problem == "dropped" else ("failed", problem)
        mismatch = compare(b.key, self.references[b.key], choices)
        if mismatch is None:
            return "ok", ""
        with s.lock:
            if len(self.mismatches) < MAX_MISMATCHES:
                self.mismatches.append({**mismatch, "replica": replica[0]})
        return "wrong", f"choice {mismatch['choice']} {mismatch['field']} differs at {mismatch['offset']}"


def _structured_items() -> tuple[list[dict], list[dict]]:
    """The structured set's JSON-schema items and tool items."""
    items = [json.loads(line) for line in set_path("structured").read_text(encoding="utf-8").splitlines()
             if line.strip()]
    return [i for i in items if "response_format" in i], [i for i in items if "tools" in i]


def _sampled(i: int, seed: int, temperatures: tuple[float, ...]) -> dict:
    """Seeded sampling; top_p on every other pair so that streamed and whole bodies get both. Seeds 10
    apart: choice c of n samples with seed + c, which no other body's choice shares."""
    return {"temperature": temperatures[i % len(temperatures)], "seed": seed + 10 * i,
            **({"top_p": 0.9} if (i // 2) % 2 else {})}


def _prompt_body(kind: str, i: int, prompt: str, max_tokens: int, seed: int) -> tuple[str, dict]:
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0}
    if kind == "greedy_text":
        return "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if kind == "sampled":
        return "/v1/chat/completions", {**chat, **_sampled(i, seed, (0.7, 0.8, 0.9, 1.0))}
    if kind == "sampled_n2":
        return "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "n": 2,
                                   **_sampled(i, seed, (1.0, 0.8))}
    if kind == "salted":  # greedy and sampled, each prompt under every salt in turn
        return "/v1/chat/completions", {**chat, "cache_salt": SALTS[i % len(SALTS)],
                                        **(_sampled(i, seed, (0.8,)) if i % 2 else {})}
    return "/v1/chat/completions", chat


def _structured_body(kind: str, i: int, item: dict, max_tokens: int, seed: int) -> dict:
    body = {"messages": item["messages"], "max_tokens": max_tokens, "temperature": 0}
    if kind == "json_schema":  # greedy, and seeded sampled on every other pair
        sampled = _sampled(i, seed, (0.8,)) if (i // 2) % 2 else {}
        return {**body, "response_format": item["response_format"], **sampled}
    choice = "auto" if kind == "tool_auto" else item.get("tool_choice", "required")
    parallel = {"parallel_tool_calls": item["parallel_tool_calls"]} if "parallel_tool_calls" in item else {}
    return {**body, "tools": item["tools"], "tool_choice": choice, **parallel}


def _kind_body(kind: str, k: int, i: int, per_kind: int, prompts: list[str], max_tokens: int,
               seed: int) -> tuple[str, dict]:
    """The i-th body of the k-th kind. Prompt kinds take the prompts in turn, each from its own offset;
    salted bodies share a prompt across the salts (the salt alone keeps their caches apart)."""
    seed = seed * 100_000 + 1000 * k
    if kind in _PROMPT_KINDS:
        n = i // len(SALTS) if kind == "salted" else i
        return _prompt_body(kind, i, prompts[(k * per_kind + n) % len(prompts)], max_tokens, seed)
    schemas, tools = _structured_items()
    items = schemas if kind == "json_schema" else tools
    return "/v1/chat/completions", _structured_body(kind, i, items[i % len(items)], max_tokens, seed)


def build_pool(prompts: list[str], per_kind: int, max_tokens: int, seed: int) -> CheckedPool:
    """`per_kind` distinct bodies of each compared kind, the odd ones streamed; deterministic in its
    arguments (the prompts, and the structured set)."""
    bodies: dict[str, list[Body]] = {}
    for k, kind in enumerate([*_PROMPT_KINDS, "json_schema", "tool_auto", "tool_required"]):
        bodies[kind] = []
        for i in range(per_kind):
            path, body = _kind_body(kind, k, i, per_kind, prompts, max_tokens, seed)
            if i % 2:
                body = {**body, "stream": True, "stream_options": {"include_usage": True}}
            bodies[kind].append(Body(f"{kind}/{i}" + ("/stream" if i % 2 else ""), kind, path, body))
    return CheckedPool(bodies)


def record_references(s: Soak, pool: CheckedPool) -> float:
    """Each body alone, in turn, speculation off: its choices are its reference. Returns the seconds.

    Raises:
        RuntimeError: a reference request did not complete (the soak could check nothing against it).
    """
    t0 = time.time()
    for b in pool.all():
        plain = Body(b.key, b.kind, b.path, {**b.body, "speculative": {"enabled": False}})
        problem, choices = send(s, plain, [""], None)
        if problem:
            raise RuntimeError(f"the reference of {b.key} failed: {problem}")
        pool.references[b.key] = choices
    return time.time() - t0


def send(s: Soak, b: Body, replica: list[str], drop_after: int | None) -> tuple[str, list[dict]]:
    """(problem, choices) of one body: '' and its choices when whole; `replica[0]` is set to the replica
    that answered. A stream is reassembled (or dropped after `drop_after` events: 'dropped')."""
    conn, resp = request(s, b.path, json.dumps(b.body).encode())
    try:
        replica[0] = resp.getheader("x-specdec-replica") or ""
        if b.body.get("stream"):
            streamed = Reassembled()
            problem = _check_stream(resp, drop_after, streamed.add)
            return problem, streamed.choices()
        data = resp.read()
        if resp.status != 200:
            return f"HTTP {resp.status}: {data[:200]!r}", []
        choices = whole_choices(json.loads(data))
        if len(choices) != b.body.get("n", 1) or any(c["finish_reason"] not in _FINISHED for c in choices):
            return f"{len(choices)} choices, finish reasons {[c['finish_reason'] for c in choices]}", choices
        return "", choices
    finally:
        conn.close()


def _drop_wait(s: Soak, b: Body, rng: random.Random) -> tuple[str, str]:
    import http.client
    conn = http.client.HTTPConnection(s.host, s.port, timeout=900)
    try:
        conn.request("POST", b.path, body=json.dumps(b.body).encode(), headers=headers(s))
        time.sleep(rng.uniform(0.2, 1.5))
        return "dropped", ""
    finally:
        conn.close()


def _choice(text: str | None, calls: list[list[str]], finish_reason: str | None) -> dict:
    return {"text": text, "tool_calls": calls, "finish_reason": finish_reason}


def whole_choices(body: dict) -> list[dict]:
    """A non-streamed answer's choices, by index: text (chat content or completion text), tool calls
    as [name, arguments] (ids are random, not compared), finish reason."""
    out = []
    for c in sorted(body.get("choices") or [], key=lambda c: c["index"]):
        message = c.get("message")
        text = c.get("text") if message is None else message.get("content")
        calls = [[t["function"]["name"], t["function"]["arguments"]] for t in (message or {}).get("tool_calls") or ()]
        out.append(_choice(text, calls, c.get("finish_reason")))
    return out


@dataclass
class Reassembled:
    """A stream's choices put back together from its chunks: content (or text) deltas concatenated,
    each tool call's name and argument fragments by its index, the finish reason."""
    by_index: dict[int, dict] = field(default_factory=dict)

    def add(self, chunk: dict) -> None:
        for c in chunk.get("choices") or ():
            choice = self.by_index.setdefault(c["index"], _choice(None, [], None))
            delta = c.get("delta") or {}
            text = c.get("text") if "delta" not in c else delta.get("content")
            if text is not None:
                choice["text"] = (choice["text"] or "") + text
            for call in delta.get("tool_calls") or ():
                calls = choice["tool_calls"]
                calls.extend([["", ""]] * (call["index"] + 1 - len(calls)))
                fn = call.get("function") or {}
                calls[call["index"]] = [calls[call["index"]][0] + (fn.get("name") or ""),
                                        calls[call["index"]][1] + (fn.get("arguments") or "")]
            choice["finish_reason"] = c.get("finish_reason") or choice["finish_reason"]

    def choices(self) -> list[dict]:
        return [self.by_index[i] for i in sorted(self.by_index)]


def _flat(value: object) -> str:
    """A field as text to find the offset in: tool calls as `name(arguments)` lines, None as null."""
    if isinstance(value, list):
        return "\n".join(f"{name}({arguments})" for name, arguments in value)
    return value if isinstance(value, str) else json.dumps(value)


def compare(key: str, expected: list[dict], got: list[dict], context: int = 30) -> dict | None:
    """None when `got` equals the reference `expected` choice for choice, else the first difference:
    key, choice, field (text | tool_calls | finish_reason | choices), the character offset where the
    two first differ, and both from `context` characters before it."""
    if len(expected) != len(got):
        return {"key": key, "choice": None, "field": "choices", "offset": 0, "expected": len(expected),
                "got": len(got)}
    for i, (want, have) in enumerate(zip(expected, got)):
        for name in ("text", "tool_calls", "finish_reason"):
            if want[name] == have[name]:
                continue
            a, b = _flat(want[name]), _flat(have[name])
            at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            if a == b:   # None against the string "null" (or [] against ""): differ from the start
                at = 0
            start = max(0, at - context)
            return {"key": key, "choice": i, "field": name, "offset": at, "expected": a[start:at + context],
                    "got": b[start:at + context]}
    return None
