"""The HTTP edge's request schema (pydantic, OpenAI field names and defaults) and its translation
into SamplingParams. Validation here is strict: wrong types, NaN / Inf and out-of-range values are
rejected before anything reaches the engine (the routes turn the errors into 400s)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from specdec.request import SpecOptions
from specdec.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_STOP = 16          # stop strings per request
MAX_TOP_LOGPROBS = MAX_LOGPROBS


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
    # unknown fields (user, logit_bias, ...) are accepted and ignored, as OpenAI-compatible servers do
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

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
    speculative: SpeculativeRequest | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    def sampling_params(self, max_tokens: int, logprobs: int | None, seed_offset: int = 0) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=None if self.seed is None else (self.seed + seed_offset) % 2**63,
            max_tokens=max_tokens, stop=list(self.stop or []), stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, logprobs=logprobs)


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


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: only text is supported
            parts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts are supported")
                parts.append(part["text"])
            return "".join(parts)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
