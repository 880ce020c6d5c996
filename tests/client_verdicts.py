"""Telling a client test's server failures from its model's (tests/test_clients.py): a call the
model wrote but the server left in the content, a prompt that lacks the tools or a tool result, and
what the model writes after the captured request's prompt free of any grammar (POST /v1/completions
on the same token ids, greedy: the chat route's own text in auto mode), so a grammar or parser of the
server that bent the output fails the test rather than passing for the model's mistake. Only where
all of that clears the server does a check end in an xfail carrying the model's output."""
from __future__ import annotations

import json
import re

import pytest

from client_wire import Wire
from server_process import ServerProcess, http_json

DEFAULT_MAX_TOKENS = 64  # a request that names no max_tokens: as many for its free-running twin


def names_called_in_text(text: str | None) -> list[str]:
    """The function names of calls written out as JSON in text (```json fenced or bare)."""
    return re.findall(r'"name"\s*:\s*"([^"]+)"', text or "")


def rendered_prompt(server: ServerProcess, request_body: str) -> str:
    """The prompt the server templates a captured chat request's messages and tools into."""
    body = json.loads(request_body)
    status, tokens = http_json(server, "/tokenize", {"messages": body["messages"], "tools": body.get("tools")})
    assert status == 200, tokens
    status, text = http_json(server, "/detokenize", {"tokens": tokens["tokens"]})
    assert status == 200, text
    return text["prompt"]


def chat_equivalent(request_body: str) -> str:
    """A Responses request as the chat request it should render like: instructions as the system
    message, message items as messages, function_call / function_call_output items as an assistant
    turn's tool_calls and tool messages, function tools as tools."""
    body = json.loads(request_body)
    messages = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
    items = body["input"] if isinstance(body["input"], list) else [{"role": "user", "content": body["input"]}]
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            content = item["content"]
            if isinstance(content, list):  # input_text / output_text parts
                content = "".join(part.get("text", "") for part in content)
            messages.append({"role": item["role"], "content": content})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    keys = ("name", "description", "parameters", "strict")
    tools = [{"type": "function", "function": {k: t[k] for k in keys if k in t}}
             for t in body.get("tools") or [] if t.get("type") == "function"]
    chat = {"messages": messages, "tools": tools or None, "max_tokens": body.get("max_output_tokens")}
    if ((body.get("text") or {}).get("format") or {}).get("type") == "json_schema":
        chat["response_format"] = body["text"]["format"]
    return json.dumps(chat)


def chat_requests(wire: Wire) -> list[str]:
    """The test's chat requests (a Responses request as its chat equivalent), in order."""
    return [e.request_body if e.url.endswith("/chat/completions") else chat_equivalent(e.request_body)
            for e in wire.exchanges if e.url.endswith(("/chat/completions", "/responses"))]


def last_chat_request(wire: Wire) -> str | None:
    return (chat_requests(wire) or [None])[-1]


def first_request_after_result(wire: Wire) -> str | None:
    """The first chat request carrying a tool result: where the model should have answered."""
    with_result = [r for r in chat_requests(wire) if any(m.get("role") == "tool" for m in json.loads(r)["messages"])]
    return (with_result or [None])[0]


def unconstrained_text(server: ServerProcess, request_body: str) -> str:
    """What the model writes, greedy and free of any grammar, after the prompt a captured chat
    request renders to (POST /v1/completions on its token ids): the chat route's text in auto mode."""
    body = json.loads(request_body)
    status, tokens = http_json(server, "/tokenize", {"messages": body["messages"], "tools": body.get("tools")})
    assert status == 200, tokens
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS
    status, out = http_json(server, "/v1/completions", {"model": server.model, "prompt": tokens["tokens"],
                                                         "max_tokens": max_tokens, "temperature": 0})
    assert status == 200, out
    return out["choices"][0]["text"]


def explain_missing_call(server: ServerProcess, wire: Wire, text: str | None, name: str) -> None:
    """No tool call came back where the model should have called `name`. A failure when it did call
    it (in the content, left unparsed), when the prompt lacks the tool, or when the model writing
    freely after that prompt calls it (so the request's response_format grammar kept it from
    calling); else an xfail carrying the output (it called a function it was not given, or answered)."""
    called = names_called_in_text(text)
    assert name not in called, f"the model called {name} in its content, the server returned no tool_calls: {text!r}"
    request = last_chat_request(wire)
    assert request is not None, f"no call to {name} and no request to check: {text!r}"
    prompt = rendered_prompt(server, request)
    assert f'"name": "{name}"' in prompt, f"the tool is not in the prompt the server rendered:\n{prompt}"
    free = unconstrained_text(server, request)
    assert name not in names_called_in_text(free), (
        f"writing freely the model calls {name}: {free!r}; the server returned no tool_calls but {text!r}"
        + (" (the request's response_format grammar kept it from calling)"
           if "response_format" in json.loads(request) else ""))
    if called:
        pytest.xfail(f"model quality: called {called}, not a tool it was given ({name!r}): {text!r}")
    pytest.xfail(f"model quality: answered instead of calling {name}: {text!r}")


def check_answer_uses_result(server: ServerProcess, wire: Wire, answer: str | None, calls: list | None, *,
                             result: str, call_name: str) -> None:
    """The answer after a tool result must quote `result` and call nothing more. Otherwise a failure
    when the prompt of the request that should have been answered lacks the call or its result, or
    when the model, writing freely after that prompt, quotes the result but the server returned
    calls (it parsed the answer into a call, or its response_format grammar made the model call
    again); else an xfail carrying the output (the model read the result and answered without it,
    or called again of itself)."""
    if answer and result in answer and not calls:
        return
    unparsed = call_name in names_called_in_text(answer)  # called again, in the content
    # the first request with the result, where calls came back (a loop's later turns follow from it)
    request = first_request_after_result(wire) if calls else last_chat_request(wire)
    assert request is not None, f"no chat request with the tool result; answer {answer!r}, calls {calls!r}"
    prompt = rendered_prompt(server, request)
    assert re.search(r"<tool_response>\s*" + re.escape(result) + r"\s*</tool_response>", prompt), \
        f"the tool result is not in the prompt the server rendered:\n{prompt}"
    assert call_name in names_called_in_text(prompt), f"the call is not in the rendered prompt:\n{prompt}"
    if calls or unparsed:
        free = unconstrained_text(server, request)
        if "response_format" in json.loads(request):
            assert result not in free, (f"writing freely the model answers {free!r}; under the request's "
                                        f"response_format with tools the server had it call again: {calls!r}")
        else:
            assert result not in free, (f"the model wrote {free!r}; the server parsed that into tool calls "
                                        f"{calls!r} with content {answer!r}")
        if unparsed and not calls:
            pytest.xfail(f"model quality: called {call_name} again instead of answering with the result, "
                         f"as JSON in the content (which the server left unparsed): {answer!r}")
        pytest.xfail(f"model quality: called again instead of answering with the result: {calls!r}; "
                     f"its text unconstrained: {free!r}")
    pytest.xfail(f"model quality: answered without the tool result it was given: {answer!r}")
