"""The grammars behind OpenAI's tool_choice, for a hermes-style model (Qwen2.5), in llguidance's Lark.

- call_grammar (tool_choice "required" or a named function): the output is tool calls only, each
  `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`: one for a named function, one to
  MAX_PARALLEL_CALLS separated by "\\n" for "required". Whitespace may follow the last call before
  the end of the turn: the model ends its turn as "</tool_call>\\n<|endoftext|>", and a grammar that
  read that "\\n" as the separator made it write call after call until max_tokens.
- auto_grammar (tool_choice "auto"), a lazy grammar as llama.cpp's: text is free until the output
  starts a call in one of the forms this family writes (the `<tool_call>` token, or a JSON object
  opening `{"name": "<an offered tool>"`, fenced as ```json or bare), and the rest of that call is
  constrained to the tool's schema. With an `answer` (response_format's JSON), the output is either
  calls (tagged or bare: a fence, this model's usual opening for any JSON, would steer every answer
  into a call) or that answer: the schema constrains only the final text answer, as OpenAI applies it.

Arguments are written as json.dumps writes them (", " and ": "), so a call's punctuation is forced
(free drafts under speculation). A function whose schema declares no properties takes `{}`.
"""
from __future__ import annotations

import json
import re

from specdec.sampling_params import StructuredOutput
from specdec.server.tool_scan import CLOSE, OPEN
from specdec.server.tools import TOOL_NAME

_TAG = re.compile(r"<[^<>\s]+>")  # llguidance Lark's reference to a special token
# what the chat template's tojson (json.dumps) writes, so forced calls look like the model's own
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
_EMPTY_SCHEMA_KEYS = {"type", "properties", "required", "title", "description", "$schema"}
# a required call's grammar ends after the last call it allows: a model cannot loop on calls forever
MAX_PARALLEL_CALLS = 16
_TEXT = "TEXT: /(?s:.*)/"
_TRAILING_WS = "WS: /[ \\t\\r\\n]+/"


def call_grammar(functions: list[dict], required_name: str | None, parallel: bool, *,
                 open_tag: str = OPEN, close_tag: str = CLOSE, tags_are_tokens: bool = True) -> StructuredOutput:
    """Tool calls only: exactly one to `required_name` when given (whatever `parallel` says), else
    one (or with `parallel` up to MAX_PARALLEL_CALLS) to any of `functions`. `open_tag` and
    `close_tag` are the special tokens around a call, as the tokenizer names them (`tags_are_tokens`
    False: a vocabulary without them, where they are plain text). Raises ValueError."""
    if required_name is not None:
        functions = [f for f in functions if f.get("name") == required_name]
        if not functions:
            raise ValueError(f"tool_choice names function {required_name!r}, which is not among the tools")
        parallel = False   # OpenAI and vLLM answer a named choice with exactly one call
    repeat = f'("\\n" tagged){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
    lines = [f"start: tagged {repeat} WS?", _TRAILING_WS]
    lines += _tagged_rules(functions, _tags(open_tag, close_tag, tags_are_tokens))
    return StructuredOutput("grammar", "\n".join(lines) + "\n")


def auto_grammar(functions: list[dict], answer: StructuredOutput | None = None, *, open_tag: str = OPEN,
                 close_tag: str = CLOSE, tags_are_tokens: bool = True) -> StructuredOutput:
    """tool_choice "auto": free text with calls recognised and constrained once they start (see the
    module docstring); with `answer` (a "json" or "json_schema" StructuredOutput), either calls or
    that JSON answer. Raises ValueError."""
    tags = _tags(open_tag, close_tag, tags_are_tokens)
    lines = _tagged_rules(functions, tags)
    if answer is None:
        lines += _lazy_rules(functions)
        return StructuredOutput("grammar", "\n".join(lines) + "\n")
    calls = " | ".join(f"jcall_{i}" for i in range(len(functions)))
    lines += [f'start: call ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}} WS? | answer', _TRAILING_WS,
              f"call: tagged | {calls}",
              f"answer: %json {json.dumps(_answer_schema(answer))}"]
    for i, fn in enumerate(functions):   # %json like the answer: one lexeme class, told apart by content
        lines.append(f"jcall_{i}: %json {json.dumps(_call_schema(fn))}")
    return StructuredOutput("grammar", "\n".join(lines) + "\n")


