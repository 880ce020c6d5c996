"""Verifier: a step's target logits and drafts -> each request's emitted tokens.

It takes the schedule (which drafts each request verifies: `ScheduledChunk.draft_token_ids`), the
target's logits (flat rows, `cu_num_logits`) and the step's DraftBatch (the distributions the drafts
came from), masks rows with each request's grammar, processes all rows at once (penalties,
temperature, filters), and runs the rejection sampler over the flat rows. Plain decoding is the
same call with no drafts.

A sampled request is verified one of two ways. Coupled (its `noise_key` set, sample/noise.py): its
rows get the Gumbel noise of their output positions and are then verified as greedy rows, so the
target's token is the Gumbel-max sample and a draft is kept exactly when it equals it; given `picks`
(the CPU kernels'), a coupled request with no grammar, bias or penalties skips the torch processing:
its rows' filters and Gumbel-max are one native call. Otherwise its uniforms come from its own
generator, for rejection sampling.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.core.outputs import DraftBatch, ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from specdec.request import Request
from specdec.sample.logits_processors import RowGroup, process_rows
from specdec.sample.noise import add_gumbel_
from specdec.sample.rejection_sampler import rejection_sample
from specdec.sample.sampler import first_argmax, make_generator

Sampler = Callable[..., tuple[list[list[int]], torch.Tensor]]
Noise = Callable[[torch.Tensor, int, int], torch.Tensor]   # (row, key, position) -> the row with its noise, in place
# (raw rows [n, vocab], each row's (temperature, top_p, min_p, top_k, noise key, output position)) -> the
# rows' coupled picks: processing and Gumbel-max in one native call (quant/kernel.coupled_picks)
Picks = Callable[[torch.Tensor, list[tuple[float, float, float, int, int, int]]], list[int]]


@dataclass
class Verified:
    """One request's outcome: accepted drafts, then one recovered or bonus token."""
    token_ids: list[int]
    num_accepted: int


