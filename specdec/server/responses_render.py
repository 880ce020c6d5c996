"""The Responses API's response object, from a chat turn: the shell that echoes the request, output
items (an assistant message with one output_text part, then one function_call item per tool call),
status and usage. Shapes are OpenAI's, so the openai client parses them (`response.output_text`).

A response truncated by max_output_tokens (finish_reason "length") is `status: "incomplete"` with
`incomplete_details.reason: "max_output_tokens"`, and its last item is `status: "incomplete"`.
"""
from __future__ import annotations

import secrets
import time

from specdec.request import RequestOutput
from specdec.server.render import Sub, spec_summary, usage_of
from specdec.server.responses_protocol import ResponsesRequest


def item_id(prefix: str) -> str:
    """A fresh output item id: msg_... for messages, fc_... for function calls (OpenAI's prefixes)."""
    return f"{prefix}_{secrets.token_hex(12)}"


def response_shell(body: ResponsesRequest, response_id: str, model: str) -> dict:
    """The response before any output (`status: "in_progress"`), echoing the request's settings
    with OpenAI's defaults filled in."""
    fmt = body.text.format if body.text is not None and body.text.format is not None else None
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "background": False, "error": None, "incomplete_details": None, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens, "model": model, "output": [],
        "parallel_tool_calls": body.parallel_tool_calls is not False, "previous_response_id": None,
        "reasoning": None, "store": False,   # nothing is kept: there is nothing to retrieve later
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True, exclude_none=True)},
        "tool_choice": _tool_choice(body),
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
        "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled",
        "usage": None, "user": body.user, "metadata": body.metadata or {},
    }


def _tool_choice(body: ResponsesRequest) -> str | dict:
    choice = body.tool_choice
    if choice is None:
        return "auto"   # OpenAI's default, with or without tools
    return choice if isinstance(choice, str) else choice.model_dump()


def message_item(text: str, status: str, msg_id: str | None = None) -> dict:
    return {"type": "message", "id": msg_id or item_id("msg"), "status": status, "role": "assistant",
            "content": [text_part(text)]}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


def call_item(call_id: str, name: str, arguments: str, status: str, fc_id: str | None = None) -> dict:
    return {"type": "function_call", "id": fc_id or item_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(message: dict, finish_reason: str | None) -> list[dict]:
    """The output items of a chat turn's final message ({"role", "content", "tool_calls"?}): its
    text (even empty, when there are no calls: a response always says something), then its calls."""
    calls = message.get("tool_calls") or []
    items = []
    if message.get("content") or not calls:
        items.append(message_item(message.get("content") or "", "completed"))
    for call in calls:
        fn = call["function"]
        items.append(call_item(call["id"], fn["name"], fn["arguments"], "completed"))
    if finish_reason == "length":
        items[-1]["status"] = "incomplete"
    return items


def completed(shell: dict, output: list[dict], subs: list[Sub], finals: list[RequestOutput]) -> dict:
    """The finished response: `shell` with its output, status and usage (and, as the chat route
    adds it, the speculative summary)."""
    truncated = any(o.finish_reason == "length" for o in finals)
    return {**shell, "status": "incomplete" if truncated else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if truncated else None,
            "output": output, "usage": responses_usage(subs, finals), "speculative": spec_summary(finals)}


def responses_usage(subs: list[Sub], finals: list[RequestOutput]) -> dict:
    """Chat usage in the Responses API's names."""
    usage = usage_of(subs, finals)
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens_details": {"reasoning_tokens": 0}}
