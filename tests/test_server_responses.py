"""POST /v1/responses and GET /v1/models/{model} (tiny random model, n-gram speculation), driven by
the openai client: string and item inputs and instructions prompt exactly as the equivalent chat
request does, json_schema formats and required tool calls are enforced, a function call and its
output go back into the conversation, streamed events come in OpenAI's order and add up to the
final response, a client leaving a stream aborts its request, and what needs server state
(previous_response_id, store) or is unknown is a 400 naming the field."""
from __future__ import annotations

import json
import socket
import time

import jsonschema
import pytest
from openai import BadRequestError, NotFoundError
from pydantic import BaseModel, Field
from server_process import http_json, slow_server, yaml_server

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                          "properties": {"city": {"type": "string", "maxLength": 8},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}}}}
CLOCK = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "year"],
          "properties": {"title": {"type": "string", "maxLength": 8}, "year": {"type": "integer", "maximum": 3000}}}


class Book(BaseModel):
    title: str = Field(max_length=8)
    year: int = Field(ge=0, le=3000)


@pytest.fixture(scope="module")
def server(tiny_qwen, tmp_path_factory):
    s = yaml_server(tmp_path_factory.mktemp("responses"), f"""
execution_config:
  target_model: {tiny_qwen}
  draft_model: ngram
""", ("--threads", "1", "--precision", "float32"))
    yield s
    s.stop()


def respond(server, **kw):
    kw = {"model": server.model, "temperature": 0, "max_output_tokens": 12, **kw}
    return server.client().responses.create(**kw)


def chat(server, messages, **kw):
    kw = {"model": server.model, "temperature": 0, "max_tokens": 12, **kw}
    return server.client().chat.completions.create(messages=messages, **kw)


def test_a_string_input_is_one_user_message(server):
    r = respond(server, input="hello there")
    assert r.object == "response" and r.id.startswith("resp_") and r.model == server.model
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert r.output_text == item.content[0].text and item.content[0].type == "output_text"
    same = chat(server, [{"role": "user", "content": "hello there"}])
    assert r.output_text == same.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (same.usage.prompt_tokens, same.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    if same.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert item.status == "incomplete"
    else:
        assert r.status == "completed" and r.incomplete_details is None
    assert r.store is False and r.error is None and r.max_output_tokens == 12 and r.text.format.type == "text"


def test_message_items_instructions_and_developer_prompt_as_chat_does(server):
    parts = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello "},
                                                              {"type": "input_text", "text": "there"}]}]
    assert respond(server, input=parts).output_text == respond(server, input="hello there").output_text
    r = respond(server, input="hi", instructions="Answer in French.")
    same = chat(server, [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "hi"}])
    assert r.output_text == same.choices[0].message.content and r.usage.input_tokens == same.usage.prompt_tokens
    assert r.instructions == "Answer in French."
    developer = respond(server, input=[{"role": "developer", "content": "Answer in French."},
                                       {"role": "user", "content": "hi"}])
    assert developer.output_text == r.output_text
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": r.output_text},
             {"role": "user", "content": "again"}]
    # an earlier response's output items, sent back as they are, are the assistant's turn
    again = respond(server, input=[turns[0], *r.output, turns[2]])
    same = chat(server, turns)
    assert again.usage.input_tokens == same.usage.prompt_tokens and again.output_text == same.choices[0].message.content


@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings")  # the client serializing its parsed Book
def test_json_schema_format_is_enforced_and_parsed(server):
    r = respond(server, input="a book", max_output_tokens=120,
                text={"format": {"type": "json_schema", "name": "book", "schema": SCHEMA, "strict": True}})
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema" and r.text.format.name == "book"
    parsed = server.client().responses.parse(model=server.model, input="a book", text_format=Book,
                                             max_output_tokens=120, temperature=0)
    assert isinstance(parsed.output_parsed, Book)
    follow = respond(server, input=[{"role": "user", "content": "a book"}, *parsed.output,
                                    {"role": "user", "content": "another"}])
    assert follow.output_text
    r = respond(server, input="x", max_output_tokens=60, text={"format": {"type": "json_object"}})
    assert r.status == "completed" and isinstance(json.loads(r.output_text), dict)


