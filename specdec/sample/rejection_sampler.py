"""Exact speculative sampling as one pure tensor function.

Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding") and Chen et al.
2023 ("Accelerating LLM Decoding with Speculative Sampling"): for draft token x_i proposed from q_i,

  * accepted:  x_i is kept with probability min(1, p_i(x_i) / q_i(x_i)), while all before it were kept;
  * recovered: at the first rejection, one token is drawn from norm(max(0, p_i - q_i)) and the round ends;
  * bonus:     when all k drafts are kept, one more token is drawn from p_{k+1}.

The output is distributed exactly as k + 1 sequential draws from the target, for any q. Greedy rows
keep drafts while they equal the target's argmax, then emit the argmax. Randomness comes in as
tensors (so callers control generators and tests can vectorize a million rows); draws from a
distribution use the exponential race argmax(p / E), E ~ Exp(1), which samples exactly p.
"""
from __future__ import annotations

import torch

_BROKEN_MODES = (None, "always_accept", "resample_from_p")  # the last two exist for tests only


def rejection_sample(
    draft_token_ids: torch.Tensor,   # [num_reqs, max_k] int64; entries past a row's num_draft are ignored
    num_draft: torch.Tensor,         # [num_reqs] int64, 0 <= num_draft <= max_k
    draft_probs: torch.Tensor | None,  # [num_reqs, max_k, vocab]; None: one-hot drafts (n-gram)
    target_logits: torch.Tensor,     # [num_reqs, max_k + 1, vocab] processed (penalties, temperature, filters)
    is_greedy: torch.Tensor,         # [num_reqs] bool
    uniforms: torch.Tensor,          # [num_reqs, max_k] in [0, 1)
    exp_noise: torch.Tensor,         # [num_reqs, max_k + 1, vocab] Exp(1) draws
    *,
    _test_mode: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (output_token_ids [num_reqs, max_k + 1] padded with -1, num_accepted [num_reqs]).
    Row r emits num_accepted[r] drafts followed by one recovered or bonus token."""
    assert _test_mode in _BROKEN_MODES
    num_reqs, max_k = draft_token_ids.shape
    positions = torch.arange(max_k, device=draft_token_ids.device)
    valid = positions[None, :] < num_draft[:, None]                        # [num_reqs, max_k]
    drafts = draft_token_ids.clamp(min=0)

    target_probs = torch.softmax(target_logits, dim=-1)                    # [num_reqs, max_k + 1, vocab]
    p_draft = target_probs[:, :max_k].gather(-1, drafts[..., None])[..., 0]  # [num_reqs, max_k]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(-1, drafts[..., None])[..., 0]
    accept_random = uniforms * q_draft < p_draft
    if _test_mode == "always_accept":
        accept_random = torch.ones_like(accept_random)
    target_argmax = target_logits.argmax(dim=-1)                           # [num_reqs, max_k + 1]
    accept_greedy = drafts == target_argmax[:, :max_k]
    accept = torch.where(is_greedy[:, None], accept_greedy, accept_random) & valid
    num_accepted = accept.long().cumprod(dim=-1).sum(dim=-1)               # [num_reqs]

    # the distribution of the final token: residual at a rejected position, p after the last draft
    if draft_probs is None:
        q_full = torch.zeros_like(target_probs[:, :max_k]).scatter_(-1, drafts[..., None], 1.0)
    else:
        q_full = draft_probs
    residual = (target_probs[:, :max_k] - q_full).clamp(min=0)            # [num_reqs, max_k, vocab]
    if _test_mode == "resample_from_p":
        residual = target_probs[:, :max_k]
    empty = residual.sum(-1, keepdim=True) <= 0                            # p == q: never rejected, but be safe
    residual = torch.where(empty, target_probs[:, :max_k], residual)
    final_dist = torch.cat([residual, target_probs[:, max_k:]], dim=1)     # [num_reqs, max_k + 1, vocab]
    idx = num_accepted[:, None, None].expand(-1, 1, final_dist.shape[-1])
    dist = final_dist.gather(1, idx)[:, 0]                                  # [num_reqs, vocab]
    # for a row stopping at position j < num_draft the residual applies; at num_draft (all accepted
    # or k = 0) the row's own next-position probabilities apply
    all_kept = num_accepted == num_draft
    p_next = target_probs.gather(1, num_draft[:, None, None].expand(-1, 1, target_probs.shape[-1]))[:, 0]
    dist = torch.where(all_kept[:, None], p_next, dist)
    noise = exp_noise.gather(1, num_accepted[:, None, None].expand(-1, 1, exp_noise.shape[-1]))[:, 0]
    # a token of probability 0 never wins, even against an Exp(1) draw of exactly 0 (float32
    # generators produce them now and then): 0 / 0 would be NaN, and argmax picks NaN
    sampled = torch.where(dist > 0, dist / noise, 0.0).argmax(dim=-1)
    greedy_final = target_argmax.gather(1, num_accepted[:, None])[:, 0]
    final = torch.where(is_greedy, greedy_final, sampled)

    out = torch.full((num_reqs, max_k + 1), -1, dtype=torch.long, device=draft_token_ids.device)
    keep = positions[None, :] < num_accepted[:, None]
    out[:, :max_k] = torch.where(keep, drafts, out[:, :max_k])
    out.scatter_(1, num_accepted[:, None], final[:, None])
    return out, num_accepted
