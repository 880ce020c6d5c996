"""SamplingParams: how one request turns logits into tokens, and when it stops.

temperature 0 means greedy. Every field is validated here so that a bad value fails before the
request touches the engine.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0   # OpenAI's range: a bias of +-100 bans or forces a token
MAX_CACHE_SALT = 1024    # characters
STRUCTURED_KINDS = ("json", "json_schema", "regex", "grammar", "choice")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output, enforced token by token (sample/structured.py).

    kind: "json" (any JSON object), "json_schema" (`spec`: a schema, as a dict or its JSON text),
    "regex" (`spec`: a regular expression over the whole output), "grammar" (`spec`: a Lark or GBNF
    context-free grammar) or "choice" (`spec`: the list of strings allowed). The shape is checked
    here; the schema, regex or grammar itself when the engine compiles it (a ValueError)."""
    kind: str
    spec: Any = None

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}")
        if self.kind == "json_schema":
            schema = self.spec
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be an object (or true / false)")
        elif self.kind in ("regex", "grammar"):
            if not isinstance(self.spec, str) or not self.spec:
                raise ValueError(f"a {self.kind} must be a non-empty string")
        elif self.kind == "choice":
            if (not isinstance(self.spec, (list, tuple)) or not self.spec
                    or any(not isinstance(c, str) or not c for c in self.spec)):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "spec", tuple(self.spec))
        elif self.spec is not None:
            raise ValueError("structured output 'json' takes no spec")


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0            # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # over prompt and output (CTRL-style: divide positive logits)
    presence_penalty: float = 0.0    # over output
    frequency_penalty: float = 0.0   # over output
    # a seed fixes the request's noise at every output position (with `choice`: which of a request's n
    # choices this is), so the same seed gives the same text with or without speculation; None: the
    # engine draws one and records it (RequestStats.seed)
    seed: int | None = None
    choice: int = 0
    max_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token
    skip_special_tokens: bool = True
    structured: StructuredOutput | None = None  # a JSON schema, regex, grammar or choice the output must match
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before any other processing
    # cache scope (vLLM's cache_salt): prefix-cache blocks and suffix-cache outputs are shared only
    # among requests with the same salt; None is the default scope
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        _finite("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer (0 or -1 = off), got {self.top_k!r}")
        _finite("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _finite("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        _finite("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _finite(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if not isinstance(self.choice, int) or isinstance(self.choice, bool) or self.choice < 0:
            raise ValueError(f"choice must be a non-negative integer, got {self.choice!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError("structured must be a StructuredOutput")
        if self.structured is not None and self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with structured output: the grammar decides where it ends")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.logit_bias is not None:
            self.logit_bias = _checked_bias(self.logit_bias)
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str)
                                            or not 0 < len(self.cache_salt) <= MAX_CACHE_SALT):
            raise ValueError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT} characters")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def cache_scope(self) -> str:
        """The caches' name for this request's scope: "" (no salt) or a digest of the salt, so
        that neither the caches, their metrics nor a saved suffix cache hold the salt itself."""
        return cache_scope(self.cache_salt)

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _checked_bias(bias: dict) -> dict[int, float] | None:
    """logit_bias as {token id: float}, checked (ids non-negative integers, biases finite within
    +-MAX_LOGIT_BIAS); None when empty. Raises ValueError naming the bad entry."""
    if not isinstance(bias, dict):
        raise ValueError("logit_bias must be a map of token id to bias")
    out = {}
    for token, value in bias.items():
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {token!r}")
        _finite(f"logit_bias[{token}]", value)
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias[{token}] must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value}")
        out[token] = float(value)
    return out or None


def _finite(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


@functools.lru_cache(maxsize=4096)   # asked on every step (prefix hashes, the suffix cache): hash each salt once
def cache_scope(salt: str | None) -> str:
    return "" if salt is None else hashlib.sha256(b"cache_salt\x00" + salt.encode("utf-8", "surrogatepass")).hexdigest()[:32]
