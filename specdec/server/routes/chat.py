"""POST /v1/chat/completions: the model's chat template over the messages (and tools), n choices,
streamed (server-sent events) or not; output constrained by response_format / guided_* or, when a
tool call is required, by the tools' grammar; tool calls parsed into `tool_calls`."""
from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request

from specdec.request import RequestOutput
from specdec.sampling_params import StructuredOutput
from specdec.server.context import ServerContext, context
from specdec.server.errors import APIError
from specdec.server.middleware import access_record, check_auth
from specdec.server.openapi import ChatCompletion, errors, ok
from specdec.server.protocol import ChatCompletionRequest, ChatMessage
from specdec.server.render import Sub, chat_logprobs, spec_summary, usage_of
from specdec.server.streaming import collect, event_stream, record_usage
from specdec.server.submit import (
    check_request,
    compile_structured,
    prepare,
    requested_structure,
    sampling,
    spec_options,
    start,
)
from specdec.server.tool_calls import ToolCallStream, parse_tool_calls
from specdec.server.tools import check_tools, tool_grammar, tool_messages, vocab_has_call_tags

router = APIRouter()


def _messages(messages: list[ChatMessage]) -> list[dict]:
    """The conversation as the template reads it: text content, tool calls with parsed arguments."""
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True, exclude={"content", "refusal"})
        d["content"] = m.text()
        out.append(d)
    return tool_messages(out)


def chat_prompt_ids(ctx: ServerContext, messages: list[ChatMessage], tools: list[dict] | None,
                    add_generation_prompt: bool = True, add_special_tokens: bool = False) -> list[int]:
    """The templated conversation as token ids (what /v1/chat/completions generates from and
    /tokenize counts); a template that rejects it is a 400."""
    tok = ctx.ready_engine().tokenizer
    try:
        prompt = tok.apply_chat_template(_messages(messages), add_generation_prompt=add_generation_prompt,
                                         tools=tools)
    except ValueError as e:
        raise APIError(400, str(e), "messages") from None
    except Exception:  # a template that rejects this conversation (e.g. its role order)
        raise APIError(400, "the model's chat template rejected these messages", "messages") from None
    return tok.encode(prompt, add_special_tokens=add_special_tokens) or []


def _tool_plan(ctx: ServerContext, body: ChatCompletionRequest) -> tuple[list[dict] | None, StructuredOutput | None]:
    """(tools for the template, the grammar a required call imposes); (None, None): no tools in play."""
    choice = body.tool_choice or ("auto" if body.tools else "none")
    if not body.tools:
        if choice != "none":
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return None, None
    try:
        tools = [t.model_dump(exclude_none=True) for t in body.tools]
        functions = check_tools(tools)
        if choice == "none":
            return None, None
        if choice == "auto":
            return tools, None
        name = None if isinstance(choice, str) else choice.function.name
        return tools, tool_grammar(functions, name, body.parallel_tool_calls,
                                   tags_are_tokens=vocab_has_call_tags(ctx.ready_engine().tokenizer))
    except ValueError as e:
        raise APIError(400, str(e), "tools" if choice in ("auto", "required") else "tool_choice") from None


def _finish_reason(out: RequestOutput, calls: list) -> str | None:
    return "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason


def _message(out: RequestOutput, tools: bool) -> dict:
    if tools:
        truncated = out.finish_reason == "length"
        content, calls = parse_tool_calls(out.text, truncated)
        if calls:
            return {"role": "assistant", "content": content, "tool_calls": calls}
        if truncated:  # a call cut off by max_tokens is dropped, markup and all
            return {"role": "assistant", "content": content}
    return {"role": "assistant", "content": out.text}


def _stream_renderer(tools: bool):
    """Chunks of one choice's stream: content deltas, or tool-call deltas as OpenAI streams them."""
    parsers: dict[int, ToolCallStream] = {}

    def render(sub: Sub, out: RequestOutput) -> list[dict]:
        if not tools:
            deltas = [{"content": out.delta_text}] if out.delta_text else []
            calls: list = []
        else:
            parser = parsers.setdefault(sub.index, ToolCallStream())
            deltas = parser.feed(out.delta_text) if out.delta_text else []
            if out.finished:
                deltas += parser.finish(truncated=out.finish_reason == "length")
            calls = parser.calls
        chunks = [{"index": sub.index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
        if out.finished:
            chunks.append({"index": sub.index, "delta": {}, "logprobs": None,
                           "finish_reason": _finish_reason(out, calls)})
        return chunks
    return render


async def _constraint(ctx: ServerContext, body: ChatCompletionRequest, forced: StructuredOutput | None
                      ) -> StructuredOutput | None:
    asked = await requested_structure(ctx, body)
    if forced is None:
        return asked
    if asked is not None:
        raise APIError(400, "a required tool call cannot be combined with response_format or guided_*",
                       "tool_choice")
    return await compile_structured(ctx, forced, "tools")


@router.post("/v1/chat/completions", dependencies=[Depends(check_auth)],
             responses={**ok(ChatCompletion, stream=True), **errors(400, 401, 404, 413, 429, 503)})
async def chat_completions(body: ChatCompletionRequest, request: Request, ctx: ServerContext = Depends(context)):
    eng = ctx.admit(body.model)
    check_request(ctx, body)
    tools, forced = _tool_plan(ctx, body)
    structured = await _constraint(ctx, body, forced)
    ids, max_tokens = prepare(ctx, chat_prompt_ids(ctx, body.messages, tools), body.requested_max_tokens(),
                              "messages")
    subs = [Sub(j, 0, len(ids), "") for j in range(body.n)]
    record = access_record(request)
    salt = ctx.cache_salt(record.api_key_id, body.cache_salt)
    jobs = [(ids, sampling(body, max_tokens, body.num_logprobs(), j, structured, salt)) for j in range(body.n)]
    streams = await start(ctx, jobs, spec_options(body))
    rid, created = f"chatcmpl-{record.request_id}", int(time.time())  # vLLM's: the x-request-id in the id

    if body.stream:
        opening = [{"index": sub.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None} for sub in subs]
        envelope = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": ctx.served_model}
        return event_stream(streams, subs, envelope, _stream_renderer(tools is not None), body.stream_options,
                            opening, record)

    finals = await collect(streams, request)
    record_usage(record, subs, finals)
    choices = []
    for sub, out in zip(subs, finals):
        message = _message(out, tools is not None)
        choices.append({"index": sub.index, "message": message,
                        "logprobs": chat_logprobs(eng.tokenizer, out) if body.logprobs else None,
                        "finish_reason": _finish_reason(out, message.get("tool_calls"))})
    return {"id": rid, "object": "chat.completion", "created": created, "model": ctx.served_model,
            "choices": choices, "usage": usage_of(subs, finals), "speculative": spec_summary(finals)}
