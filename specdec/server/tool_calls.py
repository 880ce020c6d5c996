"""OpenAI tool calls read back out of the model's output: hermes-style `<tool_call>` blocks and,
given the offered tools' names, calls in JSON form (a ```json fence or a bare object whose "name"
is an offered tool and whose "arguments" or "parameters" is an object), as small models write them.

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

import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field

from specdec.server.tool_scan import (
    CLOSE,
    FENCE,
    JSON_WS,
    OPEN,
    closing_prefix,
    json_start,
    match_head,
    JSON_FORM_KEYS,
    match_json_head,
    object_end,
    parse_call,
    partial_suffix,
)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_tool_calls(text: str, truncated: bool = False, names: Iterable[str] = ()) -> tuple[str | None, list[dict]]:
    """(content, calls) of a finished output (`truncated`: cut off by max_tokens); see the module
    docstring. With `names` (the offered tools), calls in JSON form are read too, and the output
    is read exactly as ToolCallStream reads it, so a whole response and its stream agree."""
    if names:
        return _parse_as_streamed(text, truncated, names)
    content: list[str] = []
    calls: list[dict] = []
    pos = 0
    while (start := text.find(OPEN, pos)) >= 0:
        end = text.find(CLOSE, start + len(OPEN))
        if end < 0:
            if truncated:  # an incomplete call: neither a call nor content
                text = text[:start]
            break  # unterminated: stays text
        parsed = parse_call(text[start + len(OPEN):end])
        if parsed is None:
            content.append(text[pos:end + len(CLOSE)])
        else:
            content.append(text[pos:start])
            calls.append(_call(new_call_id(), *parsed))
        pos = end + len(CLOSE)
    if truncated:  # the start of a tag the cut-off left unfinished
        text = text[:len(text) - partial_suffix(text[pos:], OPEN)]
    content.append(text[pos:])
    return _result("".join(content), calls)


def _result(content: str, calls: list[dict]) -> tuple[str | None, list[dict]]:
    """Content None when only whitespace remains, stripped when there are calls."""
    if not content.strip():
        return None, calls
    return (content.strip() if calls else content), calls


def _parse_as_streamed(text: str, truncated: bool, names: Iterable[str]) -> tuple[str | None, list[dict]]:
    stream = ToolCallStream(names)
    deltas = stream.feed(text) + stream.finish(truncated)
    return _result("".join(d.get("content", "") for d in deltas), stream.calls)


@dataclass
class _StreamedCall:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)


class ToolCallStream:
    """parse_tool_calls, incrementally: feed() each decoded text delta, then finish(); both return
    OpenAI chat-chunk `delta` dicts in order. See the module docstring for what is guaranteed."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        self._names = frozenset(names)   # offered tools: a JSON object calling one of them is a call too
        self._buf = ""          # text read but not yet turned into deltas
        self._state = "text"    # text | head | held | json | args | tail
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
        elif self._state == "json":
            self._content("" if truncated else self._buf)
        elif self._state == "args":  # cut off inside the arguments: they are what the model wrote
            self._arguments("" if truncated and CLOSE.startswith(self._buf) else self._buf)
        elif self._state == "tail" and not truncated and not closing_prefix(self._buf):
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
        if self._state == "json":
            return self._step_json()
        if self._state == "args":
            return self._step_args()
        return self._step_tail()

    def _step_text(self) -> bool:
        start = self._buf.find(OPEN)
        json_at = json_start(self._buf, start) if self._names else -1
        if json_at >= 0:  # a fence or an object, before any tag: maybe a call in JSON form
            self._content(self._buf[:json_at])
            self._buf, self._state = self._buf[json_at:], "json"
            return True
        if start < 0:
            keep = partial_suffix(self._buf, OPEN)  # maybe the start of a tag: wait for more
            if self._names:
                keep = max(keep, partial_suffix(self._buf, FENCE))
            self._content(self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        self._content(self._buf[:start])
        self._buf, self._state = self._buf[start + len(OPEN):], "head"
        return True

    def _step_json(self) -> bool:
        """A fence or brace that may open a call in JSON form: text as soon as it cannot; else held
        until its object closes, then a call only if the whole object is one (so a model that adds
        keys beside the arguments, say its own made-up "response", keeps that text)."""
        verdict, _, _, form = match_json_head(self._buf, self._names)
        if verdict == "no":  # its first character is text; look for a call again after it
            self._content(self._buf[0])
            self._buf, self._state = self._buf[1:], "text"
            return True
        start = self._buf.find("{")
        end = object_end(self._buf, start) if verdict == "ok" else -1
        if end < 0:
            return False
        rest = self._buf[end:]
        if form == "fence":  # its closing fence, once it is clear whether one follows
            after = rest.lstrip(JSON_WS)
            if FENCE.startswith(after) and len(after) < len(FENCE):
                return False
            if after.startswith(FENCE):
                rest = after[len(FENCE):]
        call = parse_call(self._buf[start:end], JSON_FORM_KEYS, self._names)
        if call is None:
            self._content(self._buf[:end])
            rest = self._buf[end:]
        else:
            self._start_call(call[0])
            self._arguments(call[1])
        self._buf, self._state = rest, "text"
        return True

    def _step_head(self) -> bool:
        close = self._buf.find(CLOSE)
        verdict, name, brace = match_head(self._buf if close < 0 else self._buf[:close])
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
        parsed = parse_call(self._buf[:close])
        if parsed is None:
            self._content(OPEN + self._buf[:close + len(CLOSE)])
        else:
            self._start_call(parsed[0])
            self._arguments(parsed[1])
        self._buf, self._state = self._buf[close + len(CLOSE):], "text"
        return True

    def _step_args(self) -> bool:
        close = self._buf.find(CLOSE)
        limit = close if close >= 0 else len(self._buf) - partial_suffix(self._buf, CLOSE)
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
        if tail.strip(JSON_WS) != "}":
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
