"""`specdec bench soak --check-outputs`: the comparison finds a changed output and says where, a
stream reassembles to its whole answer, the pool covers every kind, and a short checked soak on the
tiny model completes with nothing wrong and nothing failed."""
from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
from server_process import ServerProcess
from tiny_gguf import write_tiny_gguf

from specdec.bench.soak_checked import (CHECKED_MIX, SALTS, Reassembled, build_pool, compare, record_references,
                                        whole_choices)
from specdec.bench.soak_clients import Soak
from specdec.prompts import read_set

CHAT = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
    "role": "assistant", "content": "Let me check.",
    "tool_calls": [{"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]}}]}


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory):
    """The tiny model with an 8k context: room for the structured set's prompts in bytes."""
    return write_tiny_gguf(tmp_path_factory.mktemp("checked") / "tiny-long.gguf", arch="qwen2", context=8192)


def test_compare_finds_a_changed_output_and_where():
    ref = whole_choices(CHAT)
    assert ref == [{"text": "Let me check.", "tool_calls": [["get_weather", '{"city": "Paris", "unit": "celsius"}']],
                    "finish_reason": "tool_calls"}]
    assert compare("k", ref, json.loads(json.dumps(ref))) is None
    text = [{**ref[0], "text": "Let me chick."}]
    assert compare("k", ref, text) == {"key": "k", "choice": 0, "field": "text", "offset": 9,
                                       "expected": "Let me check.", "got": "Let me chick."}
    args = [{**ref[0], "tool_calls": [["get_weather", '{"city": "Pariz", "unit": "celsius"}']]}]
    m = compare("k", ref, args, context=5)
    assert (m["field"], m["offset"]) == ("tool_calls", 26) and m["expected"][5] == "s" and m["got"][5] == "z"
    assert compare("k", ref, [{**ref[0], "finish_reason": "length"}])["field"] == "finish_reason"
    assert compare("k", ref, [{**ref[0], "text": None}])["offset"] == 0
    shorter = compare("k", [{**ref[0], "text": "abc"}], [{**ref[0], "text": "ab"}])
    assert (shorter["offset"], shorter["expected"], shorter["got"]) == (2, "abc", "ab")
    assert compare("k", ref, ref * 2)["field"] == "choices"
    second = compare("k", ref * 2, [ref[0], {**ref[0], "text": "Let me see."}])
    assert (second["choice"], second["offset"]) == (1, 7)


def test_a_stream_reassembles_to_its_whole_answer():
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
              {"choices": [{"index": 0, "delta": {"content": "Let me"}}]},
              {"choices": [{"index": 0, "delta": {"content": " check."}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_9", "type": "function",
                                                                  "function": {"name": "get_weather", "arguments": ""}}]}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {
                  "arguments": '"Paris", "unit": "celsius"}'}}]}}]},
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
              {"choices": [], "usage": {"completion_tokens": 20}}]
    streamed = Reassembled()
    for chunk in chunks:
        streamed.add(chunk)
    assert streamed.choices() == whole_choices(CHAT)
    text = Reassembled()   # completions, n = 2, the choices' chunks interleaved
    for index, piece, finish in ((1, "x", None), (0, "a", None), (0, "b", "stop"), (1, "y", "length")):
        text.add({"choices": [{"index": index, "text": piece, "finish_reason": finish}]})
    assert text.choices() == [{"text": "ab", "tool_calls": [], "finish_reason": "stop"},
                              {"text": "xy", "tool_calls": [], "finish_reason": "length"}]


