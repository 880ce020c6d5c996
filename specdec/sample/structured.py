"""Structured outputs: a request's JSON schema, regex, grammar or choice as a token mask (llguidance).

`GrammarCompiler` (one per engine) turns a StructuredOutput into an llguidance grammar, checks it
against the tokenizer (a ValueError naming the problem, before anything is queued) and makes one
`GrammarState` per request (specdec/grammar.py), the one owner of its matcher. The target's rows
and a draft model's rows are masked by the same state, so both sides of the rejection sampler see
the same constrained distribution, and it stays exact with respect to it.

The mask is applied to raw logits, before penalties, temperature and top-k/p: the filters choose
among the tokens the grammar allows.

Grammar work is bounded (StructuredConfig, YAML `structured_outputs`): every matcher gets llguidance's
parser limits; a compile runs on its own thread with a large stack (llguidance recurses on deep
grammars) and is refused past `compile_timeout_s`, or when its first mask is slower than
`mask_timeout_ms`; the ValueError names the bound. At most `max_concurrent_compiles` run at once
(a compile past its timeout still counts: it still uses a core), so a flood of slow grammars cannot
starve the engine of CPU; one more is refused with GrammarBusy.
"""
from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from specdec.config import StructuredConfig
from specdec.grammar import GrammarState, bound_message
from specdec.sampling_params import StructuredOutput

# JSON is generated compactly but readably, with a single layout: more tokens are forced (free drafts)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHE_SIZE = 32       # compiled matchers kept per engine (copied per request; a schema sent again is free)
_REFUSED_SIZE = 256    # grammars refused (invalid, over a bound): a resend is refused without new work
# llguidance recurses over rule and $ref chains: a 3,000-rule Lark chain overflows the default 8 MiB
# stack and kills the process; 512 MiB (address space, committed only as used) holds any 1 MiB body's
_STACK_BYTES = 512 << 20
_STACK_LOCK = threading.Lock()   # threading.stack_size is process-wide: set, start the thread, restore


class GrammarBusy(RuntimeError):
    """As many grammars as allowed are compiling (they may run on past their timeout): try later."""


def run_on_big_stack(fn: Callable[[], Any], name: str = "specdec-grammar") -> Future:
    """fn() on a new daemon thread with a large stack; its result (or exception) as a Future. The
    thread cannot be stopped: callers bound the work by llguidance's limits and stop waiting."""
    done: Future = Future()

    def target() -> None:
        try:
            done.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            done.set_exception(e)
    with _STACK_LOCK:
        previous = threading.stack_size(_STACK_BYTES)
        try:
            threading.Thread(target=target, name=name, daemon=True).start()
        finally:
            threading.stack_size(previous)
    return done


class GrammarCompiler:
    """StructuredOutput -> llguidance grammar -> per-request GrammarState, for one tokenizer, within the
    bounds of a StructuredConfig. Thread-safe: the server checks requests on its own threads while the
    engine thread makes matchers."""

    def __init__(self, tokenizer, config: StructuredConfig | None = None) -> None:
        self._tokenizer = tokenizer
        self.config = config or StructuredConfig()
        self._lltok = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, Any] = OrderedDict()   # grammar -> its matcher before any token
        self._refused: OrderedDict[str, str] = OrderedDict()    # grammar -> why (the ValueError's text)
        self._pending: dict[str, Future] = {}                    # compiles under way, shared by their requests

    @property
    def lltokenizer(self):
        """The llguidance view of the tokenizer, built on first use (about a second for 150k tokens)."""
        with self._lock:
            if self._lltok is None:
                import llguidance
                tok = self._tokenizer
                self._lltok = llguidance.LLTokenizer(tok.to_json(), n_vocab=tok.vocab_size,
                                                     eos_token=list(tok.eos_token_ids) or None)
            return self._lltok

    def compile(self, structured: StructuredOutput) -> str:
        """The llguidance grammar of `structured`, checked against the tokenizer. Raises ValueError
        naming the problem (an invalid schema, regex or grammar) or the bound it exceeds."""
        return self.compile_async(structured).result()

    def compile_async(self, structured: StructuredOutput) -> Future:
        """compile() as a Future that settles within compile_timeout_s (a server awaits it without
        holding a thread); a compile still running then goes on, alone, and its grammar stays refused."""
        answer: Future = Future()
        try:
            grammar = grammar_text(structured)
        except ValueError as e:  # a grammar that is neither Lark nor GBNF
            answer.set_exception(ValueError(f"invalid {_NAMES[structured.kind]}: {e}"))
            return answer
        with self._lock:
            if grammar in self._compiled:
                self._compiled.move_to_end(grammar)
                answer.set_result(grammar)
                return answer
            if grammar in self._refused:
                answer.set_exception(ValueError(self._refused[grammar]))
                return answer
            job, new = self._pending.get(grammar), grammar not in self._pending
            if new and len(self._pending) >= self.config.max_concurrent_compiles:
                answer.set_exception(GrammarBusy(
                    f"{len(self._pending)} grammars are compiling (structured_outputs.max_concurrent_compiles="
                    f"{self.config.max_concurrent_compiles}); retry"))
                return answer
            if new:
                job = self._pending[grammar] = run_on_big_stack(lambda: self._build(grammar, structured.kind))
        if new:  # callbacks outside the lock: a job already done runs them here, and they take it
            job.add_done_callback(lambda j: self._built(grammar, j))
        job.add_done_callback(lambda j: _settle(answer, grammar if j.exception() is None else None, j.exception()))
        timer = threading.Timer(self.config.compile_timeout_s, self._expire, (grammar, answer, structured.kind))
        timer.daemon = True
        timer.start()
        answer.add_done_callback(lambda _: timer.cancel())
        return answer

    def matcher(self, structured: StructuredOutput) -> GrammarState:
        """A request's own grammar state (a copy of the compiled matcher). Raises ValueError as compile()."""
        grammar = self.compile(structured)
        with self._lock:
            proto = self._compiled.get(grammar)
        if proto is None:  # evicted since by _CACHE_SIZE other grammars: build it again, bounded alike
            job = run_on_big_stack(lambda: self._build(grammar, structured.kind))
            try:
                proto = job.result(timeout=self.config.compile_timeout_s)
            except FutureTimeout:
                raise ValueError(self._timeout_message(structured.kind)) from None
        return GrammarState(proto.deep_copy(), self._tokenizer.vocab_size, tuple(self._tokenizer.eos_token_ids),
                            self.config)

    def _build(self, grammar: str, kind: str):
        """The matcher of `grammar` before any token, its first mask computed (on the big-stack thread)."""
        from llguidance import LLMatcher, LLParserLimits
        m = LLMatcher(self.lltokenizer, grammar, log_level=0, limits=LLParserLimits(**self.config.parser_limits()))
        if not m.is_error():
            t0 = time.perf_counter()
            m.compute_bitmask()   # a grammar whose very first mask is over a bound is refused up front
            ms = (time.perf_counter() - t0) * 1000
            if not m.is_error() and ms > self.config.mask_timeout_ms:
                raise ValueError(f"{_NAMES[kind]}: its first token mask took {ms:.0f} ms: exceeds "
                                 f"structured_outputs.mask_timeout_ms={self.config.mask_timeout_ms:g}")
        if m.is_error():
            bound = bound_message(m.get_error(), self.config)
            name = _NAMES[kind]
            raise ValueError(f"{name} {bound}" if bound else f"invalid {name}: {_one_line(m.get_error())}")
        return m

    def _built(self, grammar: str, job: Future) -> None:
        with self._lock:
            self._pending.pop(grammar, None)
            if grammar in self._refused:   # it ran past compile_timeout_s: stays refused
                return
            error = job.exception()
            if error is None:
                _put(self._compiled, grammar, job.result(), _CACHE_SIZE)
            elif isinstance(error, ValueError):
                _put(self._refused, grammar, str(error), _REFUSED_SIZE)

    def _expire(self, grammar: str, answer: Future, kind: str) -> None:
        message = self._timeout_message(kind)
        with self._lock:
            if grammar in self._pending:
                _put(self._refused, grammar, message, _REFUSED_SIZE)
        _settle(answer, None, ValueError(message))

    def _timeout_message(self, kind: str) -> str:
        return (f"compiling the {_NAMES[kind]} exceeded structured_outputs.compile_timeout_s="
                f"{self.config.compile_timeout_s:g}s")


