"""OpenAI tool calls read back out of the model's output (hermes-style `<tool_call>` blocks).

`<tool_call>` and `</tool_call>` are single tokens in Qwen2.5's vocabulary, decoded to those literal
strings (not special tokens to the decoder, so they survive `skip_special_tokens`).

- parse_tool_calls(text): (content, calls) for a finished output. A call is a complete block whose
  body is a JSON object with exactly the keys "name" (a non-empty string) and "arguments" (an
  object); its OpenAI `arguments` string is the arguments JSON exactly as the model wrote it.
  Anything else (a malformed block, an unterminated last block) stays in the content, so no text is
  lost; except when the output was cut off (`truncated`: finish_reason "length"), where an
  unterminated last block is an incomplete call and is dropped, markup and all. Content is None
  when only whitespace remains; stripped when there are calls.
- ToolCallStream: the same, incrementally, as OpenAI chat-chunk `delta` dicts. The concatenated
  content deltas equal the full text when there are no calls and strip to parse_tool_calls' content
  when there are; each call's argument fragments concatenate to its `arguments` string. The one
  exception: a block is committed as a call (and streamed) once `{"name": "...", "arguments": {` has
  been read, and cannot be taken back; if it then goes wrong (cut off by max_tokens, invalid JSON
  inside the arguments, or something other than `}` and the close tag after them) the call keeps
  the arguments as far as they went, the text after them becomes content, and parse_tool_calls
  would instead keep the whole block as content. finish(truncated=True) (a cut-off output) drops
  what it holds of an unfinished block or tag instead of flushing it as content, so no markup
  leaks; a call already committed stays, with finish_reason "length" telling it is incomplete.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_JSON_WS = " \t\n\r"


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_tool_calls(text: str, truncated: bool = False) -> tuple[str | None, list[dict]]:
    """(content, calls) of a finished output (`truncated`: cut off by max_tokens); see the module
    docstring."""
    content: list[str] = []
    calls: list[dict] = []
    pos = 0
    while (start := text.find(OPEN, pos)) >= 0:
        end = text.find(CLOSE, start + len(OPEN))
        if end < 0:
            if truncated:  # an incomplete call: neither a call nor content
                text = text[:start]
            break  # unterminated: stays text
        parsed = _parse_body(text[start + len(OPEN):end])
        if parsed is None:
            content.append(text[pos:end + len(CLOSE)])
        else:
            content.append(text[pos:start])
            calls.append(_call(new_call_id(), *parsed))
        pos = end + len(CLOSE)
    if truncated:  # the start of a tag the cut-off left unfinished
        text = text[:len(text) - _partial_suffix(text[pos:], OPEN)]
    content.append(text[pos:])
    joined = "".join(content)
    if not joined.strip():
        return None, calls
    return (joined.strip() if calls else joined), calls


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN / Infinity: Python's extension, not JSON


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _parse_body(body: str) -> tuple[str, str] | None:
    """(name, raw arguments JSON) of a block's body, or None when it is not a call."""
    try:
        fields = _object_fields(body)
    except (ValueError, RecursionError):
        return None
    if fields is None or set(fields) != {"name", "arguments"}:
        return None
    name, _, _ = fields["name"]
    arguments, start, end = fields["arguments"]
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return name, body[start:end]


def _object_fields(s: str) -> dict[str, tuple[Any, int, int]] | None:
    """key -> (value, start, end) of the one JSON object that is all of `s` (whitespace aside);
    None if `s` is not one or repeats a key. Raises ValueError for bad JSON inside."""
    i = _skip_ws(s, 0)
    if s[i:i + 1] != "{":
        return None
    fields: dict[str, tuple[Any, int, int]] = {}
    i = _skip_ws(s, i + 1)
    if s[i:i + 1] == "}":
        return fields if _skip_ws(s, i + 1) == len(s) else None
    while True:
        key, i = _DECODER.raw_decode(s, i)
        i = _skip_ws(s, i)
        if not isinstance(key, str) or key in fields or s[i:i + 1] != ":":
            return None
        start = _skip_ws(s, i + 1)
        value, end = _DECODER.raw_decode(s, start)
        fields[key] = (value, start, end)
        i = _skip_ws(s, end)
        if s[i:i + 1] == "}":
            return fields if _skip_ws(s, i + 1) == len(s) else None
        if s[i:i + 1] != ",":
            return None
        i = _skip_ws(s, i + 1)


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _JSON_WS:
        i += 1
    return i


