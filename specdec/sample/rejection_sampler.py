"""Exact speculative sampling as one pure tensor function over flattened rows.

Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding") and Chen et al.
2023 ("Accelerating LLM Decoding with Speculative Sampling"): for draft token x_i proposed from q_i,

  * accepted:  x_i is kept with probability min(1, p_i(x_i) / q_i(x_i)), while all before it were kept;
  * recovered: at the first rejection, one token is drawn from norm(max(0, p_i - q_i)) and the round ends;
  * bonus:     when all k drafts are kept, one more token is drawn from p_{k+1}.

The output is distributed exactly as k + 1 sequential draws from the target, for any q. Greedy rows
keep drafts while they equal the target's argmax, then emit the argmax.

Rows are flat, as the target returns them: request r owns num_drafts[r] + 1 consecutive target rows
(one per draft, then the bonus position) and num_drafts[r] consecutive draft entries. Randomness
comes in as tensors (callers control generators; tests vectorize a million rows): one uniform per
draft for its acceptance test and one per request for its final token, drawn by inverting the
cumulative distribution (in float64, so a token of probability 0 is never hit). Only the one final
row per request is ever turned into a full distribution: no [rows, vocab] residual or noise.
"""
from __future__ import annotations

import torch

from specdec.sample.sampler import first_argmax


def rejection_sample(
    draft_token_ids: torch.Tensor,     # [num_drafts_total] int64
    num_drafts: torch.Tensor,          # [num_reqs] int64
    draft_probs: torch.Tensor | None,  # [num_drafts_total, vocab] the distributions drafts came from; None: one-hot
    target_logits: torch.Tensor,       # [num_drafts_total + num_reqs, vocab] processed (penalties, temperature, filters)
    is_greedy: torch.Tensor,           # [num_reqs] bool
    uniforms: torch.Tensor,            # [num_drafts_total] in [0, 1)
    final_uniforms: torch.Tensor,      # [num_reqs] in [0, 1)
) -> tuple[list[list[int]], torch.Tensor]:
    """Returns (each request's emitted tokens: its accepted drafts then one recovered or bonus
    token, num_accepted [num_reqs])."""
    num_reqs = num_drafts.shape[0]
    req_of_draft = torch.repeat_interleave(torch.arange(num_reqs), num_drafts)      # [T]
    first_draft = torch.cumsum(num_drafts, 0) - num_drafts                         # [n]
    first_row = first_draft + torch.arange(num_reqs)                                # [n]
    position = torch.arange(len(req_of_draft)) - first_draft[req_of_draft]          # [T]: j within its request
    accept = _accepted(draft_token_ids, first_row[req_of_draft] + position, draft_probs, target_logits,
                       is_greedy[req_of_draft], uniforms)
    num_accepted = _leading_true(accept, req_of_draft, position, num_drafts)
    final_rows = first_row + num_accepted
    final = _final_tokens(target_logits[final_rows], num_accepted < num_drafts, first_draft + num_accepted,
                          draft_token_ids, draft_probs, is_greedy, final_uniforms)
    drafts, finals, counts = draft_token_ids.tolist(), final.tolist(), num_accepted.tolist()
    starts = first_draft.tolist()
    tokens = [drafts[s:s + a] + [f] for s, a, f in zip(starts, counts, finals)]
    return tokens, num_accepted


def _accepted(drafts: torch.Tensor, rows: torch.Tensor, draft_probs: torch.Tensor | None, logits: torch.Tensor,
              greedy: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[T] bool: each draft passes its own test (greedy: it is the argmax; sampled: u * q < p)."""
    if drafts.numel() == 0:
        return torch.zeros(0, dtype=torch.bool)
    accept = torch.zeros(len(drafts), dtype=torch.bool)
    if bool(greedy.any()):   # the first argmax, as plain greedy decoding takes
        accept[greedy] = drafts[greedy] == first_argmax(logits[rows[greedy]])
    sampled = ~greedy
    if bool(sampled.any()):
        row_logits, x = logits[rows[sampled]], drafts[sampled]
        p = torch.exp(row_logits.gather(-1, x[:, None])[:, 0] - torch.logsumexp(row_logits, -1))
        q = torch.ones_like(p) if draft_probs is None else draft_probs[sampled].gather(-1, x[:, None])[:, 0]
        accept[sampled] = uniforms[sampled] * q < p
    return accept


def _leading_true(accept: torch.Tensor, req_of_draft: torch.Tensor, position: torch.Tensor,
                  num_drafts: torch.Tensor) -> torch.Tensor:
    """[n]: per request, how many of its drafts are accepted before the first rejection."""
    num_reqs = num_drafts.shape[0]
    max_k = int(num_drafts.max()) if num_reqs else 0
    if max_k == 0:
        return torch.zeros(num_reqs, dtype=torch.long)
    padded = torch.zeros(num_reqs, max_k, dtype=torch.long)
    padded[req_of_draft, position] = accept.long()
    return padded.cumprod(-1).sum(-1)


def _final_tokens(rows: torch.Tensor, rejected: torch.Tensor, rejected_draft: torch.Tensor, drafts: torch.Tensor,
                  draft_probs: torch.Tensor | None, is_greedy: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[n]: the token after the accepted drafts. Sampled rows draw from the residual max(0, p - q) at
    a rejected draft, from p after the last one."""
    final = first_argmax(rows)
    sampled = ~is_greedy
    if not bool(sampled.any()):
        return final
    p = torch.softmax(rows[sampled], -1)
    which = rejected[sampled]
    if bool(which.any()):
        at = rejected_draft[sampled][which]
        if draft_probs is None:
            q = torch.zeros_like(p[which]).scatter_(-1, drafts[at][:, None], 1.0)
        else:
            q = draft_probs[at]
        residual = (p[which] - q).clamp(min=0)
        empty = residual.sum(-1, keepdim=True) <= 0    # p == q: never rejected, but be safe
        p[which] = torch.where(empty, p[which], residual)
    # the first token whose cumulative mass passes u * total: a token of probability 0 adds nothing,
    # so it is never the first to pass
    cdf = p.double().cumsum(-1)
    threshold = u[sampled].double() * cdf[:, -1]
    final[sampled] = torch.searchsorted(cdf, threshold[:, None], right=True)[:, 0].clamp(max=p.shape[-1] - 1)
    return final
