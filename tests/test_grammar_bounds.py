"""Bounded grammar work (StructuredConfig, YAML `structured_outputs`): hostile schemas, regexes and
grammars are answered within seconds (a 400 naming the bound, or a constrained output), a grammar
that hits a bound mid-generation ends only its own request, the server keeps serving, and required
tool calls stay bounded by the tools' grammar. Wall-clock asserts here are hang guards, not timings."""
from __future__ import annotations

import time

import pytest
from conftest import engine_config
from server_process import started_client
from test_server_structured import chat, server  # noqa: F401 - its server fixture (tiny model, ngram) and client

from specdec.config import ServerConfig, StructuredConfig, load_yaml_config
from specdec.engine import LLMEngine
from specdec.sample.structured import GrammarCompiler, check_structured
from specdec.sampling_params import SamplingParams, StructuredOutput
from specdec.server.tool_grammar import MAX_PARALLEL_CALLS, call_grammar

HANG_GUARD_S = 20   # generous: each case must be answered, not fast


def _ref_chain(n: int) -> dict:
    defs = {"n0": {"type": "integer"}} | {f"n{i}": {"type": "array", "items": {"$ref": f"#/$defs/n{i - 1}"}}
                                          for i in range(1, n + 1)}
    return {"$defs": defs, "$ref": f"#/$defs/n{n}"}