def _partial_suffix(s: str, tag: str) -> int:
    """Length of the longest end of `s` that is a proper start of `tag` (0 if none)."""
    for k in range(min(len(tag) - 1, len(s)), 0, -1):
        if s.endswith(tag[:k]):
            return k
    return 0


_HEAD = ("{", '"name"', ":", None, ",", '"arguments"', ":", "{")  # None: the name, a JSON string


def _match_head(body: str) -> tuple[str, str, int]:
    """Whether a block's body starts `{"name": "<name>", "arguments": {`: ("ok", name, index of the
    arguments' `{`), ("more", "", 0) while it still may, ("no", "", 0) once it cannot."""
    i, name = 0, ""
    for part in _HEAD:
        i = _skip_ws(body, i)
        if i == len(body):
            return "more", "", 0
        if part is None:
            if body[i] != '"':
                return "no", "", 0
            end = _string_end(body, i)
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


def _string_end(s: str, i: int) -> int:
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


@dataclass
class _StreamedCall:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)


class ToolCallStream:
    """parse_tool_calls, incrementally: feed() each decoded text delta, then finish(); both return
    OpenAI chat-chunk `delta` dicts in order. See the module docstring for what is guaranteed."""

    def __init__(self) -> None:
        self._buf = ""          # text read but not yet turned into deltas
        self._state = "text"    # text | head | held | args | tail
        self._pending_ws = ""   # trailing whitespace of the content so far: dropped if calls follow
        self._calls: list[_StreamedCall] = []
        self._out: list[dict] = []
        self._depth = 0         # the arguments' JSON nesting, and whether inside a string / escape
        self._in_string = False
        self._escaped = False

    @property
    def calls(self) -> list[dict]:
        """The calls so far, as parse_tool_calls gives them (arguments as far as they have come)."""
        return [_call(c.id, c.name, "".join(c.arguments)) for c in self._calls]

    def feed(self, delta: str) -> list[dict]:
        self._buf += delta
        while self._step():
            pass
        return self._take()

    def finish(self, truncated: bool = False) -> list[dict]:
        """Flush: held text that is no call becomes content, an unterminated block too unless it
        was already committed as a call (which then keeps what it has). `truncated` (cut off by
        max_tokens): a held partial tag and an uncommitted block are dropped instead."""
        if self._state == "text":
            self._content("" if truncated and OPEN.startswith(self._buf) else self._buf)
        elif self._state in ("head", "held"):
            self._content("" if truncated else OPEN + self._buf)
        elif self._state == "args":  # cut off inside the arguments: they are what the model wrote
            self._arguments("" if truncated and CLOSE.startswith(self._buf) else self._buf)
        elif self._state == "tail" and not truncated and not _closing_prefix(self._buf):
            self._content(self._buf)
        self._buf, self._state = "", "text"
        if not self._calls and self._pending_ws:
            self._emit_content(self._pending_ws)  # a plain answer comes back byte for byte
        self._pending_ws = ""
        return self._take()

    def _take(self) -> list[dict]:
        out, self._out = self._out, []
        return out

    def _step(self) -> bool:
        """Consume what the buffer allows in the current state; False when it must wait."""
        if self._state == "text":
            return self._step_text()
        if self._state == "head":
            return self._step_head()
        if self._state == "held":
            return self._step_held()
        if self._state == "args":
            return self._step_args()
        return self._step_tail()

    def _step_text(self) -> bool:
        start = self._buf.find(OPEN)
        if start < 0:
            keep = _partial_suffix(self._buf, OPEN)  # maybe the start of a tag: wait for more
            self._content(self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        self._content(self._buf[:start])
        self._buf, self._state = self._buf[start + len(OPEN):], "head"
        return True

    def _step_head(self) -> bool:
        close = self._buf.find(CLOSE)
        verdict, name, brace = _match_head(self._buf if close < 0 else self._buf[:close])
        if verdict == "ok":
            self._start_call(name)
            self._buf, self._state = self._buf[brace:], "args"
            self._depth, self._in_string, self._escaped = 0, False, False
            return True
        if verdict == "no" or close >= 0:
            self._state = "held"  # not the usual shape: decide on the whole block once it closes
            return True
        return False

    def _step_held(self) -> bool:
        close = self._buf.find(CLOSE)
        if close < 0:
            return False
        parsed = _parse_body(self._buf[:close])
        if parsed is None:
            self._content(OPEN + self._buf[:close + len(CLOSE)])
        else:
            self._start_call(parsed[0])
            self._arguments(parsed[1])
        self._buf, self._state = self._buf[close + len(CLOSE):], "text"
        return True

    def _step_args(self) -> bool:
        close = self._buf.find(CLOSE)
        limit = close if close >= 0 else len(self._buf) - _partial_suffix(self._buf, CLOSE)
        end = self._scan_arguments(self._buf[:limit])
        if end >= 0:
            self._arguments(self._buf[:end])
            self._buf, self._state = self._buf[end:], "tail"
            return True
        self._arguments(self._buf[:limit])
        if close >= 0:
            # the block closed inside the arguments: the call keeps them as they are
            self._buf, self._state = self._buf[close + len(CLOSE):], "text"
            return True
        self._buf = self._buf[limit:]
        return False

    def _scan_arguments(self, s: str) -> int:
        """Advance the JSON scanner over `s`; the index just past the arguments' closing brace, or
        -1 if they have not closed within `s`."""
        for i, c in enumerate(s):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return -1

    def _step_tail(self) -> bool:
        close = self._buf.find(CLOSE)
        if close < 0:
            return False
        tail = self._buf[:close]
        if tail.strip(_JSON_WS) != "}":
            self._content(tail + CLOSE)  # not the expected `}`: keep the text
        self._buf, self._state = self._buf[close + len(CLOSE):], "text"
        return True

    def _start_call(self, name: str) -> None:
        call = _StreamedCall(new_call_id(), name)
        self._calls.append(call)
        self._out.append({"tool_calls": [{"index": len(self._calls) - 1, **_call(call.id, name, "")}]})

    def _arguments(self, text: str) -> None:
        if not text:
            return
        index = len(self._calls) - 1
        self._calls[index].arguments.append(text)
        last = self._out[-1]["tool_calls"][0] if self._out and "tool_calls" in self._out[-1] else None
        if last is not None and last["index"] == index and "id" not in last:
            last["function"]["arguments"] += text  # one fragment per feed; the header keeps "" as OpenAI's does
        else:
            self._out.append({"tool_calls": [{"index": index, "function": {"arguments": text}}]})

    def _content(self, text: str) -> None:
        """Content, less its trailing whitespace, which waits to see whether text or calls follow."""
        text = self._pending_ws + text
        body = text.rstrip()
        self._pending_ws = text[len(body):]
        self._emit_content(body)

    def _emit_content(self, text: str) -> None:
        if not text:
            return
        if self._out and "content" in self._out[-1]:
            self._out[-1]["content"] += text
        else:
            self._out.append({"content": text})


def _closing_prefix(s: str) -> bool:
    """Whether `s` may be the start of what follows a call's arguments: `}`, whitespace, CLOSE."""
    rest = s.lstrip(_JSON_WS)
    if rest.startswith("}"):
        rest = rest[1:].lstrip(_JSON_WS)
    return CLOSE.startswith(rest)
