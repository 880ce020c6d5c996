"""GrammarState: one request's structured-output state, the only owner of its llguidance matcher.

The state follows the request's emitted tokens (`commit`, by the engine). Whoever forms a
distribution past them (the verifier's target rows, a draft model's rows, the speculator's
grammar-forced drafts) does it inside `lookahead()`, which advances over drafts and rolls all of it
back on exit: no caller can leave the matcher unbalanced. sample/structured.py compiles grammars
and makes these.
"""
from __future__ import annotations

import time

import numpy as np
import torch


class GrammarState:
    """One request's grammar state: the only owner of its llguidance matcher.

    The matcher follows the request's emitted tokens (`commit`). Whoever forms a distribution over a
    position past them (verification rows, a draft model's rows, grammar-forced drafts) does it
    inside `lookahead()`, which advances over drafts and rolls all of it back on exit, so no caller
    can leave the state unbalanced."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self._m = matcher
        self.vocab_size = vocab_size
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        self.committed_tokens: list[int] = []   # what the matcher has consumed outside lookaheads
        self.depth = 0            # open lookaheads
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

    def forced(self, limit: int) -> list[int]:
        """The tokens the grammar allows as the only (canonical) continuation from here, at most
        `limit`: proposed as drafts for free."""
        return list(self._m.compute_ff_tokens()[:limit]) if limit > 0 and not self._m.is_stopped() else []

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
        return self._m.is_accepting()

    def _consume(self, tokens: list[int]) -> int:
        """Advance over the longest accepted prefix of `tokens`; returns its length (a forbidden token
        would put the matcher into a permanent error state, so it is never fed)."""
        n = self.valid_prefix(tokens)
        if n and not self._m.consume_tokens(list(tokens[:n])):
            raise RuntimeError(f"grammar matcher failed: {self._m.get_error()}")
        return n

    def _rollback(self, num_tokens: int) -> None:
        if num_tokens and not self._m.rollback(num_tokens):
            raise RuntimeError(f"grammar matcher could not roll back {num_tokens} token(s): {self._m.get_error()}")


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
