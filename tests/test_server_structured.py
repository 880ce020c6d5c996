"""Structured outputs and tool calls through the server (tiny random model with n-gram speculation):
response_format and guided_* constrain the output, the openai client's parse() works with a
pydantic model, required and named tool calls come back as `tool_calls` (streamed as OpenAI
streams them), invalid constraints and unknown fields are 400s naming the field."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
from openai import BadRequestError
from pydantic import BaseModel, Field
from server_process import http_json, yaml_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 8},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "year", "tags"],
          "properties": {"title": {"type": "string", "maxLength": 8}, "year": {"type": "integer", "maximum": 3000},
                         "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["a", "b"]}}}}


class Book(BaseModel):
    title: str = Field(max_length=8)
    year: int = Field(ge=0, le=3000)


@pytest.fixture(scope="module")
def server(tiny_qwen, tmp_path_factory):
    s = yaml_server(tmp_path_factory.mktemp("structured"), f"""
execution_config:
  target_model: {tiny_qwen}
  draft_model: ngram
""", ("--threads", "1", "--precision", "float32"))
    yield s
    s.stop()


def chat(server, **body):
    return http_json(server, "/v1/chat/completions",
                     {"model": server.model, "messages": [{"role": "user", "content": "go"}], "temperature": 0,
                      "max_tokens": 120, **body})


def test_response_format_json_schema_and_json_object(server):
    status, r = chat(server, response_format={"type": "json_schema",
                                              "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}})
    assert status == 200, r
    jsonschema.validate(json.loads(r["choices"][0]["message"]["content"]), SCHEMA)
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["speculative"]["forced_accepted_tokens"] > 0
    status, r = chat(server, response_format={"type": "json_object"}, max_tokens=60)
    assert status == 200 and r["choices"][0]["finish_reason"] == "stop", r
    assert isinstance(json.loads(r["choices"][0]["message"]["content"]), dict)


def test_guided_fields_on_both_routes(server):
    status, r = chat(server, guided_choice=["red", "green", "blue"])
    assert status == 200 and r["choices"][0]["message"]["content"] in ("red", "green", "blue")
    status, r = chat(server, guided_regex=r"\d{3}-[a-z]{2}")
    assert status == 200 and re.fullmatch(r"\d{3}-[a-z]{2}", r["choices"][0]["message"]["content"])
    status, r = chat(server, guided_grammar='root ::= "on" | "off"')
    assert status == 200 and r["choices"][0]["message"]["content"] in ("on", "off")
    status, r = http_json(server, "/v1/completions", {"model": server.model, "prompt": "x", "max_tokens": 60,
                                                      "temperature": 0, "guided_json": SCHEMA})
    assert status == 200, r
    jsonschema.validate(json.loads(r["choices"][0]["text"]), SCHEMA)


def test_openai_parse_with_a_pydantic_model(server):
    client = server.client()
    done = client.chat.completions.parse(model=server.model, messages=[{"role": "user", "content": "a book"}],
                                         response_format=Book, max_tokens=120, temperature=0)
    book = done.choices[0].message.parsed
    assert isinstance(book, Book) and isinstance(book.year, int)
    beta = client.beta.chat.completions.parse(model=server.model, messages=[{"role": "user", "content": "a book"}],
                                              response_format=Book, max_tokens=120, temperature=0)
    assert beta.choices[0].message.parsed == book


def test_required_and_named_tool_calls(server):
    client = server.client()
    r = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "weather?"}],
                                       tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=120,
                                       temperature=0, parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    fn = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]["function"]
    jsonschema.validate(json.loads(call.function.arguments), fn["parameters"])
    r = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "weather?"}],
                                       tools=[WEATHER, CLOCK], max_tokens=120, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"}
    # the result goes back into the conversation, and the next turn is a plain answer
    follow = client.chat.completions.create(
        model=server.model, max_tokens=8, temperature=0, tools=[WEATHER],
        messages=[{"role": "user", "content": "weather?"},
                  {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                  {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 3}'}], tool_choice="none")
    assert follow.choices[0].message.tool_calls is None and follow.choices[0].finish_reason in ("stop", "length")


def test_streamed_tool_calls_match_the_whole_response(server):
    client = server.client()
    kw = dict(model=server.model, messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER],
              tool_choice="required", max_tokens=120, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    names, args, ids, finish = {}, {}, {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        c = chunk.choices[0]
        finish = c.finish_reason or finish
        for d in c.delta.tool_calls or []:
            if d.id:
                ids[d.index], names[d.index] = d.id, d.function.name
            args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
    assert finish == "tool_calls"
    assert [names[i] for i in sorted(names)] == [c.function.name for c in whole]
    assert [args[i] for i in sorted(args)] == [c.function.arguments for c in whole]
    assert all(ids[i].startswith("call_") for i in ids)


@pytest.mark.parametrize("body,param,fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format", "frob"),
    ({"guided_regex": "(ab"}, "guided_regex", "regular expression"),
    ({"guided_grammar": "start: nothing_here"}, "guided_grammar", "nothing_here"),
    ({"guided_choice": []}, "guided_choice", ""),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "response_format", "at most one"),
    ({"response_format": {"type": "xml"}}, "response_format.type", ""),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "response_format only"),
    ({"modalities": ["audio"]}, "modalities", "unrecognized field"),
    ({"messages": [{"role": "user", "content": "x", "bogus": 1}]}, "messages.0.bogus", "unrecognized"),
])
def test_bad_constraints_and_unknown_fields_are_400s(server, body, param, fragment):
    status, r = chat(server, **body)
    assert status == 400, r
    assert r["error"]["param"] == param, r
    assert fragment in r["error"]["message"]
    with pytest.raises(BadRequestError):
        server.client().chat.completions.create(model=server.model, messages=[{"role": "user", "content": "x"}],
                                                extra_body={"guided_regex": "(ab"})


def test_bookkeeping_fields_are_accepted(server):
    status, r = chat(server, user="u-1", metadata={"k": "v"}, store=False, max_tokens=4)
    assert status == 200, r
