"""OpenAI tools on top of a hermes-style chat template (Qwen2.5): the request side.

The model calls a tool by writing, one block per call (several separated by "\\n"):

    <tool_call>
    {"name": "<function-name>", "arguments": <JSON object>}
    </tool_call>

- check_tools(tools): validates a request's OpenAI `tools` and returns their function dicts
  ({"name", "parameters"} and "description" when given). ValueError names the bad field.
- tool_messages(messages): OpenAI chat messages made ready for the chat template (assistant
  `tool_calls[*].function.arguments` JSON strings parsed into dicts, which the template `tojson`s).
- with_answer_format(messages, answer): the conversation with the system message telling the model
  the JSON its final answer must take, when a response_format goes with tools.

The grammars of tool_choice are tool_grammar.py; reading calls back out of the output, whole or
streamed, is tool_calls.py.
"""
from __future__ import annotations

import copy
import json
import re
from typing import Any

from specdec.sampling_params import StructuredOutput
from specdec.server.tool_scan import CLOSE, OPEN

TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")   # OpenAI's rule for a function's name


# ---- request side -----------------------------------------------------------------------------

def check_tools(tools: list[dict]) -> list[dict]:
    """The function dicts of OpenAI `tools`, checked: {"name", "parameters"} plus "description"
    when given; `parameters` defaults to an empty object schema. Raises ValueError."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools must be a non-empty list")
    functions: list[dict] = []
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        fn = _check_tool(tool, f"tools[{i}]")
        if fn["name"] in seen:
            raise ValueError(f"tools[{i}].function.name {fn['name']!r} repeats tools[{seen[fn['name']]}]'s")
        seen[fn["name"]] = i
        functions.append(fn)
    return functions


def _check_tool(tool: Any, where: str) -> dict:
    if not isinstance(tool, dict):
        raise ValueError(f"{where} must be an object")
    if tool.get("type") != "function":
        raise ValueError(f"{where}.type must be 'function', got {tool.get('type')!r}")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise ValueError(f"{where}.function must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise ValueError(f"{where}.function.name must be 1-64 characters of a-z, A-Z, 0-9, _ and -, got {name!r}")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise ValueError(f"{where}.function.description must be a string")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    elif not isinstance(params, dict) or params.get("type", "object") != "object":
        raise ValueError(f"{where}.function.parameters must be a JSON schema of type object")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise ValueError(f"{where}.function.strict must be a boolean")
    checked = {"name": name, "parameters": params}
    if description is not None:
        checked["description"] = description
    return checked


def vocab_has_call_tags(tokenizer) -> bool:
    """Whether the vocabulary has the call tags as single tokens (Qwen2.5 does)."""
    return all(len(tokenizer.encode(tag, add_special_tokens=False)) == 1 for tag in (OPEN, CLOSE))


def tool_messages(messages: list[dict]) -> list[dict]:
    """A copy of OpenAI chat messages for the chat template: each assistant tool call's
    `function.arguments` JSON string becomes a dict. Raises ValueError for one that is not JSON."""
    out = copy.deepcopy(messages)
    for i, message in enumerate(out):
        if message.get("role") != "assistant":
            continue
        for j, call in enumerate(message.get("tool_calls") or []):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict):
                raise ValueError(f"messages[{i}].tool_calls[{j}].function must be an object")
            fn["arguments"] = _arguments_object(fn.get("arguments"), f"messages[{i}].tool_calls[{j}].function.arguments")
    return out


def with_answer_format(messages: list[dict], answer: StructuredOutput) -> list[dict]:
    """`messages` with the answer's format added to the system message (one is put first if there is
    none) once a tool's result is in the conversation; unchanged before. OpenAI's models see a
    response_format's schema too. Held to "a call or this JSON", the 1.5B told the JSON from the
    start answers at once with made-up values; never told it, it calls the same tool again and
    again after the result. Told once the result is in, it calls, then answers from the result."""
    if not any(m.get("role") == "tool" for m in messages):
        return messages
    if answer.kind == "json_schema":
        schema = json.loads(answer.spec) if isinstance(answer.spec, str) else answer.spec
        note = ("When you answer without calling a tool, reply with only a JSON object that follows this "
                f"JSON schema: {json.dumps(schema, ensure_ascii=False)}")
    else:
        note = "When you answer without calling a tool, reply with only a JSON object."
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0].get('content') or ''}\n\n{note}".lstrip()
    else:
        out.insert(0, {"role": "system", "content": note})
    return out


def _arguments_object(arguments: Any, where: str) -> dict:
    if isinstance(arguments, dict):
        return arguments  # already an object (some clients send one)
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {}
    if not isinstance(arguments, str):
        raise ValueError(f"{where} must be a JSON string")
    try:
        value = json.loads(arguments)
    except ValueError as e:
        raise ValueError(f"{where} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a JSON object")
    return value
