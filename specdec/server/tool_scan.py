"""Scanning a model's output for tool calls: the JSON pieces ToolCallStream and parse_tool_calls
read (a call block's body, the head `{"name": "...", "arguments": {` of a call as it streams in,
the fences and braces where a call in JSON form may start). Pure functions over strings."""
from __future__ import annotations

import json
from typing import Any

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
FENCE = "```"
JSON_WS = " \t\n\r"
JSON_FORM_KEYS = ("arguments", "parameters")   # what a call in JSON form may name its arguments


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN / Infinity: Python's extension, not JSON


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def parse_call(obj: str, keys: tuple[str, ...] = ("arguments",), names: frozenset[str] | None = None
               ) -> tuple[str, str] | None:
    """(name, raw arguments JSON) when `obj` is exactly one call: the keys "name" (a non-empty string;
    one of `names` when given) and one of `keys` (an object), nothing else; None otherwise. A tagged
    block's body takes "arguments"; a call in JSON form "arguments" or "parameters"."""
    try:
        fields = object_fields(obj)
    except (ValueError, RecursionError):
        return None
    key = next((k for k in keys if fields and k in fields), None)
    if key is None or set(fields) != {"name", key}:
        return None
    name, (arguments, start, end) = fields["name"][0], fields[key]
    if not isinstance(name, str) or not name or (names is not None and name not in names):
        return None
    return (name, obj[start:end]) if isinstance(arguments, dict) else None


def object_fields(s: str) -> dict[str, tuple[Any, int, int]] | None:
    """key -> (value, start, end) of the one JSON object that is all of `s` (whitespace aside);
    None if `s` is not one or repeats a key. Raises ValueError for bad JSON inside."""
    i = skip_ws(s, 0)
    if s[i:i + 1] != "{":
        return None
    fields: dict[str, tuple[Any, int, int]] = {}
    i = skip_ws(s, i + 1)
    if s[i:i + 1] == "}":
        return fields if skip_ws(s, i + 1) == len(s) else None
    while True:
        key, i = _DECODER.raw_decode(s, i)
        i = skip_ws(s, i)
        if not isinstance(key, str) or key in fields or s[i:i + 1] != ":":
            return None
        start = skip_ws(s, i + 1)
        value, end = _DECODER.raw_decode(s, start)
        fields[key] = (value, start, end)
        i = skip_ws(s, end)
        if s[i:i + 1] == "}":
            return fields if skip_ws(s, i + 1) == len(s) else None
        if s[i:i + 1] != ",":
            return None
        i = skip_ws(s, i + 1)


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in JSON_WS:
        i += 1
    return i


def partial_suffix(s: str, tag: str) -> int:
    """Length of the longest end of `s` that is a proper start of `tag` (0 if none)."""
    for k in range(min(len(tag) - 1, len(s)), 0, -1):
        if s.endswith(tag[:k]):
            return k
    return 0


_HEAD = ("{", '"name"', ":", None, ",", "KEY", ":", "{")  # None: the name, a JSON string; KEY: one of `keys`


def match_head(body: str, keys: tuple[str, ...] = ("arguments",)) -> tuple[str, str, int]:
    """Whether a block's body starts `{"name": "<name>", "<key>": {` with a key of `keys`: ("ok",
    name, index of the arguments' `{`), ("more", "", 0) while it still may, ("no", "", 0) once it cannot."""
    i, name = 0, ""
    for part in _HEAD:
        i = skip_ws(body, i)
        if i == len(body):
            return "more", "", 0
        if part == "KEY":
            part = next((f'"{k}"' for k in keys if f'"{k}"'.startswith(body[i:i + len(k) + 2])), "")
            if not part:
                return "no", "", 0
        if part is None:
            if body[i] != '"':
                return "no", "", 0
            end = string_end(body, i)
            if end < 0:
                return "more", "", 0
            try:
                name = json.loads(body[i:end])
            except ValueError:
                return "no", "", 0
            if not name:
                return "no", "", 0
            i = end
            continue
        chunk = body[i:i + len(part)]
        if not part.startswith(chunk):
            return "no", "", 0
        if len(chunk) < len(part):
            return "more", "", 0
        i += len(part)
    return "ok", name, i - 1


def string_end(s: str, i: int) -> int:
    """Index just past the JSON string starting at s[i] == '"', or -1 if it does not end in `s`."""
    j = i + 1
    while j < len(s):
        if s[j] == "\\":
            j += 2
        elif s[j] == '"':
            return j + 1
        else:
            j += 1
    return -1


def closing_prefix(s: str) -> bool:
    """Whether `s` may be the start of what follows a call's arguments: `}`, whitespace, CLOSE."""
    rest = s.lstrip(JSON_WS)
    if rest.startswith("}"):
        rest = rest[1:].lstrip(JSON_WS)
    return CLOSE.startswith(rest)


def object_end(s: str, i: int) -> int:
    """Index just past the JSON object (or array) opening at s[i]; -1 if it does not close in `s`."""
    depth, in_string, escaped = 0, False, False
    for j in range(i, len(s)):
        c = s[j]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return -1


def json_start(s: str, before: int) -> int:
    """The first place in `s` (before index `before`, when that is >= 0) where a call in JSON
    form may start: a fence or an opening brace; -1 if none."""
    end = len(s) if before < 0 else before
    found = [i for i in (s.find(FENCE, 0, end), s.find("{", 0, end)) if i >= 0]
    return min(found) if found else -1


def match_json_head(s: str, names: frozenset[str]) -> tuple[str, str, int, str]:
    """Whether `s` starts a call in JSON form to one of `names`: an optional ```json fence, then
    `{"name": "<name>", "arguments": {` ("parameters" too). ("ok", name, index of the arguments'
    `{`, "fence" | "bare"), ("more", ...) while it still may, ("no", ...) once it cannot."""
    i, form = 0, "bare"
    if s.startswith(FENCE[:len(s)]) and len(s) < len(FENCE):
        return "more", "", 0, form
    if s.startswith(FENCE):
        i, form = len(FENCE), "fence"
        label = s[i:i + 4]
        if not "json".startswith(label) and label[:1] not in JSON_WS + "{":
            return "no", "", 0, form
        if s[i:i + 4] == "json":
            i += 4
        elif len(s) - i < 4 and "json".startswith(s[i:]):
            return "more", "", 0, form
        i = skip_ws(s, i)
        if i == len(s):
            return "more", "", 0, form
    verdict, name, brace = match_head(s[i:], keys=JSON_FORM_KEYS)
    if verdict == "ok" and name not in names:
        return "no", "", 0, form
    return verdict, name, i + brace, form
