"""NgramProposer (prompt lookup decoding): propose what followed the latest earlier occurrence of
the request's last n tokens, trying n from ngram.max_n down to ngram.min_n. No model, no state; drafts
are one-hot, which rejection sampling handles exactly."""
from __future__ import annotations

import time

from specdec.request import Request
from specdec.speculation.proposers.base import BuildContext, DraftProposal, Drafts


def ngram_lookup(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """The k tokens that followed the most recent earlier match of tokens' last n tokens."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n:]
        first = suffix[0]
        # scan backwards: the most recent match predicts best
        for start in range(length - n - 1, -1, -1):
            if tokens[start] == first and tokens[start:start + n] == suffix:
                follow = tokens[start + n:start + n + k]
                if follow:
                    return follow
    return []


def build(ctx: BuildContext) -> NgramProposer:
    spec = ctx.config.speculative
    assert spec is not None
    return NgramProposer(spec.ngram.max_n, spec.ngram.min_n)


class NgramProposer:
    kind = "ngram"

    def __init__(self, n_max: int = 4, n_min: int = 1) -> None:
        self.n_max, self.n_min = n_max, n_min
        self.name = f"ngram[{n_min}-{n_max}]"

    def propose(self, requests: list[Request], num_tokens: list[int], model_k: list[int]) -> Drafts:
        t0 = time.perf_counter()
        out = [DraftProposal(ngram_lookup(r.all_token_ids, k, self.n_max, self.n_min) if k else [])
               for r, k in zip(requests, num_tokens)]
        return Drafts(out, time.perf_counter() - t0)  # no model: no forwards to report

    def catch_up_tokens(self, request: Request) -> int:
        return 0

    def on_verified(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        pass

    def free(self, request_id: str) -> None:
        pass
