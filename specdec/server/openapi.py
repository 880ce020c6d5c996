"""The published API schema (/openapi.json, /docs): what each route answers, errors included.

The models here document responses only (the routes build plain dicts; nothing is validated on the
way out), so they allow extra fields. FastAPI's default 422 is replaced by the 400 every validation
error gets here.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict


class _Doc(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Doc):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Doc):
    error: ErrorDetail


class Usage(_Doc):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    proposer: str | None = None
    proposers_used: list[str] = []


class CompletionChoice(_Doc):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class Completion(_Doc):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    speculative: dict[str, Any]


class FunctionCallOut(_Doc):
    name: str
    arguments: str


class ToolCallOut(_Doc):
    id: str
    type: str
    function: FunctionCallOut


class ChatMessageOut(_Doc):
    role: str
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_Doc):
    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class ChatCompletion(_Doc):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    speculative: dict[str, Any]


class ModelCard(_Doc):
    id: str
    object: str
    created: int
    owned_by: str
    max_model_len: int
    precision: str
    speculative: dict[str, Any]


class ModelList(_Doc):
    object: str
    data: list[ModelCard]


class ResponseOutputItem(_Doc):
    """A message ({"role", "content": [output_text parts]}) or a function_call ({"call_id", "name",
    "arguments"})."""
    type: str
    id: str
    status: str
    role: str | None = None
    content: list[dict[str, Any]] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None


class ResponseUsage(_Doc):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens_details: dict[str, int]


class ResponseObject(_Doc):
    id: str
    object: str
    created_at: int
    status: str
    incomplete_details: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    model: str
    output: list[ResponseOutputItem]
    usage: ResponseUsage
    speculative: dict[str, Any]


class Health(_Doc):
    status: str


class Tokenized(_Doc):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class Detokenized(_Doc):
    prompt: str


class Version(_Doc):
    version: str


_WHY = {400: "Invalid request (the message names the field)", 401: "Missing or wrong API key",
        403: "Admin endpoints disabled (no API key configured)",
        404: "The model named is not served here (code model_not_found)",
        413: "Request body over the server's limit", 429: "Waiting queue full (Retry-After)",
        503: "Models loading, server draining for shutdown, or request timed out in the queue "
             "(Retry-After where trying again may succeed)"}


# one server-sent event (the OpenAPI 3.1 reading of an event-stream schema): `data` is a JSON chunk,
# or an error object when the server ends the request, and finally `[DONE]`
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {c: {"model": ErrorResponse, "description": _WHY[c]} for c in codes}


def ok(model: type[BaseModel] | None, stream: bool = False, media: str | None = None
       ) -> dict[int | str, dict[str, Any]]:
    """The 200 answer: `model` as JSON, or server-sent events too (stream: true), or another `media`."""
    content: dict[str, Any] = {}
    if stream:
        content["text/event-stream"] = {"schema": _SSE_EVENT}
    if media is not None:
        content[media] = {"schema": {"type": "string"}}
    entry: dict[str, Any] = {"description": "OK"}
    if model is not None:
        entry["model"] = model
    if content:
        entry["content"] = content
    return {200: entry}


def install(app: FastAPI) -> None:
    """Generate the schema once, on first request, without the 422 answers FastAPI adds."""
    def schema() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            for path in doc.get("paths", {}).values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                doc.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = doc
        return app.openapi_schema
    app.openapi = schema  # type: ignore[method-assign]