def _lazy_rules(functions: list[dict]) -> list[str]:
    """Free text, with a call starting at the first `{"name": "<an offered tool>"` (a lazy lexeme:
    the text ends where the trigger does) or at the `<tool_call>` token. After the trigger the
    arguments follow their schema, spaced as the model likes (it chose the layout: "{\\n  " often);
    members after them are allowed, so a model that adds its own "response" writes text, not a call."""
    heads = " | ".join(f"json_{i}" for i in range(len(functions)))
    lines = ["start: segment* TEXT", f"segment: TEXT tagged | {heads}", _TEXT,
             'ARGUMENTS_KEY: /[ \\t\\r\\n]*,[ \\t\\r\\n]*"arguments"[ \\t\\r\\n]*:[ \\t\\r\\n]*/',
             'MEMBER_KEY: /[ \\t\\r\\n]*,[ \\t\\r\\n]*"(\\\\.|[^"\\\\])*"[ \\t\\r\\n]*:[ \\t\\r\\n]*/',
             "member_value: %json {}", "END_OBJECT: /[ \\t\\r\\n]*\\}/"]
    for i, fn in enumerate(functions):
        schema = {**arguments_schema(fn.get("parameters")), "x-guidance": {"whitespace_flexible": True}}
        lines += [f'json_head_{i}[lazy]: /(?s:.*)\\{{\\s*"name"\\s*:\\s*"{fn["name"]}"/',
                  f"json_{i}: json_head_{i} ARGUMENTS_KEY json_args_{i} (MEMBER_KEY member_value)* END_OBJECT",
                  f"json_args_{i}: %json {json.dumps(schema)}"]
    return lines


def _tags(open_tag: str, close_tag: str, tags_are_tokens: bool) -> tuple[str, str]:
    for tag in (open_tag, close_tag):
        if not _TAG.fullmatch(tag):
            raise ValueError(f"a tool call tag must be a special token's name like <tool_call>, got {tag!r}")
    return (open_tag, close_tag) if tags_are_tokens else (json.dumps(open_tag), json.dumps(close_tag))


def _tagged_rules(functions: list[dict], tags: tuple[str, str]) -> list[str]:
    """`tagged` (a call to one of `functions` between the tags) and each function's rules."""
    if not functions:
        raise ValueError("no tools to call")
    alternatives = " | ".join(f"fn_{i}" for i in range(len(functions)))
    lines = [f'tagged: {tags[0]} "\\n" ({alternatives}) "\\n" {tags[1]}']
    for i, fn in enumerate(functions):
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise ValueError(f"function name {name!r} is not 1-64 characters of a-z, A-Z, 0-9, _ and -")
        # a literal head and a schema for the arguments alone, so "#/$defs/..." refs in them still resolve
        head = json.dumps(f'{{"name": "{name}", "arguments": ')
        lines += [f'fn_{i}: {head} args_{i} "}}"',
                  f"args_{i}: %json {json.dumps(arguments_schema(fn.get('parameters')))}"]
    return lines


def arguments_schema(params: dict | None) -> dict:
    """A function's `parameters` as the schema its calls' arguments are held to: an object that
    does not say whether it takes other properties takes none (llama.cpp's default too: a small
    model otherwise invents argument after argument)."""
    if params is None or (not params.get("properties") and not params.get("required")
                          and set(params) <= _EMPTY_SCHEMA_KEYS):
        return {**_NO_ARGUMENTS, "x-guidance": JSON_STYLE}  # no parameters declared: none taken
    return {**_closed(params), "x-guidance": JSON_STYLE}


def _closed(schema):
    """`schema` with additionalProperties false on every object that lists properties and leaves
    it unsaid (not under allOf / anyOf / oneOf siblings, where it would forbid their properties)."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in ("const", "enum", "default", "examples") else _closed(v)) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out and "patternProperties" not in out
            and not {"allOf", "anyOf", "oneOf"} & set(out)):
        out["additionalProperties"] = False
    return out


def _call_schema(fn: dict) -> dict:
    """One call as a whole JSON object, for the bare and fenced forms beside a JSON answer; the
    arguments' own "#/$defs/..." refs are moved up with them."""
    args = dict(arguments_schema(fn.get("parameters")))
    args.pop("x-guidance")
    defs = {k: args.pop(k) for k in ("$defs", "definitions") if k in args}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": args},
            "required": ["name", "arguments"], "additionalProperties": False, **defs, "x-guidance": JSON_STYLE}


def _answer_schema(answer: StructuredOutput) -> dict:
    if answer.kind == "json":
        return {"type": "object", "x-guidance": JSON_STYLE}
    if answer.kind != "json_schema":
        raise ValueError("with tools, only response_format (json_object or json_schema) can constrain the answer")
    schema = json.loads(answer.spec) if isinstance(answer.spec, str) else answer.spec
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise ValueError("the answer's JSON schema must be an object or true")
    return {**schema, "x-guidance": JSON_STYLE}
