"""The HTTP edge's request schema (pydantic, OpenAI field names and defaults) and its translation
into SamplingParams. Validation here is strict: wrong types, NaN / Inf and out-of-range values are
rejected before anything reaches the engine (the routes turn the errors into 400s)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from specdec.request import SpecOptions
from specdec.sampling_params import MAX_CACHE_SALT, MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams, StructuredOutput

MAX_STOP = 16          # stop strings per request
MAX_TOP_LOGPROBS = MAX_LOGPROBS
MAX_LOGIT_BIAS_ENTRIES = 1024   # biased tokens per request (each is work on every row it samples)


def _unicode(v: Any) -> Any:
    """JSON lets a string carry a lone UTF-16 surrogate ("\\ud800"); no text can: refuse it here."""
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("text is not valid Unicode (a lone UTF-16 surrogate)") from None
    elif isinstance(v, list):
        for x in v:
            _unicode(x)
    elif isinstance(v, dict):
        for k, x in v.items():
            _unicode(k)
            _unicode(x)
    return v


class _Strict(BaseModel):
    # a field this server does not implement is a 400 naming it, never silently dropped
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid", populate_by_name=True)

    @field_validator("*")
    @classmethod
    def _text(cls, v: Any) -> Any:
        return _unicode(v)


class SpeculativeRequest(_Strict):
    enabled: bool = True
    # "draft_model", "ngram", "auto" (the router) or the id of a configured draft
    method: str | None = Field(default=None, min_length=1, max_length=200)
    max_k: int | None = Field(default=None, ge=0, le=16)

    def options(self) -> SpecOptions:
        return SpecOptions(self.enabled, self.method, self.max_k)


class AdminDraftRequest(_Strict):
    action: Literal["load", "unload"]
    model: str = Field(min_length=1, max_length=1000)   # registry name, path, or a loaded draft's id


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    name: str = Field(default="response", min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default=True, alias="schema")
    strict: bool | None = None   # the schema is enforced either way


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)     # OpenAI's default
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    # extensions (vLLM names), usually sent through the client's extra_body
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list, max_length=64)
    # OpenAI's map of token id (a string key in JSON) -> bias in [-100, 100], added to the logit
    logit_bias: dict[str, float] | None = None
    speculative: SpeculativeRequest | None = None
    # vLLM's: prefix-cache blocks and suffix-cache drafts are shared only among requests with the same salt
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT)
    # structured output: OpenAI's response_format, or vLLM's guided_* fields (through extra_body)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(default=None, min_length=1)
    guided_grammar: str | None = Field(default=None, min_length=1)
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    # accepted and ignored (bookkeeping in OpenAI's API)
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return None
        if len(v) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} entries")
        for key, bias in v.items():
            if not (key.isascii() and key.isdigit() and len(key) <= 12):
                raise ValueError(f"keys must be token ids (non-negative integers), got {key!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"biases must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias} for {key}")
        return v

    def bias_by_id(self) -> dict[int, float] | None:
        """logit_bias with integer keys (validated: they are digits)."""
        return {int(k): b for k, b in self.logit_bias.items()} if self.logit_bias else None

    def structured(self) -> tuple[StructuredOutput, str] | None:
        """The requested output constraint and the field that asked for it. Raises ValueError for
        two at once or a malformed one."""
        chosen = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            chosen.append((StructuredOutput("json"), "response_format"))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise ValueError("response_format: type json_schema needs a json_schema object")
            chosen.append((StructuredOutput("json_schema", rf.json_schema.schema_), "response_format"))
        for name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"),
                           ("guided_grammar", "grammar"), ("guided_choice", "choice")):
            value = getattr(self, name)
            if value is not None:
                chosen.append((StructuredOutput(kind, value), name))
        if len(chosen) > 1:
            raise ValueError(f"at most one output constraint per request, got {', '.join(f for _, f in chosen)}")
        return chosen[0] if chosen else None

    def sampling_params(self, max_tokens: int, logprobs: int | None, seed: int | None = None, choice: int = 0,
                        structured: StructuredOutput | None = None, cache_salt: str | None = None) -> SamplingParams:
        """Choice `choice` of the request; `seed`: the request's (its own `seed` field, or one the server
        drew for all its choices)."""
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=seed, choice=choice,
            max_tokens=max_tokens, stop=list(self.stop or []), stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, logprobs=logprobs, structured=structured, logit_bias=self.bias_by_id(),
            cache_salt=cache_salt)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)   # OpenAI's completions default
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return []
        if all(isinstance(x, int) for x in p):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class FunctionCall(_Strict):
    name: str
    arguments: str   # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    # validated even when absent: only an assistant (or tool) turn may go without content
    content: str | list[dict[str, Any]] | None = Field(default=None, validate_default=True)
    name: str | None = None
    tool_calls: list[ToolCall] | None = None     # an assistant turn that called tools
    tool_call_id: str | None = None              # a tool's result answers this call
    refusal: str | None = None                   # echoed back by clients; ignored

    @field_validator("content")
    @classmethod
    def _content(cls, v: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if v is None and role in ("system", "user", "developer"):
            raise ValueError(f"a {role} message needs content (a string or a list of text parts), not null")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: only text is supported
            parts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts are supported")
                parts.append(part["text"])
            return "".join(parts)
        return self.content or ""


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None   # the parameters' schema is enforced whenever a call is required


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: its TokenizeCompletionRequest (`prompt`) and TokenizeChatRequest (`messages`,
    templated as /v1/chat/completions templates them) in one model; exactly one of the two is given.
    add_special_tokens defaults as vLLM's: true for a prompt, false for messages (the template
    writes them)."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[ToolDefinition] | None = Field(default=None, max_length=128)
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int] = Field(max_length=1_000_000)