def test_a_required_tool_call_is_a_function_call_item(server):
    r = respond(server, input="weather?", tools=[WEATHER, CLOCK], tool_choice="required",
                parallel_tool_calls=False, max_output_tokens=120)
    assert r.status == "completed"
    (call,) = r.output
    assert call.type == "function_call" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    schema = {"get_weather": WEATHER, "get_time": CLOCK}[call.name]["parameters"]
    jsonschema.validate(json.loads(call.arguments), schema)
    assert r.tools[0].name == "get_weather" and r.tool_choice == "required" and r.parallel_tool_calls is False
    named = respond(server, input="weather?", tools=[WEATHER, CLOCK], max_output_tokens=120,
                    tool_choice={"type": "function", "name": "get_weather"})
    assert [c.name for c in named.output if c.type == "function_call"] == ["get_weather"]


def test_function_call_and_output_items_go_back_into_the_conversation(server):
    first = respond(server, input="weather?", tools=[WEATHER], tool_choice="required", max_output_tokens=120)
    (call,) = first.output
    items = [{"role": "user", "content": "weather?"}, *first.output,   # sent back as the client returned them
             {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 3}'}]
    r = respond(server, input=items, tools=[WEATHER], tool_choice="none", max_output_tokens=8)
    assert [o.type for o in r.output] == ["message"]
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call.call_id, "type": "function",
                     "function": {"name": call.name, "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": '{"temp": 3}'}]
    same = chat(server, messages, tools=[{"type": "function", "function": {
        k: v for k, v in WEATHER.items() if k != "type"}}], tool_choice="none", max_tokens=8)
    assert r.usage.input_tokens == same.usage.prompt_tokens and r.output_text == same.choices[0].message.content


TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.done", "response.content_part.done",
               "response.output_item.done", "response.completed"]


def test_streamed_text_events_add_up_to_the_response(server):
    whole = respond(server, input="hello there", max_output_tokens=16)
    events = list(respond(server, input="hello there", max_output_tokens=16, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events if e.type != "response.output_text.delta"]
    assert kinds == TEXT_EVENTS
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and [e.type for e in events[4:4 + len(deltas)]] == ["response.output_text.delta"] * len(deltas)
    text = "".join(e.delta for e in deltas)
    final = events[-1].response
    assert text == final.output_text == events[-4].text == whole.output_text
    assert {e.item_id for e in deltas} == {final.output[0].id} and events[0].response.status == "in_progress"
    assert final.usage.output_tokens == whole.usage.output_tokens and final.status == whole.status
    with server.client().responses.stream(model=server.model, input="hello there", max_output_tokens=16,
                                          temperature=0) as stream:
        assert stream.get_final_response().output_text == whole.output_text


def test_streamed_tool_calls_add_up_to_the_response(server):
    kw = dict(input="weather?", tools=[WEATHER, CLOCK], tool_choice="required", max_output_tokens=200)
    whole = respond(server, **kw)
    events = list(respond(server, stream=True, **kw))
    final = events[-1].response
    assert [(c.name, c.arguments) for c in final.output] == [(c.name, c.arguments) for c in whole.output]
    for index, call in enumerate(final.output):
        mine = [e for e in events if getattr(e, "output_index", None) == index]
        assert [e.type for e in mine if e.type != "response.function_call_arguments.delta"] == [
            "response.output_item.added", "response.function_call_arguments.done", "response.output_item.done"]
        assert mine[0].item.call_id == call.call_id and mine[0].item.id == call.id
        assert "".join(e.delta for e in mine if e.type == "response.function_call_arguments.delta") == call.arguments


def test_a_stream_over_a_structured_output_bound_ends_with_an_error_event(server):
    # 5,000 properties: compiles, then the default structured_outputs.max_items_in_row stops it
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(5000)}}
    events = list(respond(server, input="go", max_output_tokens=16, stream=True,
                          text={"format": {"type": "json_schema", "name": "wide", "schema": schema}}))
    assert events[0].type == "response.created" and events[-1].type == "error"
    assert events[-1].code == "structured_output_bound" and "max_items_in_row" in events[-1].message
    assert events[-1].sequence_number == len(events) - 1


