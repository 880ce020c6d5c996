"""Tenant isolation in the server: vLLM's cache_salt on both routes, several API keys (only the
operator's opens /admin), `cache_scope: api_key`, the key named in the access log, and the suffix
cache saved on drain and loaded at start (server.suffix_cache_path). In process, tiny model."""
from __future__ import annotations

import asyncio
import logging

import pytest
from conftest import engine_config

from specdec.cli import main
from specdec.config import ServerConfig, SpeculativeConfig
from specdec.engine import LLMEngine
from specdec.server.lifecycle import drain, restore_suffix_cache
from server_process import ServerProcess, http_json, started_client

OPERATOR, TENANT_A, TENANT_B = "op-key", "tenant-a-key", "tenant-b-key"
PROMPT = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen " * 3


def _engine(model) -> LLMEngine:
    cfg = engine_config(str(model))
    cfg.speculative = SpeculativeConfig(method="suffix")
    return LLMEngine(cfg, progress=False)


def _client(model, config: ServerConfig):
    return started_client(lambda: _engine(model), config)


@pytest.fixture(scope="module")
def tenants(tiny_qwen):
    c, engine = _client(tiny_qwen, ServerConfig(api_key=OPERATOR, api_keys=[TENANT_A, TENANT_B],
                                                cache_scope="api_key"))
    with c:
        yield c
    engine.shutdown()


@pytest.fixture(scope="module")
def shared(tiny_qwen):
    c, engine = _client(tiny_qwen, ServerConfig())
    with c:
        yield c
    engine.shutdown()


def _cached(client, key: str | None = None, route: str = "completions", **extra) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = ({"prompt": PROMPT} if route == "completions" else {"messages": [{"role": "user", "content": PROMPT}]})
    r = client.post(f"/v1/{route}", json={**body, "max_tokens": 4, "temperature": 0, **extra}, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_cache_salt_scopes_the_prefix_cache(shared, route):
    salt = f"s-{route}"
    assert _cached(shared, route=route, cache_salt=salt) == 0
    assert _cached(shared, route=route, cache_salt=salt + "-other") == 0     # another salt finds nothing
    assert _cached(shared, route=route) == 0                                  # nor does no salt
    assert _cached(shared, route=route, cache_salt=salt) > 0                  # the same salt shares


@pytest.mark.parametrize("salt", ["", 7, ["a"], "x" * 1025])
def test_a_bad_cache_salt_is_a_400(shared, salt):
    r = shared.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "cache_salt": salt})
    assert r.status_code == 400 and "cache_salt" in r.text


def test_each_key_has_its_own_scope(tenants):
    assert _cached(tenants, TENANT_A) == 0
    assert _cached(tenants, TENANT_B) == 0                 # the other tenant finds nothing of A's
    assert _cached(tenants, TENANT_A) > 0
    assert _cached(tenants, TENANT_B, cache_salt="b2") == 0   # a salt splits a key's scope further
    assert _cached(tenants, TENANT_B, cache_salt="b2") > 0


def test_suffix_drafts_stay_within_a_key(tenants):
    stats = tenants.app.state.specdec.engine.stats().speculation.caches[0]
    # one scope per key and salt that drafted by suffix lookup (A; B; B with b2), none for the operator
    assert stats.num_scopes == 3 and stats.max_tokens == 100_000


def test_any_key_generates_but_only_the_operators_opens_admin(tenants, caplog):
    assert tenants.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                        headers={"Authorization": "Bearer nope"}).status_code == 401
    assert tenants.get("/admin/drafts", headers={"Authorization": f"Bearer {TENANT_A}"}).status_code == 401
    assert tenants.get("/admin/drafts", headers={"Authorization": f"Bearer {OPERATOR}"}).status_code == 200
    caplog.set_level(logging.INFO, logger="specdec.access")
    _cached(tenants, TENANT_A)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "specdec.access"]
    key_id = line.split(" key=")[1].split()[0]
    assert len(key_id) == 12 and TENANT_A not in line