def _nested_arrays(n: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(n):
        schema = {"type": "array", "items": schema}
    return schema


def _lark_chain(n: int) -> str:
    """r0 -> r1 -> ... -> rn: llguidance recurses along it (3,000 overflowed a default 8 MiB stack)."""
    return "start: r0\n" + "".join(f'r{i}: r{i + 1} | "x"\n' for i in range(n)) + f'r{n}: "z"\n'


def _props(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}


HOSTILE = {   # name -> a request body's constraint
    "regex (a|a)*b": {"guided_regex": "(a|a)*b"},
    "regex (a*)*b": {"guided_regex": "(a*)*b"},
    "regex .{1000}{1000}": {"guided_regex": ".{1000}{1000}"},
    "regex a{100000}": {"guided_regex": "a{100000}"},
    "regex (a|b){1000000}": {"guided_regex": "(a|b){1000000}"},
    "regex [a-z]*a[a-z]{200}": {"guided_regex": "[a-z]*a[a-z]{200}"},
    "schema pattern": {"guided_json": {"type": "string", "pattern": "^(a|aa)*(b{50}){50}$"}},
    "schema recursive $ref": {"guided_json": {"$defs": {"n": {"type": "object", "properties": {
        "a": {"$ref": "#/$defs/n"}, "b": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"}},
    "schema $ref chain 2000": {"guided_json": _ref_chain(2000)},
    "schema 200 nested arrays": {"guided_json": _nested_arrays(200)},
    "schema allOf x anyOf": {"guided_json": {"allOf": [{"anyOf": [
        {"type": "object", "properties": {f"a{i}": {"type": "integer"}}, "required": [f"a{i}"]},
        {"type": "object", "properties": {f"b{i}": {"type": "string"}}, "required": [f"b{i}"]}]} for i in range(16)]}},
    "schema enum 50000": {"guided_json": {"enum": [f"v{i}" for i in range(50_000)]}},
    "schema 5000 properties": {"guided_json": _props(5000)},
    "lark ambiguous": {"guided_grammar": 'start: s\ns: s s | s s s | "a" | ""\n'},
    "lark x{1000} of y{1000}": {"guided_grammar": 'start: x{1000}\nx: y{1000}\ny: "a" | "b"\n'},
    "lark rule chain 3000": {"guided_grammar": _lark_chain(3000)},
    "choice 30000": {"guided_choice": [f"option number {i}" for i in range(30_000)]},
}


# ---- configuration -------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [("compile_timeout_s", 0), ("mask_timeout_ms", -1), ("mask_timeout_ms", "5"),
                                         ("max_items_in_row", 0), ("step_lexer_fuel", 1.5),
                                         ("max_grammar_size", True), ("initial_lexer_fuel", -3),
                                         ("max_concurrent_compiles", 0)])
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"structured_outputs.{field}"):
        StructuredConfig(**{field: value})


def test_yaml_structured_outputs_section(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("execution_config:\n  target_model: x.gguf\n  draft_model: null\n"
                    "structured_outputs:\n  compile_timeout_s: 2.5\n  max_items_in_row: 500\n")
    config, _, _ = load_yaml_config(path)
    assert config.structured == StructuredConfig(compile_timeout_s=2.5, max_items_in_row=500)
    path.write_text("structured_outputs:\n  max_items: 5\n")
    with pytest.raises(ValueError, match="unknown key structured_outputs.max_items"):
        load_yaml_config(path)
    path.write_text("structured_outputs:\n  mask_timeout_ms: 0\n")
    with pytest.raises(ValueError, match="structured_outputs.mask_timeout_ms"):
        load_yaml_config(path)


# ---- the compiler --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(tiny_qwen):
    from specdec.models.loader import load_model
    return load_model(str(tiny_qwen), "float32", "cpu", False).tokenizer


def test_tiny_limits_refuse_an_ordinary_schema_naming_the_bound(tokenizer):
    ordinary = StructuredOutput("json_schema", _props(3))
    GrammarCompiler(tokenizer).compile(ordinary)
    for name, value in (("initial_lexer_fuel", 10), ("max_grammar_size", 5)):
        with pytest.raises(ValueError, match=f"structured_outputs.{name}={value}"):
            GrammarCompiler(tokenizer, StructuredConfig(**{name: value})).compile(ordinary)
        with pytest.raises(ValueError, match=f"structured_outputs.{name}={value}"):
            check_structured(ordinary, StructuredConfig(**{name: value}))


def test_a_slow_compile_is_refused_at_its_timeout_and_others_go_on(tokenizer):
    """A 20,000-rule chain takes seconds (its first mask): refused at compile_timeout_s, a resend at
    once, while an ordinary grammar compiles meanwhile."""
    compiler = GrammarCompiler(tokenizer, StructuredConfig(compile_timeout_s=0.5))
    slow = StructuredOutput("grammar", _lark_chain(20_000))
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"structured_outputs.compile_timeout_s=0.5s"):
        compiler.compile(slow)
    assert time.perf_counter() - t0 < HANG_GUARD_S
    compiler.compile(StructuredOutput("regex", "[a-z]{3}"))
    with pytest.raises(ValueError, match="compile_timeout_s"):
        compiler.compile(slow)


def test_compiles_running_at_once_are_bounded(tokenizer):
    """A compile refused at its timeout still runs (it cannot be stopped) and still counts: with
    max_concurrent_compiles=1 a new grammar is refused as busy until it ends; a compiled one is not."""
    from specdec.sample.structured import GrammarBusy
    compiler = GrammarCompiler(tokenizer, StructuredConfig(compile_timeout_s=0.5, max_concurrent_compiles=1))
    ready = StructuredOutput("regex", "[a-z]{3}")
    compiler.compile(ready)
    with pytest.raises(ValueError, match="compile_timeout_s"):
        compiler.compile(StructuredOutput("grammar", _lark_chain(20_000)))
    with pytest.raises(GrammarBusy, match="max_concurrent_compiles=1"):
        compiler.compile(StructuredOutput("regex", "[0-9]{3}"))
    compiler.compile(ready)
    deadline = time.perf_counter() + HANG_GUARD_S
    while compiler._pending and time.perf_counter() < deadline:   # the slow one runs to its end
        time.sleep(0.1)
    compiler.compile(StructuredOutput("regex", "[0-9]{3}"))


def test_the_mask_time_bound_refuses_at_compile_and_ends_a_request_mid_way(tokenizer):
    from llguidance import LLMatcher

    from specdec.grammar import GrammarState
    tiny = StructuredConfig(mask_timeout_ms=1e-6)   # any mask is over it
    regex = StructuredOutput("regex", "[a-z]{3}")
    with pytest.raises(ValueError, match="structured_outputs.mask_timeout_ms=1e-06"):
        GrammarCompiler(tokenizer, tiny).compile(regex)
    compiler = GrammarCompiler(tokenizer)
    matcher = LLMatcher(compiler.lltokenizer, compiler.compile(regex), log_level=0)
    state = GrammarState(matcher, tokenizer.vocab_size, tuple(tokenizer.eos_token_ids), tiny)
    allowed = state.allowed()   # over the bound: only EOS from here on
    assert "mask_timeout_ms" in state.error
    assert allowed.nonzero().flatten().tolist() == sorted(tokenizer.eos_token_ids)
    assert state.forced(4) == [] and state.valid_prefix([1, 2]) == 0 and not state.is_accepting


def test_a_bound_hit_mid_generation_ends_only_that_request(tiny_qwen):
    """An object of 30 properties passes its first mask; after "{" its parser row outgrows
    max_items_in_row=50: that request ends (EOS, the grammar's error names the bound), its
    unconstrained neighbour decodes exactly as alone."""
    engine = LLMEngine(engine_config(str(tiny_qwen)), progress=False)
    engine.grammars = GrammarCompiler(engine.tokenizer, StructuredConfig(max_items_in_row=50))
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = engine.add_request("hello there", plain)
    while engine.has_unfinished():
        engine.step()
    bounded = engine.add_request("hello", SamplingParams(max_tokens=40, temperature=0.0,
                                                         structured=StructuredOutput("json_schema", _props(30))))
    neighbour = engine.add_request("hello there", plain)
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    assert bounded.grammar.error is not None and "structured_outputs.max_items_in_row=50" in bounded.grammar.error
    assert outs[bounded.request_id].error == bounded.grammar.error and outs[neighbour.request_id].error is None
    assert bounded.status.value == "stop" and len(bounded.output_token_ids) < 40
    assert bounded.output_token_ids[-1] in engine.tokenizer.eos_token_ids
    assert neighbour.output_token_ids == alone.output_token_ids


def test_each_hostile_constraint_compiles_or_is_refused_within_seconds(tokenizer):
    compiler = GrammarCompiler(tokenizer)
    kinds = {"guided_regex": "regex", "guided_json": "json_schema", "guided_grammar": "grammar",
             "guided_choice": "choice"}
    for name, body in HOSTILE.items():
        (field, spec), = body.items()
        t0 = time.perf_counter()
        try:
            state = compiler.matcher(StructuredOutput(kinds[field], spec))
            for _ in range(8):   # a few tokens: masks stay bounded, or the grammar ends itself
                allowed = state.allowed()
                if allowed is None or state.error is not None:
                    break
                state.commit([int(allowed.nonzero()[0])])
        except ValueError as e:
            assert str(e), name
        assert time.perf_counter() - t0 < HANG_GUARD_S, name


# ---- tool calls ----------------------------------------------------------------------------------

def _calls_accepted(tokenizer, compiler: GrammarCompiler, grammar: StructuredOutput, n: int) -> bool:
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'   # the tags are text here
    tokens = tokenizer.encode("\n".join([call] * n), add_special_tokens=False)
    state = compiler.matcher(grammar)
    return state.valid_prefix(tokens) == len(tokens)


def test_required_and_named_tool_calls_are_bounded(tokenizer):
    """tool_choice required: at most MAX_PARALLEL_CALLS calls with parallel_tool_calls, exactly one
    without; a named function: exactly one call either way."""
    functions = [{"name": "get_time", "parameters": {"type": "object", "properties": {}}},
                 {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    compiler = GrammarCompiler(tokenizer)
    kw = {"tags_are_tokens": False}   # the tiny vocabulary has no call-tag tokens
    parallel = call_grammar(functions, None, True, **kw)
    assert _calls_accepted(tokenizer, compiler, parallel, MAX_PARALLEL_CALLS)
    assert not _calls_accepted(tokenizer, compiler, parallel, MAX_PARALLEL_CALLS + 1)
    for single in (call_grammar(functions, None, False, **kw), call_grammar(functions, "get_time", True, **kw),
                   call_grammar(functions, "get_time", False, **kw)):
        assert _calls_accepted(tokenizer, compiler, single, 1)
        assert not _calls_accepted(tokenizer, compiler, single, 2)


# ---- the server ----------------------------------------------------------------------------------

def _chat(server, **body):
    return chat(server, **{"max_tokens": 16, **body})


def test_hostile_constraints_are_answered_and_the_server_keeps_serving(server):
    answers = {}
    for name, body in HOSTILE.items():
        t0 = time.perf_counter()
        status, r = _chat(server, **body)
        answers[name] = (status, round(time.perf_counter() - t0, 2))
        assert status in (200, 400), (name, r)
        if status == 400:   # refused up front (param: the field), or a bound hit while generating
            err = r["error"]
            assert err["param"] in body or err["message"].startswith("structured output: exceeds "), (name, r)
        else:
            assert r["choices"][0]["finish_reason"] in ("stop", "length"), (name, r)
        assert answers[name][1] < HANG_GUARD_S, (name, answers[name])
    print(answers)
    status, r = _chat(server, guided_json={"type": "object", "properties": {"a": {"type": "integer"}},
                                           "required": ["a"], "additionalProperties": False}, max_tokens=40)
    assert status == 200 and r["choices"][0]["finish_reason"] == "stop", r
    status, r = _chat(server, max_tokens=4)
    assert status == 200, r


def test_tiny_limits_make_an_ordinary_schema_a_400_naming_the_bound(tiny_qwen):
    config = engine_config(str(tiny_qwen))
    config.structured = StructuredConfig(initial_lexer_fuel=10)
    client, engine = started_client(lambda: LLMEngine(config, progress=False), ServerConfig())
    try:
        with client:
            r = client.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 8,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _props(3)}}})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "response_format"
            assert "structured_outputs.initial_lexer_fuel=10" in error["message"]
            r = client.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 4})
            assert r.status_code == 200, r.text
    finally:
        engine.shutdown()


def test_a_stream_over_a_bound_ends_with_the_error_event_and_done(server):
    """A bound hit while generating: the stream says so (no cut-off JSON), then [DONE]."""
    import json
    import urllib.request
    body = {"model": server.model, "messages": [{"role": "user", "content": "go"}], "max_tokens": 16,
            "stream": True, "guided_json": _props(5000)}
    req = urllib.request.Request(server.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        events = [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "structured_output_bound" and "structured_outputs.max_items_in_row" in error["message"]