def _settle(answer: Future, result: Any, error: BaseException | None) -> None:
    """Settle `answer` unless the other side (the compile or its timer) already did."""
    try:
        if error is not None:
            answer.set_exception(error)
        else:
            answer.set_result(result)
    except InvalidStateError:
        pass


def _put(cache: OrderedDict, key: str, value: Any, size: int) -> None:
    cache[key] = value
    cache.move_to_end(key)
    if len(cache) > size:
        cache.popitem(last=False)


def _one_line(message: str) -> str:
    """llguidance's message without its caret diagrams and source echoes."""
    lines = [ln.strip() for ln in (message or "rejected").splitlines()]
    return " ".join(ln for ln in lines if ln and set(ln) != {"^"} and not re.match(r"\d+ \| ", ln)
                    and ln != "<non-verbose/>")


def check_structured(structured: StructuredOutput, config: StructuredConfig | None = None) -> None:
    """Validate a schema, regex or grammar without a tokenizer, so that a caller can refuse it
    before any model loads (the CLI; a server could too), within the same bounds as a compile.
    Raises ValueError: one line naming the problem or the bound."""
    from llguidance import LLMatcher, LLParserLimits
    config = config or StructuredConfig()
    name = _NAMES[structured.kind]
    try:
        grammar = grammar_text(structured)
    except ValueError as e:  # a grammar that is neither Lark nor GBNF
        raise ValueError(f"invalid {name}: {e}") from None
    limits = LLParserLimits(**config.parser_limits())
    job = run_on_big_stack(lambda: LLMatcher.validate_grammar_with_warnings(grammar, None, limits=limits))
    try:
        is_error, messages = job.result(timeout=config.compile_timeout_s)
    except FutureTimeout:
        raise ValueError(f"compiling the {name} exceeded structured_outputs.compile_timeout_s="
                         f"{config.compile_timeout_s:g}s") from None
    if is_error:
        message = messages[0] if messages else "rejected"
        bound = bound_message(message, config)
        raise ValueError(f"{name} {bound}" if bound else f"invalid {name}: {_one_line(message)}")


_NAMES = {"json": "JSON mode", "json_schema": "JSON schema", "regex": "regular expression", "grammar": "grammar",
          "choice": "choice"}


def grammar_text(structured: StructuredOutput) -> str:
    """The llguidance grammar (its JSON form) of a StructuredOutput. Raises ValueError when the spec
    cannot even be read (a grammar that is neither Lark nor GBNF)."""
    import llguidance
    from llguidance import LLMatcher
    kind, spec = structured.kind, structured.spec
    if kind == "json":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(list(spec)))
    return llguidance.grammar_from("grammar", spec)   # Lark, or GBNF (converted)