def test_keys_file(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# tenants\nkey-one\n\n  key-two  \n")
    assert ServerConfig(api_keys_file=str(keys)).all_keys() == ["key-one", "key-two"]
    assert ServerConfig(api_key="op", api_keys=["t"]).all_keys() == ["op", "t"]
    keys.write_text("has space\n")
    with pytest.raises(ValueError, match=r"keys:1: a key has no whitespace"):
        ServerConfig(api_keys_file=str(keys)).all_keys()
    with pytest.raises(ValueError, match="cannot read"):
        ServerConfig(api_keys_file=str(tmp_path / "missing")).all_keys()
    with pytest.raises(ValueError, match="cache_scope: api_key needs API keys"):
        ServerConfig(cache_scope="api_key")
    with pytest.raises(ValueError, match="cache_scope must be one of"):
        ServerConfig(cache_scope="tenant")


def test_serve_refuses_what_it_cannot_honour(capsys, tmp_path):
    cases = [
        (["--suffix-cache-path", str(tmp_path / "s.json"), "--replicas", "2"], "one process"),
        (["--suffix-cache-path", str(tmp_path / "s.json"), "--no-spec"], "needs speculation"),
        (["--suffix-cache-path", str(tmp_path / "no" / "s.json")], "is not a folder"),
        (["--api-keys-file", str(tmp_path / "missing")], "api_keys_file: cannot read"),
        (["--cache-scope", "api_key"], "needs API keys"),
    ]
    for args, needle in cases:
        code = main(["serve", "smollm2-135m-instruct", *args])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and needle in err, (args, err)


# ---- the suffix cache across a restart ------------------------------------------------------------
def test_the_suffix_cache_is_saved_on_drain_and_loaded_at_start(tiny_qwen, tmp_path, caplog):
    path = tmp_path / "suffix.json"
    client, engine = _client(tiny_qwen, ServerConfig(suffix_cache_path=str(path), drain_seconds=1))
    with client:
        _cached(client, cache_salt="t1")
        _cached(client)
        before = engine.engine.speculator.suffix_cache().state()
        asyncio.run(drain(client.app.state.specdec))
    engine.shutdown()
    assert path.exists() and len(before) == 2
    restarted = _engine(tiny_qwen)
    restore_suffix_cache(restarted, str(path))
    assert restarted.speculator.suffix_cache().state() == before
    path.write_text('{"format": "specdec-suffix-cache", "version": 99}')
    caplog.set_level(logging.INFO, logger="specdec.server")
    fresh = _engine(tiny_qwen)
    restore_suffix_cache(fresh, str(path))
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "format version 99" in errors[0].getMessage()
    assert fresh.speculator.suffix_cache().state() == {}


def test_a_restarted_server_drafts_from_the_outputs_it_saved(tiny_qwen, tmp_path):
    """The process as users run it: SIGTERM saves, the next start loads (and says so)."""
    path = tmp_path / "suffix.json"
    args = ["--model", str(tiny_qwen), "--precision", "float32", "--spec", "suffix", "--threads", "1",
            "--suffix-cache-path", str(path)]
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "cache_salt": "t"}
    first = ServerProcess(args, tmp_path / "first.log")
    try:
        status, out = http_json(first, "/v1/completions", body)
        assert status == 200
    finally:
        first.stop()
    assert first.proc.returncode == 0 and path.exists()
    assert "suffix cache: saved" in (tmp_path / "first.log").read_text()
    second = ServerProcess(args, tmp_path / "second.log")
    try:
        status, again = http_json(second, "/v1/completions", body)
    finally:
        second.stop()
    log = (tmp_path / "second.log").read_text()
    assert "suffix cache: loaded" in log and " 0 tokens" not in log.split("suffix cache: loaded")[1][:20]
    assert status == 200 and again["choices"][0]["text"] == out["choices"][0]["text"]
