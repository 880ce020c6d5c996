"""POST /v1/chat/completions: the model's chat template over the messages (and tools), n choices,
streamed (server-sent events) or not; output constrained by response_format / guided_* and by the
tools' grammar (tool_grammar.py: lazy under "auto", calls only under "required" or a named
function); tool calls parsed into `tool_calls`, whole or as stream deltas.

start_chat / finish_chat / final_message / stream_renderer are the route's steps, which the
Responses API (responses.py) runs too."""
from __future__ import annotations

import time
from dataclasses import dataclass

from fastapi import APIRouter, Depends, Request

from specdec.request import RequestOutput
from specdec.sampling_params import StructuredOutput
from specdec.server.context import ServerContext, context
from specdec.server.errors import APIError
from specdec.server.async_engine import RequestStream
from specdec.server.middleware import AccessRecord, access_record, check_auth
from specdec.server.openapi import ChatCompletion, errors, ok
from specdec.server.protocol import ChatCompletionRequest, ChatMessage
from specdec.server.render import Sub, chat_logprobs, spec_summary, usage_of
from specdec.server.streaming import collect, event_stream, record_usage
from specdec.server.submit import (
    check_request,
    compile_structured,
    prepare,
    request_seed,
    requested_structure,
    sampling,
    spec_options,
    start,
)
from specdec.server.tool_calls import ToolCallStream, parse_tool_calls
from specdec.server.tool_grammar import auto_grammar, call_grammar
from specdec.server.tools import check_tools, tool_messages, vocab_has_call_tags, with_answer_format

router = APIRouter()


def _messages(messages: list[ChatMessage]) -> list[dict]:
    """The conversation as the template reads it: text content, tool calls with parsed arguments."""
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True, exclude={"content", "refusal"})
        d["content"] = m.text()
        if d["role"] == "developer":  # OpenAI's newer name for system: templates know only "system"
            d["role"] = "system"
        out.append(d)
    return tool_messages(out)


def chat_prompt_ids(ctx: ServerContext, messages: list[ChatMessage], tools: list[dict] | None,
                    add_generation_prompt: bool = True, add_special_tokens: bool = False,
                    answer: StructuredOutput | None = None) -> list[int]:
    """The templated conversation as token ids (what /v1/chat/completions generates from and
    /tokenize counts); `answer`: the response_format that goes with `tools`, told to the model. A
    template that rejects the conversation is a 400."""
    tok = ctx.ready_engine().tokenizer
    try:
        conversation = _messages(messages)
        if answer is not None:
            conversation = with_answer_format(conversation, answer)
        prompt = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tools=tools)
    except ValueError as e:
        raise APIError(400, str(e), "messages") from None
    except Exception:  # a template that rejects this conversation (e.g. its role order)
        raise APIError(400, "the model's chat template rejected these messages", "messages") from None
    return tok.encode(prompt, add_special_tokens=add_special_tokens) or []


@dataclass
class ToolPlan:
    """The tools a request puts in play: rendered by the template, constrained by `grammar`."""
    tools: list[dict]             # OpenAI tool definitions, for the chat template
    names: tuple[str, ...]        # the functions a call may name
    grammar: StructuredOutput     # the tool_choice's grammar, the answer's constraint folded in
    answer: StructuredOutput | None = None   # response_format's JSON beside the tools (told to the model)


@dataclass
class ChatRun:
    """A chat request on its way: its choices, their engine streams, its access-log record."""
    subs: list[Sub]
    streams: list[RequestStream]
    record: AccessRecord
    tools: ToolPlan | None        # None: no tools in play, the output is all content


async def _tool_plan(ctx: ServerContext, body: ChatCompletionRequest) -> tuple[ToolPlan | None, StructuredOutput | None]:
    """(the tools in play, the constraint the output is held to: the tools' grammar, or without
    tools the request's own)."""
    asked = await requested_structure(ctx, body)
    choice = body.tool_choice or ("auto" if body.tools else "none")
    if not body.tools:
        if choice != "none":
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return None, asked
    if choice == "none":
        return None, asked
    tags = vocab_has_call_tags(ctx.ready_engine().tokenizer)
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    try:
        functions = check_tools(tools)
    except ValueError as e:
        raise APIError(400, str(e), "tools") from None
    if asked is not None and asked.kind not in ("json", "json_schema"):
        raise APIError(400, "with tools, the answer can be constrained by response_format only "
                            "(json_object or json_schema); guided_* needs tool_choice none", "tool_choice")
    try:
        if choice == "auto":  # calls in the model's own forms, or the (constrained) answer
            grammar = auto_grammar(functions, asked, tags_are_tokens=tags)
        else:  # calls only: response_format constrains the answer of a later turn
            name = None if isinstance(choice, str) else choice.function.name
            grammar = call_grammar(functions, name, body.parallel_tool_calls, tags_are_tokens=tags)
    except ValueError as e:
        raise APIError(400, str(e), "tools" if isinstance(choice, str) else "tool_choice") from None
    grammar = await compile_structured(ctx, grammar, "tools")
    return ToolPlan(tools, tuple(f["name"] for f in functions), grammar, asked), grammar


