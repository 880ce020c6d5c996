"""Structured outputs: a request's JSON schema, regex, grammar or choice as a token mask (llguidance).

`GrammarCompiler` (one per engine) turns a StructuredOutput into an llguidance grammar, checks it
against the tokenizer (a ValueError naming the problem, before anything is queued) and makes one
`Matcher` per request. A matcher follows the request's committed tokens. Whoever forms a
distribution over a position advances it over the drafts before that position, takes the mask
there and rolls it back afterwards: the target's rows at verification (`constrain`) and a draft
model's rows while it drafts. Both sides of the rejection sampler therefore see the same constrained
distribution, and it stays exact with respect to it.

The mask is applied to raw logits, before penalties, temperature and top-k/p: the filters choose
among the tokens the grammar allows.
"""
from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict

import numpy as np
import torch

from specdec.sampling_params import StructuredOutput

# JSON is generated compactly but readably, with a single layout: more tokens are forced (free drafts)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHE_SIZE = 256   # validated grammars kept per engine (a schema sent again is not re-checked)


class Matcher:
    """One request's grammar state over its committed tokens (plus any drafts advanced over)."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self._m = matcher
        self.vocab_size = vocab_size
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        self.mask_seconds = 0.0   # time spent computing masks, and how many (the bench reports both)
        self.num_masks = 0

    def allowed(self, width: int | None = None) -> torch.Tensor | None:
        """[width] bool (default the vocabulary size): the tokens allowed next, entries past the
        vocabulary (padding rows) forbidden; None once nothing is (after EOS): no constraint left.
        A grammar that cannot go on allows only EOS."""
        t0 = time.perf_counter()
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        allowed = torch.from_numpy(np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.vocab_size])
        allowed = allowed.bool()
        self.mask_seconds += time.perf_counter() - t0
        self.num_masks += 1
        if not bool(allowed.any()):
            return None
        width = width or self.vocab_size
        if width > self.vocab_size:
            return torch.cat([allowed, torch.zeros(width - self.vocab_size, dtype=torch.bool)])
        return allowed[:width]

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of one row of logits [n] with the tokens the grammar forbids at -inf (n may differ
        from the grammar's vocabulary: padding rows are forbidden, a draft's shorter row is cut)."""
        allowed = self.allowed(logits.shape[-1])
        if allowed is None:
            return logits
        return logits.masked_fill(~allowed.to(logits.device), float("-inf"))

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` the grammar accepts in a row from here (the state does not change)."""
        return self._m.validate_tokens(list(tokens)) if tokens else 0

    def consume(self, tokens: list[int]) -> int:
        """Advance over the longest accepted prefix of `tokens`; returns its length (a forbidden token
        would put the matcher into a permanent error state, so it is never fed)."""
        n = self.valid_prefix(tokens)
        if n and not self._m.consume_tokens(list(tokens[:n])):
            raise RuntimeError(f"grammar matcher failed: {self._m.get_error()}")
        return n

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self._m.rollback(num_tokens):
            raise RuntimeError(f"grammar matcher could not roll back {num_tokens} token(s): {self._m.get_error()}")

    def forced(self, limit: int) -> list[int]:
        """The tokens the grammar allows as the only (canonical) continuation from here, at most
        `limit`: proposed as drafts for free."""
        return list(self._m.compute_ff_tokens()[:limit]) if limit > 0 and not self._m.is_stopped() else []

    @property
    def is_accepting(self) -> bool:
        return self._m.is_accepting()


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

    def matcher(self, structured: StructuredOutput) -> Matcher:
        from llguidance import LLMatcher
        m = LLMatcher(self.lltokenizer, self.compile(structured), log_level=0)
        if m.is_error():
            raise ValueError(f"invalid {_NAMES[structured.kind]}: {m.get_error()}")
        return Matcher(m, self._tokenizer.vocab_size)


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


def constrain(matcher: Matcher, rows: torch.Tensor, drafts: list[int]) -> tuple[torch.Tensor, int]:
    """Mask a request's verification rows [k + 1, vocab] (row j: the state after drafts[:j]) and
    return (masked rows, drafts advanced over). Rows past the first draft the grammar forbids stay
    as they are: that draft is rejected (its probability is 0), so nothing after it is used.
    The caller finishes with `settle`."""
    out = rows.clone()
    consumed = 0
    for j in range(len(drafts) + 1):
        out[j] = matcher.mask(out[j])
        if j == len(drafts) or matcher.consume([drafts[j]]) == 0:
            break
        consumed += 1
    return out, consumed


def settle(matcher: Matcher, consumed: int, num_accepted: int, final_token: int) -> None:
    """After rejection sampling: drop the rejected drafts advanced over, take the final token. (More
    accepted than advanced over: an EOS the ended grammar allows but does not consume; the request
    stops there.)"""
    matcher.rollback(max(0, consumed - num_accepted))
    matcher.consume([final_token])