def test_the_pool_covers_every_kind_deterministically():
    prompts = read_set("chat")[:3] + read_set("code_gen")[:3]
    pool = build_pool(prompts, 4, 48, seed=0)
    assert pool.all() == build_pool(prompts, 4, 48, seed=0).all()
    compared = [k for k in CHECKED_MIX if k not in ("drop_stream", "drop_wait", "invalid")]
    assert list(pool.bodies) == compared and all(len(pool.bodies[k]) == 4 for k in compared)
    bodies = [b.body for b in pool.all()]
    assert len({json.dumps(b, sort_keys=True) for b in bodies}) == len(bodies)   # distinct
    assert sum(bool(b.get("stream")) for b in bodies) == len(bodies) // 2
    sampled = [b for b in bodies if b["temperature"] > 0]
    assert all(0.7 <= b["temperature"] <= 1.0 and "seed" in b for b in sampled)
    assert {b.get("n", 1) for b in sampled} == {1, 2} and {b.get("top_p", 1.0) for b in sampled} == {0.9, 1.0}
    seeds = [b["seed"] + c for b in sampled for c in range(b.get("n", 1))]
    assert len(set(seeds)) == len(seeds)   # no two sampled choices share a seed
    assert {json.dumps(b.get("tool_choice")) for b in bodies if "tools" in b} >= {'"auto"', '"required"'}
    assert {b["cache_salt"] for b in bodies if "cache_salt" in b} == set(SALTS)
    assert any("response_format" in b and b.get("stream") for b in bodies)
    assert all(b["max_tokens"] == 48 and "speculative" not in b for b in bodies)


def test_a_changed_reference_is_reported_wrong_on_a_live_server(tiny_long, tmp_path):
    server = ServerProcess(["--model", str(tiny_long), "--precision", "float32", "--threads", "1"],
                           tmp_path / "server.log")
    try:
        s = Soak(server.url, "127.0.0.1", server.port, 12, read_set("chat")[:2])
        s.checked = pool = build_pool(s.prompts, 2, 12, seed=0)
        record_references(s, pool)
        assert len(pool.references) == 16
        rng = random.Random(0)
        assert pool.one(s, "greedy_chat", random.Random(0), [""]) == ("ok", "")
        key = rng.choice(pool.bodies["greedy_chat"]).key   # the body the same draw picks
        ref = pool.references[key][0]
        ref["text"] = ref["text"][:3] + "\u2603" + ref["text"][4:]
        outcome, detail = pool.one(s, "greedy_chat", random.Random(0), [""])
        assert (outcome, detail) == ("wrong", "choice 0 text differs at 3")
        (m,) = pool.mismatches
        assert (m["key"], m["offset"], m["expected"][3], m["got"][:3]) == (key, 3, "\u2603", ref["text"][:3])
    finally:
        server.stop()


def test_a_checked_soak_on_the_tiny_model_has_nothing_wrong(tiny_long, tmp_path):
    out = tmp_path / "soak.json"
    run = subprocess.run([sys.executable, "-m", "specdec.cli", "bench", "soak", "--check-outputs", "--model",
                          str(tiny_long), "--precision", "float32", "--threads", "1", "--clients", "4",
                          "--minutes", "2", "--max-requests", "60", "--warmup-minutes", "0.05", "--max-tokens", "16",
                          "--sets", "chat,prose", "--bodies-per-kind", "2", "--out", str(out), "--plot", ""],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["check_outputs"] is True and r["references"] == 16 and r["mix"] == CHECKED_MIX
    assert r["requests"] == 60 and sum(r["by_outcome"].values()) == 60
    assert r["by_outcome"]["failed"] == 0, r["failures"]
    assert r["by_outcome"]["wrong"] == 0 and r["warmup_wrong"] == 0, r["wrong_outputs"]
    assert r["wrong_outputs"] == [] and all(v["wrong"] == 0 for v in r["by_kind"].values())
    assert r["by_outcome"]["ok"] > 0 and r["by_outcome"]["dropped"] + r["by_outcome"]["rejected"] > 0
    assert r["error_log_lines"] == 0 and r["server_exit_code"] == 0
    assert r["kv_blocks_used_after"] == {'specdec_kv_blocks_used{pool="target"}': 0.0}
    assert "0 wrong against 16 references" in run.stderr
