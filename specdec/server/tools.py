"""OpenAI tools on top of a hermes-style chat template (Qwen2.5): the request side.

The model calls a tool by writing, one block per call (several separated by "\\n"):

    <tool_call>
    {"name": "<function-name>", "arguments": <JSON object>}
    </tool_call>

- check_tools(tools): validates a request's OpenAI `tools` and returns their function dicts
  ({"name", "parameters"} and "description" when given). ValueError names the bad field.
- tool_grammar(functions, required_name, parallel): a StructuredOutput("grammar", <Lark text for
  llguidance>) that forces the output to be one call (or, with parallel, one to MAX_PARALLEL_CALLS
  separated by "\\n") to one of the functions (only `required_name` when given), with arguments matching that
  function's `parameters` schema, written as json.dumps writes them (", " and ": "). A function whose
  schema declares no properties (or has no `parameters`) takes no arguments: its arguments are `{}`.
- tool_messages(messages): OpenAI chat messages made ready for the chat template (assistant
  `tool_calls[*].function.arguments` JSON strings parsed into dicts, which the template `tojson`s).

Reading calls back out of the output, whole or streamed, is tool_calls.py.
"""
from __future__ import annotations

import copy
import json
import re
from typing import Any

from specdec.sampling_params import StructuredOutput
from specdec.server.tool_calls import CLOSE, OPEN

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_TAG = re.compile(r"<[^<>\s]+>")  # llguidance Lark's reference to a special token
# what the chat template's tojson (json.dumps) writes, so forced calls look like the model's own
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
_EMPTY_SCHEMA_KEYS = {"type", "properties", "required", "title", "description", "$schema"}
# a required call's grammar ends after the last call it allows, so the model must stop there: one
# call without parallel_tool_calls, at most this many with it (a model cannot loop on calls forever)
MAX_PARALLEL_CALLS = 16


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
    if not isinstance(name, str) or not _NAME.fullmatch(name):
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


def tool_grammar(functions: list[dict], required_name: str | None, parallel: bool, *,
                 open_tag: str = OPEN, close_tag: str = CLOSE, tags_are_tokens: bool = True) -> StructuredOutput:
    """A Lark grammar (llguidance dialect) forcing one tool call, or with `parallel` one to
    MAX_PARALLEL_CALLS separated by "\\n", to `required_name` if given, else to any of `functions`.
    `open_tag` and `close_tag` are the special tokens around a call, as the tokenizer names them
    (`tags_are_tokens` False: a vocabulary without them, where they are plain text). Raises ValueError."""
    for tag in (open_tag, close_tag):
        if not _TAG.fullmatch(tag):
            raise ValueError(f"a tool call tag must be a special token's name like <tool_call>, got {tag!r}")
    if not tags_are_tokens:
        open_tag, close_tag = json.dumps(open_tag), json.dumps(close_tag)
    if required_name is not None:
        functions = [f for f in functions if f.get("name") == required_name]
        if not functions:
            raise ValueError(f"tool_choice names function {required_name!r}, which is not among the tools")
    if not functions:
        raise ValueError("no tools to call")
    alternatives = " | ".join(f"fn_{i}" for i in range(len(functions)))
    lines = [f'start: call ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else "start: call",
             f'call: {open_tag} "\\n" ({alternatives}) "\\n" {close_tag}']
    for i, fn in enumerate(functions):
        lines += _function_rules(i, fn)
    return StructuredOutput("grammar", "\n".join(lines) + "\n")


def _function_rules(i: int, fn: dict) -> list[str]:
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"function name {name!r} is not 1-64 characters of a-z, A-Z, 0-9, _ and -")
    # a literal head and a schema for the arguments alone, so "#/$defs/..." refs in them still resolve
    head = json.dumps(f'{{"name": "{name}", "arguments": ')
    return [f'fn_{i}: {head} args_{i} "}}"',
            f"args_{i}: %json {json.dumps(_arguments_schema(fn.get('parameters')))}"]


def _arguments_schema(params: dict | None) -> dict:
    if params is None or (not params.get("properties") and not params.get("required")
                          and set(params) <= _EMPTY_SCHEMA_KEYS):
        return {**_NO_ARGUMENTS, "x-guidance": _JSON_STYLE}  # no parameters declared: none taken
    return {**params, "x-guidance": _JSON_STYLE}


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