class Verifier:
    def __init__(self, sampler: Sampler = rejection_sample, noise: Noise = add_gumbel_,
                 picks: Picks | None = None) -> None:
        """`sampler`, `noise`: the rejection sampler and the coupling's noise (tests inject broken ones
        to show a check has power). `picks`: coupled rows picked natively where a request has no
        grammar, bias or penalties (its rows then never go through the torch processing)."""
        self.sampler, self.noise, self.picks = sampler, noise, picks
        self._generators: dict[str, torch.Generator] = {}

    def add(self, request_id: str, seed: int | None) -> None:
        self._generators[request_id] = make_generator(seed)

    def free(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    @torch.inference_mode()   # the runner's logits are inference tensors, processed in place
    def verify(self, sched: SchedulerOutput, out: ModelRunnerOutput, drafts: DraftBatch | None,
               requests: dict[str, Request]) -> dict[str, Verified]:
        """Every chunk that asked for logits -> its request's tokens. `out.logits` is consumed: it may
        be processed in place when no request reads its raw rows afterwards (logprobs)."""
        scored = [(i, c) for i, c in enumerate(sched.chunks) if c.num_logits]
        if not scored:
            return {}
        reqs = [requests[c.request_id] for _, c in scored]
        native = self._native_picks(out, scored, reqs)
        if all(n in native or _plain_greedy(r) for n, r in enumerate(reqs)):
            return _greedy([c for _, c in scored], self._picks(out, scored, native))
        rows = [self._rows(out, i, c, r) for (i, c), r in zip(scored, reqs)]
        groups = [RowGroup(r.params, r.prompt_token_ids, r.output_token_ids, c.draft_token_ids)
                  for (_, c), r in zip(scored, reqs)]
        # the raw rows are processed in place unless a request still needs them (logprobs) or a grammar
        # mask already copied them
        keep_raw = any(r.params.logprobs is not None or r.grammar is not None for r in reqs)
        logits = process_rows(torch.cat(rows) if keep_raw else out.logits, groups, in_place=True)
        self._couple(logits, [c for _, c in scored], reqs, native)
        as_greedy = [r.params.greedy or r.noise_key is not None for r in reqs]
        if all(as_greedy):   # greedy or coupled: the argmax is all the sampler would compute
            return _greedy([c for _, c in scored], first_argmax(logits).tolist())
        draft_ids = torch.tensor([t for _, c in scored for t in c.draft_token_ids], dtype=torch.long)
        num_drafts = torch.tensor([c.num_drafts for _, c in scored], dtype=torch.long)
        greedy = torch.tensor(as_greedy, dtype=torch.bool)
        uniforms, final_uniforms = self._randomness(reqs, [c.num_drafts for _, c in scored], as_greedy)
        probs = _draft_probs([c for _, c in scored], drafts, logits.shape[-1])
        tokens, num_accepted = self.sampler(draft_ids, num_drafts, probs, logits, greedy, uniforms, final_uniforms)
        return {c.request_id: Verified(t, int(a)) for (_, c), t, a in zip(scored, tokens, num_accepted)}

    @staticmethod
    def _rows(out: ModelRunnerOutput, i: int, chunk: ScheduledChunk, req: Request) -> torch.Tensor:
        """The chunk's raw rows, masked by its grammar (row j: the state after the drafts before it)."""
        rows = _raw(out, i)
        if req.grammar is None:
            return rows
        return req.grammar.mask_rows(rows, chunk.draft_token_ids)

    def _native_picks(self, out: ModelRunnerOutput, scored: list[tuple[int, ScheduledChunk]],
                      reqs: list[Request]) -> dict[int, list[int]]:
        """Position in `scored` -> its rows' coupled picks, for the coupled requests `picks` takes (a
        request's own properties decide, never the batch's: its tokens do not depend on what shares
        the step)."""
        if self.picks is None or out.logits.device.type != "cpu" or out.logits.dtype != torch.float32:
            return {}
        taken = [n for n, r in enumerate(reqs) if _natively_coupled(r)]
        if not taken:
            return {}
        rows = torch.cat([_raw(out, scored[n][0]) for n in taken])
        p = [(reqs[n].params.temperature, reqs[n].params.top_p, reqs[n].params.min_p, reqs[n].params.top_k,
              reqs[n].noise_key, len(reqs[n].output_token_ids) + j)
             for n in taken for j in range(scored[n][1].num_logits)]
        return _by_chunk(self.picks(rows.contiguous(), p), taken, scored)

    @staticmethod
    def _picks(out: ModelRunnerOutput, scored: list[tuple[int, ScheduledChunk]],
               native: dict[int, list[int]]) -> list[int]:
        """Every scored row's token: the native picks, else the raw row's first maximum (greedy)."""
        greedy = [n for n in range(len(scored)) if n not in native]
        best = dict(native)
        if greedy:
            flat = first_argmax(torch.cat([_raw(out, scored[n][0]) for n in greedy])).tolist()
            best |= _by_chunk(flat, greedy, scored)
        return [t for n in range(len(scored)) for t in best[n]]

    def _couple(self, logits: torch.Tensor, chunks: list[ScheduledChunk], reqs: list[Request],
                native: dict[int, list[int]]) -> None:
        """Coupled requests' processed rows in their Gumbel-max form (`noise.add_gumbel_`: the noise of
        their output positions added where it can win; row j of a request is the token after its
        output and drafts[:j]), in place; a natively picked row becomes its pick alone."""
        start = 0
        for n, (c, req) in enumerate(zip(chunks, reqs)):
            if n in native:
                logits[start:start + c.num_logits] = float("-inf")
                logits[torch.arange(start, start + c.num_logits), torch.tensor(native[n])] = 0.0
            elif req.noise_key is not None and not req.params.greedy:
                for j in range(c.num_logits):
                    row = logits[start + j]
                    host = row.cpu()  # the row itself on a CPU
                    self.noise(host, req.noise_key, len(req.output_token_ids) + j)
                    if host is not row:
                        row.copy_(host)
            start += c.num_logits

    def _randomness(self, reqs: list[Request], num_drafts: list[int], as_greedy: list[bool]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A uniform per draft and one for each request's final token, from the request's own
        generator in a fixed order (so a seed fixes its draws whatever else is in the batch); greedy
        and coupled requests draw nothing."""
        uniforms, finals = torch.zeros(sum(num_drafts)), torch.zeros(len(reqs))
        start = 0
        for r, (req, k, greedy) in enumerate(zip(reqs, num_drafts, as_greedy)):
            if not greedy:
                draws = torch.rand(k + 1, generator=self._generators[req.request_id])
                uniforms[start:start + k], finals[r] = draws[:k], draws[k]
            start += k
        return uniforms, finals


def _raw(out: ModelRunnerOutput, i: int) -> torch.Tensor:
    """Chunk i's raw rows of the runner's logits."""
    return out.logits[out.cu_num_logits[i]:out.cu_num_logits[i + 1]]


def _by_chunk(flat: list[int], which: list[int], scored: list[tuple[int, ScheduledChunk]]) -> dict[int, list[int]]:
    """Per-row values of the chunks scored[n] for n in `which`, laid end to end -> n: its rows' values."""
    out, start = {}, 0
    for n in which:
        k = scored[n][1].num_logits
        out[n], start = flat[start:start + k], start + k
    return out


def _unmasked(req: Request) -> bool:
    """No grammar, logit bias or penalties: temperature and filters are all that touch its rows."""
    p = req.params
    return req.grammar is None and not p.logit_bias and not p.needs_penalties


def _plain_greedy(req: Request) -> bool:
    """A greedy request whose rows' first maximum is its token (nothing processes them)."""
    return req.params.greedy and _unmasked(req)


def _natively_coupled(req: Request) -> bool:
    """A coupled request whose rows need only temperature and filters before their Gumbel-max."""
    return req.noise_key is not None and not req.params.greedy and _unmasked(req)


def _greedy(chunks: list[ScheduledChunk], best: list[int]) -> dict[str, Verified]:
    """Each chunk keeps its drafts while they equal the argmax of their row, then emits the argmax of
    the first row that differs (or of the row after its last draft)."""
    out, start = {}, 0
    for c in chunks:
        rows = best[start:start + c.num_logits]
        n = 0
        while n < c.num_drafts and c.draft_token_ids[n] == rows[n]:
            n += 1
        out[c.request_id] = Verified(rows[: n + 1], n)
        start += c.num_logits
    return out


def _draft_probs(chunks: list[ScheduledChunk], drafts: DraftBatch | None, vocab: int) -> torch.Tensor | None:
    """[num drafts, vocab]: each kept draft's distribution (one-hot for grammar-forced drafts and
    lookups); None when every draft is one-hot."""
    given = [drafts.by_request[c.request_id] if drafts is not None and c.num_drafts else None for c in chunks]
    if all(d is None or d.probs is None for d in given):
        return None
    probs = torch.zeros(sum(c.num_drafts for c in chunks), vocab)
    start = 0
    for c, d in zip(chunks, given):
        k = c.num_drafts
        if not k:
            continue
        one_hot = k if d.probs is None else min(d.num_forced, k)
        probs[torch.arange(start, start + one_hot), torch.tensor(c.draft_token_ids[:one_hot], dtype=torch.long)] = 1.0
        if one_hot < k:
            width = min(d.probs.shape[-1], vocab)
            probs[start + one_hot:start + k, :width] = d.probs[: k - one_hot, :width]
        start += k
    return probs
