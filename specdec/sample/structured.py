"""Structured outputs: a request's JSON schema, regex, grammar or choice as a token mask (llguidance).

`GrammarCompiler` (one per engine) turns a StructuredOutput into an llguidance grammar, checks it
against the tokenizer (a ValueError naming the problem, before anything is queued) and makes one
`GrammarState` per request (specdec/grammar.py), the one owner of its matcher. The target's rows
and a draft model's rows are masked by the same state, so both sides of the rejection sampler see
the same constrained distribution, and it stays exact with respect to it.

The mask is applied to raw logits, before penalties, temperature and top-k/p: the filters choose
among the tokens the grammar allows.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

from specdec.grammar import GrammarState
from specdec.sampling_params import StructuredOutput

# JSON is generated compactly but readably, with a single layout: more tokens are forced (free drafts)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHE_SIZE = 256   # validated grammars kept per engine (a schema sent again is not re-checked)


class GrammarCompiler:
    """StructuredOutput -> llguidance grammar -> per-request Matcher, for one tokenizer. Thread-safe:
    the server checks requests on its own threads while the engine thread makes matchers."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._lltok = None
        self._lock = threading.Lock()
        self._valid: OrderedDict[str, None] = OrderedDict()

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
        naming the problem (an invalid schema, regex or grammar)."""
        grammar = grammar_text(structured)
        with self._lock:
            if grammar in self._valid:
                self._valid.move_to_end(grammar)
                return grammar
        from llguidance import LLMatcher
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.lltokenizer)
        if is_error:
            raise ValueError(f"invalid {_NAMES[structured.kind]}: {messages[0].strip() if messages else 'rejected'}")
        with self._lock:
            self._valid[grammar] = None
            if len(self._valid) > _CACHE_SIZE:
                self._valid.popitem(last=False)
        return grammar

    def matcher(self, structured: StructuredOutput) -> GrammarState:
        from llguidance import LLMatcher
        m = LLMatcher(self.lltokenizer, self.compile(structured), log_level=0)
        if m.is_error():
            raise ValueError(f"invalid {_NAMES[structured.kind]}: {m.get_error()}")
        return GrammarState(m, self._tokenizer.vocab_size)


def check_structured(structured: StructuredOutput) -> None:
    """Validate a schema, regex or grammar without a tokenizer, so that a caller can refuse it
    before any model loads (the CLI; a server could too). Raises ValueError: one line naming the problem."""
    from llguidance import LLMatcher
    name = _NAMES[structured.kind]
    try:
        grammar = grammar_text(structured)
    except ValueError as e:  # a grammar that is neither Lark nor GBNF
        raise ValueError(f"invalid {name}: {e}") from None
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, None)
    if is_error:
        # the message without llguidance's caret diagrams and source echoes
        lines = [ln.strip() for ln in (messages[0] if messages else "rejected").splitlines()]
        text = " ".join(ln for ln in lines if ln and set(ln) != {"^"} and not re.match(r"\d+ \| ", ln))
        raise ValueError(f"invalid {name}: {text}")


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
