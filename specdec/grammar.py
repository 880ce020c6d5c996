"""GrammarState: one request's structured-output state, the only owner of its llguidance matcher.

The state follows the request's emitted tokens (`commit`, by the engine). Whoever forms a
distribution past them (the verifier's target rows, a draft model's rows, the speculator's
grammar-forced drafts) does it inside `lookahead()`, which advances over drafts and rolls all of it
back on exit: no caller can leave the matcher unbalanced. sample/structured.py compiles grammars
and makes these.

A grammar that hits one of llguidance's limits mid-generation, or one token mask slower than
`structured_outputs.mask_timeout_ms`, ends its own request: from then on only EOS is allowed
(`error` says why); the other requests in the batch are untouched.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from specdec.config import StructuredConfig

log = logging.getLogger("specdec")

# llguidance's error text -> the structured_outputs bound it hit
_BOUND_FRAGMENTS = (("initial lexer configuration", "initial_lexer_fuel"),
                    ("grammar size (number of symbols)", "max_grammar_size"),
                    ("current row has", "max_items_in_row"), ("too many items", "step_max_items"),
                    ("too many states", "max_lexer_states"), ("fuel", "step_lexer_fuel"))


def bound_message(error: str, config: StructuredConfig) -> str | None:
    """`error` (llguidance's) as "exceeds structured_outputs.FIELD=VALUE: ..."; None when it is not a
    limit's error (an invalid schema, regex or grammar)."""
    first = error.strip().splitlines()[0] if error.strip() else "limit reached"
    low = first.lower()
    for fragment, name in _BOUND_FRAGMENTS:
        if fragment in low:
            return f"exceeds structured_outputs.{name}={getattr(config, name)}: {first}"
    return None


class GrammarState:
    """One request's grammar state: the only owner of its llguidance matcher.

    The matcher follows the request's emitted tokens (`commit`). Whoever forms a distribution over a
    position past them (verification rows, a draft model's rows, grammar-forced drafts) does it
    inside `lookahead()`, which advances over drafts and rolls all of it back on exit, so no caller
    can leave the state unbalanced."""

    def __init__(self, matcher, vocab_size: int, stop_token_ids: tuple[int, ...] = (),
                 config: StructuredConfig | None = None) -> None:
        self._m = matcher
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)   # what an errored grammar still allows (EOS)
        self.config = config or StructuredConfig()
        self.error: str | None = None   # why the grammar ended the request early (a bound it hit)
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        self.committed_tokens: list[int] = []   # what the matcher has consumed outside lookaheads
        self.depth = 0            # open lookaheads
        self.mask_seconds = 0.0   # time spent computing masks, and how many (the bench reports both)
        self.num_masks = 0

    def allowed(self, width: int | None = None) -> torch.Tensor | None:
        """[width] bool (default the vocabulary size): the tokens allowed next, entries past the
        vocabulary (padding rows) forbidden; None once nothing is (after EOS): no constraint left.
        A grammar that cannot go on, or that hit a bound (`error`), allows only EOS."""
        if self.error is None:
            self._compute_mask()
        if self.error is not None:
            allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
            allowed[[t for t in self.stop_token_ids if t < self.vocab_size]] = True
        else:
            bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.vocab_size]
            allowed = torch.from_numpy(bits).bool()
        if not bool(allowed.any()):
            return None
        width = width or self.vocab_size
        if width > self.vocab_size:
            return torch.cat([allowed, torch.zeros(width - self.vocab_size, dtype=torch.bool)])
        return allowed[:width]

    def _compute_mask(self) -> None:
        t0 = time.perf_counter()
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        seconds = time.perf_counter() - t0
        self.mask_seconds += seconds
        self.num_masks += 1
        if self._m.is_error():
            self._fail(bound_message(self._m.get_error(), self.config) or self._m.get_error())
        elif seconds * 1000 > self.config.mask_timeout_ms:
            # the fuel limits bound a mask's work; this wall-clock bound catches what they let through
            self._fail(f"a token mask took {seconds * 1000:.0f} ms: exceeds structured_outputs.mask_timeout_ms="
                       f"{self.config.mask_timeout_ms:g}")

    def _fail(self, error: str) -> None:
        """End the request's grammar: only EOS from here (the matcher is never used again)."""
        self.error = error.strip().splitlines()[0] if error.strip() else "grammar error"
        log.warning("structured output ended early: %s", self.error)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of one row of logits [n] with the tokens the grammar forbids at -inf (n may differ
        from the grammar's vocabulary: padding rows are forbidden, a draft's shorter row is cut)."""
        allowed = self.allowed(logits.shape[-1])
        if allowed is None:
            return logits
        return logits.masked_fill(~allowed.to(logits.device), float("-inf"))

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` the grammar accepts in a row from here (the state does not change)."""
        return self._m.validate_tokens(list(tokens)) if tokens and self.error is None else 0

    def forced(self, limit: int) -> list[int]:
        """The tokens the grammar allows as the only (canonical) continuation from here, at most
        `limit`: proposed as drafts for free."""
        if limit <= 0 or self.error is not None or self._m.is_stopped():
            return []
        return list(self._m.compute_ff_tokens()[:limit])

    def commit(self, tokens: list[int]) -> None:
        """The request emitted `tokens`: advance over them (a token the ended grammar does not consume,
        an EOS it allows, is where the request stops)."""
        assert self.depth == 0, "commit inside a lookahead"
        self.committed_tokens += tokens[: self._consume(tokens)]

    def lookahead(self) -> "Lookahead":
        return Lookahead(self)

    def mask_rows(self, rows: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        """Verification rows [k + 1, vocab] (row j: the state after drafts[:j]) masked. Rows past the
        first draft the grammar forbids stay as they are: that draft is rejected (its probability
        is 0), so nothing after it is used."""
        out = rows.clone()
        with self.lookahead() as ahead:
            for j in range(len(drafts) + 1):
                out[j] = ahead.mask(out[j])
                if j == len(drafts) or ahead.advance([drafts[j]]) == 0:
                    break
        return out

    @property
    def is_accepting(self) -> bool:
        return self.error is None and self._m.is_accepting()

    def _consume(self, tokens: list[int]) -> int:
        """Advance over the longest accepted prefix of `tokens`; returns its length (a forbidden token
        would put the matcher into a permanent error state, so it is never fed). A limit hit while
        consuming ends the grammar (0 consumed)."""
        n = self.valid_prefix(tokens)
        if n and not self._m.consume_tokens(list(tokens[:n])):
            self._fail(bound_message(self._m.get_error(), self.config) or self._m.get_error())
            return 0
        return n

    def _rollback(self, num_tokens: int) -> None:
        if self.error is not None or not num_tokens:
            return   # an errored matcher stays errored (llguidance's rule): nothing to restore
        if not self._m.rollback(num_tokens):
            if not self._m.is_error():
                raise RuntimeError(f"grammar matcher could not roll back {num_tokens} token(s): {self._m.get_error()}")
            self._fail(bound_message(self._m.get_error(), self.config) or self._m.get_error())


class Lookahead:
    """A scope past the committed tokens: `advance` over drafts, `mask` rows there; everything
    advanced is rolled back when the scope closes. Scopes nest (forced tokens, then a draft model's
    own drafts)."""

    def __init__(self, state: GrammarState) -> None:
        self.state = state
        self.advanced = 0

    def __enter__(self) -> "Lookahead":
        self.state.depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self.state._rollback(self.advanced)
        self.advanced = 0
        self.state.depth -= 1

    def advance(self, tokens: list[int]) -> int:
        n = self.state._consume(tokens)
        self.advanced += n
        return n

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        return self.state.mask(logits)

    def valid_prefix(self, tokens: list[int]) -> int:
        return self.state.valid_prefix(tokens)