@pytest.mark.parametrize("body,param,fragment", [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
    ({"store": True}, "store", "stores no responses"),
    ({"reasoning": {"effort": "low"}}, "reasoning", "not supported"),
    ({"include": ["message.output_text.logprobs"]}, "include", "nothing extra"),
    ({"truncation": "auto"}, "truncation", ""),
    ({"modalities": ["audio"]}, "modalities", "unrecognized field"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"input": []}, "input", "at least 1"),
    ({"input": [{"role": "user", "content": "x", "bogus": 1}]}, "input.0.message.bogus", "unrecognized"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
     "input.0.function_call.arguments", "JSON object"),
    ({"input": [{"type": "image"}]}, "input.0", "message, function_call or function_call_output"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "frob"}}}}, "text.format", "frob"),
    ({"max_output_tokens": 10**6}, "max_output_tokens", "max_output_tokens"),
])
def test_refusals_are_400s_naming_the_field(server, body, param, fragment):
    status, r = http_json(server, "/v1/responses", {"model": server.model, "input": "x", **body})
    assert status == 400, r
    assert r["error"]["param"] == param and fragment in r["error"]["message"], r


def test_the_openai_client_sees_a_refusal(server):
    with pytest.raises(BadRequestError):
        server.client().responses.create(model=server.model, input="x", previous_response_id="resp_1")
    status, r = http_json(server, "/v1/responses", {"model": "nope", "input": "x"})
    assert status == 404 and r["error"]["code"] == "model_not_found"
    assert respond(server, input="x", store=False, user="u-1", metadata={"k": "v"}, include=[], tools=[],
                   tool_choice="auto", truncation="disabled", reasoning=None).metadata == {"k": "v"}


def test_models_retrieve(server):
    client = server.client()
    card = client.models.retrieve(server.model)
    listed = client.models.list().data[0]
    assert card.id == listed.id == server.model and card.model_extra.keys() == listed.model_extra.keys()
    with pytest.raises(NotFoundError):
        client.models.retrieve("nope")
    status, r = http_json(server, "/v1/models/org/nope")
    assert status == 404 and r["error"]["code"] == "model_not_found" and r["error"]["param"] == "model"


def test_a_client_leaving_a_stream_aborts_it(tiny_qwen):
    """In process, every engine step slowed down: the client reads the first events and leaves; the
    request ends as an abort with its blocks freed."""
    with slow_server(str(tiny_qwen)) as (engine, local, metrics):
        deadline = time.time() + 60
        count = lambda sample, status: sample.get(f'specdec_requests_total{{status="{status}"}}', 0)  # noqa: E731
        before = metrics()
        body = json.dumps({"input": "count", "max_output_tokens": 400, "stream": True, "temperature": 0}).encode()
        with socket.create_connection(("127.0.0.1", local.port)) as sock:
            sock.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            seen = b""
            while b"response.output_text.delta" not in seen and time.time() < deadline:
                seen += sock.recv(65536)
        while metrics().get("specdec_num_requests_running", 0) > 0 and time.time() < deadline:
            time.sleep(0.05)
        m = metrics()
        assert m['specdec_kv_blocks_used{pool="target"}'] == 0
        assert count(m, "abort") == count(before, "abort") + 1 and count(m, "length") == count(before, "length")
