"""Logits processors: logit bias, penalties, temperature, top-k, top-p, min-p, over a batch of rows.

Applied with each row's own parameters, in the order logit bias -> penalties -> temperature ->
top-k -> top-p -> min-p (bias first, as vLLM: it is part of the request's distribution). A request
owns consecutive rows (its verification positions); row j counts the drafts before it as output for
the penalties. Penalties are scattered per request over its rows; temperature and the filters run
over the whole batch at once, one partial sort per row. The draft model applies the same function
to its rows, so both sides sample from the same processed distribution.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.sampling_params import SamplingParams

_TOP_P_CANDIDATES = 4096   # top-p looks at the largest logits first; a full sort only if they miss top_p


@dataclass
class RowGroup:
    """One request's consecutive rows: row j follows output_ids + drafts[:j]."""
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    drafts: list[int] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return len(self.drafts) + 1


def process_rows(logits: torch.Tensor, groups: list[RowGroup], in_place: bool = False) -> torch.Tensor:
    """Raw float32 logits [sum(num_rows), vocab] -> processed logits for sampling (a copy unless
    `in_place`). Greedy rows get the bias and penalties only: temperature and filters cannot change
    the argmax."""
    if all(g.params.greedy and not g.params.logit_bias and not g.params.needs_penalties for g in groups):
        return logits if in_place else logits.clone()   # nothing to change: spare the per-row bookkeeping
    out = logits if in_place else logits.clone()
    start = 0
    for g in groups:
        if g.params.logit_bias:
            _add_bias(out[start:start + g.num_rows], g.params.logit_bias)
        if g.params.needs_penalties:
            out[start:start + g.num_rows] = _penalize(out[start:start + g.num_rows], g)
        start += g.num_rows
    params = [g.params for g in groups for _ in range(g.num_rows)]
    sampled = torch.tensor([not p.greedy for p in params], dtype=torch.bool)
    if bool(sampled.all()):   # no gather and scatter back
        return _filter(out.div_(torch.tensor([p.temperature for p in params])[:, None]), params)
    if bool(sampled.any()):
        idx = sampled.nonzero()[:, 0]
        temps = torch.tensor([p.temperature for p in params])[idx, None]
        out[idx] = _filter(out[idx] / temps, [params[i] for i in idx.tolist()])
    return out


def process_logits(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                   output_ids: list[int]) -> torch.Tensor:
    """One row [vocab] -> processed logits (a copy)."""
    return process_rows(logits[None], [RowGroup(params, prompt_ids, output_ids)])[0]


def _add_bias(rows: torch.Tensor, bias: dict[int, float]) -> None:
    """rows [n, width] += bias, in place; ids past the width are skipped (a draft's smaller
    vocabulary has no such token to bias)."""
    width = rows.shape[-1]
    kept = [(t, b) for t, b in bias.items() if t < width]
    if kept:
        ids = torch.tensor([t for t, _ in kept], dtype=torch.long, device=rows.device)
        rows[:, ids] += torch.tensor([b for _, b in kept], dtype=rows.dtype, device=rows.device)


def _penalize(rows: torch.Tensor, g: RowGroup) -> torch.Tensor:
    """Repetition penalty over prompt + output (divide positive logits, multiply negative ones);
    presence and frequency penalties over the output only (OpenAI semantics)."""
    p, (n, vocab) = g.params, rows.shape
    # row j has seen drafts[:j]: the pairs (j, i) with i < j
    later, earlier = torch.tril_indices(n, max(n - 1, 0), offset=-1)
    draft_ids = torch.tensor(g.drafts, dtype=torch.long)[earlier]
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor(g.prompt_ids + g.output_ids, dtype=torch.long)] = True
        seen = seen.repeat(n, 1)
        seen[later, draft_ids] = True
        rows = torch.where(seen, torch.where(rows > 0, rows / p.repetition_penalty, rows * p.repetition_penalty),
                           rows)
    if p.presence_penalty or p.frequency_penalty:
        counts = torch.bincount(torch.tensor(g.output_ids, dtype=torch.long), minlength=vocab)[:vocab]
        counts = counts.to(rows.dtype).repeat(n, 1)
        counts.index_put_((later, draft_ids), torch.ones(len(later), dtype=rows.dtype), accumulate=True)
        rows = rows - (p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(rows.dtype))
    return rows


def _filter(rows: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """rows [m, vocab] (owned: changed in place) already divided by the temperature; filtered entries
    become -inf."""
    vocab = rows.shape[-1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else 0 for p in params])
    if bool((top_k > 0).any()):
        values = rows.topk(int(top_k.max()), dim=-1).values
        kth = values.gather(-1, (top_k.clamp(min=1) - 1)[:, None])
        rows.masked_fill_((top_k[:, None] > 0) & (rows < kth), float("-inf"))
    top_p = torch.tensor([p.top_p for p in params])
    if bool((top_p < 1.0).any()):
        rows = _top_p(rows, top_p)
    min_p = torch.tensor([p.min_p for p in params])
    if bool((min_p > 0).any()):
        probs = rows.softmax(-1)
        rows.masked_fill_(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, float("-inf"))
    return rows


def _top_p(rows: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set reaching top_p: drop a token once the mass before it already does.
    Only the largest candidates are sorted: when they hold top_p, everything after them is dropped
    anyway; rows where they fall short get a full sort."""
    m = min(rows.shape[-1], _TOP_P_CANDIDATES)
    values, order = rows.topk(m, dim=-1)
    lse = torch.logsumexp(rows, -1, keepdim=True)
    probs = values.softmax(-1) if m == rows.shape[-1] else torch.exp(values - lse)
    keep = _top_p_keep(probs, order, top_p, rows.shape[-1])
    short = probs.sum(-1) < top_p
    if bool(short.any()) and m < rows.shape[-1]:
        values_all, order_all = rows[short].sort(-1, descending=True)
        keep[short] = _top_p_keep(torch.exp(values_all - lse[short]), order_all, top_p[short], rows.shape[-1])
    return rows.masked_fill_(~keep, float("-inf"))


def _top_p_keep(sorted_probs: torch.Tensor, order: torch.Tensor, top_p: torch.Tensor, vocab: int) -> torch.Tensor:
    kept = (sorted_probs.cumsum(-1) - sorted_probs) < top_p[:, None]
    return torch.zeros(sorted_probs.shape[0], vocab, dtype=torch.bool).scatter_(-1, order, kept)
