"""The request schema of POST /v1/responses (pydantic, OpenAI's field names): the subset of the
Responses API a stateless server can honour, and its translation into the chat route's request.

Nothing is stored, so what needs server state is refused with a 400 naming the field:
`previous_response_id`, `store: true`; so is `reasoning` (no reasoning models here), a non-empty
`include` and `truncation: "auto"`. Unknown fields are 400s as everywhere (strict models).
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BeforeValidator, Discriminator, Field, Tag, field_validator, model_validator

from specdec.sampling_params import MAX_CACHE_SALT
from specdec.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    SpeculativeRequest,
    ToolCall,
    ToolDefinition,
    _Strict,
)

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class TextPart(_Strict):
    type: Literal["input_text", "output_text"]
    text: str
    # carried by an earlier response's output_text when a client sends it back; ignored
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None
    parsed: Any = None   # the openai client's parse() and stream() helpers add it to the output_text they return


def _as_parts(v: Any) -> Any:
    # a plain string is one text part: one shape to validate, and errors that name the part
    return [{"type": "input_text", "text": v}] if isinstance(v, str) else v


TextParts = Annotated[list[TextPart], BeforeValidator(_as_parts, json_schema_input_type=str | list[TextPart])]


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: TextParts
    id: str | None = None            # an earlier output item's, sent back; ignored
    status: ItemStatus | None = None

    def text(self) -> str:
        return "".join(p.text for p in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str                   # JSON text, as the model wrote it
    id: str | None = None
    status: ItemStatus | None = None

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, v: str) -> str:
        # checked here, so the error names this item rather than the chat message it becomes
        try:
            value = json.loads(v) if v.strip() else {}
        except ValueError:
            raise ValueError("arguments must be a JSON object (as text)") from None
        if not isinstance(value, dict):
            raise ValueError("arguments must be a JSON object (as text)")
        return v


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: TextParts
    id: str | None = None
    status: ItemStatus | None = None


def _item_type(v: Any) -> str | None:
    if isinstance(v, dict):
        return v.get("type", "message")   # OpenAI's "easy" message items carry no type
    return getattr(v, "type", None)


InputItem = Annotated[
    Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
          Annotated[FunctionCallOutputItem, Tag("function_call_output")]],
    Discriminator(_item_type, custom_error_type="input_item",
                  custom_error_message="an input item is a message, function_call or function_call_output object")]


def _as_items(v: Any) -> Any:
    return [{"role": "user", "content": v}] if isinstance(v, str) else v


InputItems = Annotated[list[InputItem], BeforeValidator(_as_items, json_schema_input_type=str | list[InputItem]),
                       Field(min_length=1)]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None       # the parameters' schema is enforced whenever a call is required

    def chat(self) -> ToolDefinition:
        return ToolDefinition(type="function", function=FunctionDefinition(
            name=self.name, description=self.description, parameters=self.parameters, strict=self.strict))


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str


def _choice_kind(v: Any) -> str:
    return "function" if isinstance(v, (dict, FunctionChoice)) else "mode"


ToolChoice = Annotated[
    Union[Annotated[Literal["none", "auto", "required"], Tag("mode")], Annotated[FunctionChoice, Tag("function")]],
    Discriminator(_choice_kind)]


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None       # the schema is enforced either way

    @model_validator(mode="after")
    def _fields_of_type(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("a json_schema format needs a name and a schema")
        if self.type != "json_schema" and (self.name, self.description, self.schema_, self.strict) != (None,) * 4:
            raise ValueError(f"name, description, schema and strict belong to a json_schema format, not {self.type}")
        return self

    def chat(self) -> ResponseFormat | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return ResponseFormat(type="json_object")
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
            name=self.name, description=self.description, schema=self.schema_, strict=self.strict))


class TextConfig(_Strict):
    format: TextFormat | None = None


class ResponsesRequest(_Strict):
    model: str | None = None
    input: InputItems
    instructions: str | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool | None = None
    truncation: Literal["disabled"] | None = None
    # bookkeeping: echoed in the response, otherwise ignored
    user: str | None = None
    metadata: dict[str, str] | None = None
    # refused unless empty / false / null (see the module docstring)
    include: list[str] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    # extensions (as on the chat route), usually sent through the client's extra_body
    speculative: SpeculativeRequest | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT)

    @field_validator("include")
    @classmethod
    def _no_include(cls, v: list[str] | None) -> list[str] | None:
        if v:
            raise ValueError("this server has nothing extra to include (send [] or omit it)")
        return v

    @field_validator("store")
    @classmethod
    def _no_store(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("this server stores no responses (send false or omit it)")
        return v

    @field_validator("previous_response_id")
    @classmethod
    def _no_previous(cls, v: str | None) -> str | None:
        if v is not None:
            raise ValueError("this server keeps no responses: send the whole conversation in input")
        return v

    @field_validator("reasoning")
    @classmethod
    def _no_reasoning(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            raise ValueError("reasoning options are not supported (no reasoning model is served): send null or omit it")
        return v

    def chat_request(self) -> ChatCompletionRequest:
        """The equivalent /v1/chat/completions request (pydantic.ValidationError if the chat schema
        refuses a value this one let through)."""
        tools = [t.chat() for t in self.tools] if self.tools else None
        choice = self.tool_choice
        if tools is None and choice in ("auto", "none"):
            choice = None  # nothing to choose from: the same as no tools (clients send [] and "auto")
        if isinstance(choice, FunctionChoice):
            choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
        fmt = self.text.format if self.text is not None else None
        return ChatCompletionRequest(
            model=self.model, messages=chat_messages(self.instructions, self.input), tools=tools,
            tool_choice=choice, parallel_tool_calls=self.parallel_tool_calls is not False,
            max_completion_tokens=self.max_output_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, stream=bool(self.stream),
            response_format=None if fmt is None else fmt.chat(), user=self.user, metadata=self.metadata,
            speculative=self.speculative, cache_salt=self.cache_salt)


def chat_messages(instructions: str | None, items: list[MessageItem | FunctionCallItem | FunctionCallOutputItem]
                  ) -> list[ChatMessage]:
    """The conversation as chat messages: instructions as the first system message, developer as
    system (OpenAI's new name for it; Qwen2.5's template drops a developer turn without a word),
    function calls as the tool_calls of an assistant turn (consecutive calls, and calls right after
    an assistant message, share one turn: parallel calls), function call outputs as tool messages
    answering their call_id."""
    messages = [] if instructions is None else [ChatMessage(role="system", content=instructions)]
    for item in items:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append(ChatMessage(role=role, content=item.text()))
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        else:
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                        content="".join(p.text for p in item.output)))
    return messages