def finish_reason(out: RequestOutput, calls: list | None) -> str | None:
    return "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason


def final_message(run: ChatRun, out: RequestOutput) -> dict:
    """One choice's assistant message: content, and the tool calls read out of the output."""
    if run.tools is None:
        return {"role": "assistant", "content": out.text}
    content, calls = parse_tool_calls(out.text, out.finish_reason == "length", run.tools.names)
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message


def stream_renderer(run: ChatRun):
    """Chunks of one choice's stream: content deltas, or tool-call deltas as OpenAI streams them."""
    parsers: dict[int, ToolCallStream] = {}

    def render(sub: Sub, out: RequestOutput) -> list[dict]:
        if run.tools is None:
            deltas = [{"content": out.delta_text}] if out.delta_text else []
            calls: list = []
        else:
            parser = parsers.setdefault(sub.index, ToolCallStream(run.tools.names))
            deltas = parser.feed(out.delta_text) if out.delta_text else []
            if out.finished:
                deltas += parser.finish(truncated=out.finish_reason == "length")
            calls = parser.calls
        chunks = [{"index": sub.index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
        if out.finished:
            chunks.append({"index": sub.index, "delta": {}, "logprobs": None,
                           "finish_reason": finish_reason(out, calls)})
        return chunks
    return render


async def start_chat(ctx: ServerContext, body: ChatCompletionRequest, request: Request) -> ChatRun:
    """Check, template and submit a chat request's n choices. Raises APIError (nothing queued)."""
    ctx.admit(body.model)
    check_request(ctx, body)
    plan, structured = await _tool_plan(ctx, body)
    ids, max_tokens = prepare(ctx, chat_prompt_ids(ctx, body.messages, plan and plan.tools,
                                                   answer=plan and plan.answer), body.requested_max_tokens(), "messages")
    subs = [Sub(j, 0, len(ids), "") for j in range(body.n)]
    record = access_record(request)
    salt = ctx.cache_salt(record.api_key_id, body.cache_salt)
    seed = request_seed(ctx, body)
    jobs = [(ids, sampling(body, max_tokens, body.num_logprobs(), j, seed, structured, salt)) for j in range(body.n)]
    return ChatRun(subs, await start(ctx, jobs, spec_options(body)), record, plan)


async def finish_chat(run: ChatRun, request: Request) -> list[RequestOutput]:
    """Every choice's final output (the access log gets the token counts)."""
    finals = await collect(run.streams, request)
    record_usage(run.record, run.subs, finals)
    return finals


@router.post("/v1/chat/completions", dependencies=[Depends(check_auth)],
             responses={**ok(ChatCompletion, stream=True), **errors(400, 401, 404, 413, 429, 503)})
async def chat_completions(body: ChatCompletionRequest, request: Request, ctx: ServerContext = Depends(context)):
    run = await start_chat(ctx, body, request)
    rid, created = f"chatcmpl-{run.record.request_id}", int(time.time())  # vLLM's: the x-request-id in the id
    if body.stream:
        opening = [{"index": sub.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None} for sub in run.subs]
        envelope = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": ctx.served_model}
        return event_stream(run.streams, run.subs, envelope, stream_renderer(run), body.stream_options,
                            opening, run.record)
    finals = await finish_chat(run, request)
    tokenizer = ctx.ready_engine().tokenizer
    choices = []
    for sub, out in zip(run.subs, finals):
        message = final_message(run, out)
        choices.append({"index": sub.index, "message": message,
                        "logprobs": chat_logprobs(tokenizer, out) if body.logprobs else None,
                        "finish_reason": finish_reason(out, message.get("tool_calls"))})
    return {"id": rid, "object": "chat.completion", "created": created, "model": ctx.served_model,
            "choices": choices, "usage": usage_of(run.subs, finals), "speculative": spec_summary(finals)}
