"""Deliberately broken rejection samplers, injected by tests to show a statistical check has power.
Each wraps the real one (sample/rejection_sampler.py) and has its signature."""
from __future__ import annotations

import torch

from specdec.sample.rejection_sampler import rejection_sample


def always_accept(draft_ids, num_drafts, draft_probs, logits, greedy, uniforms, final_uniforms):
    """Every draft of nonzero target probability is kept (u = 0)."""
    return rejection_sample(draft_ids, num_drafts, draft_probs, logits, greedy, torch.zeros_like(uniforms),
                            final_uniforms)


def resample_from_p(draft_ids, num_drafts, draft_probs, logits, greedy, uniforms, final_uniforms):
    """After a rejection the token is drawn from p, not from the residual max(0, p - q)."""
    tokens, num_accepted = rejection_sample(draft_ids, num_drafts, draft_probs, logits, greedy, uniforms,
                                            final_uniforms)
    first_row = torch.cumsum(num_drafts + 1, 0) - (num_drafts + 1)
    cdf = torch.softmax(logits[first_row + num_accepted], -1).double().cumsum(-1)
    redrawn = torch.searchsorted(cdf, (final_uniforms.double() * cdf[:, -1])[:, None], right=True)[:, 0].tolist()
    for r in range(len(tokens)):
        if num_accepted[r] < num_drafts[r] and not greedy[r]:
            tokens[r][-1] = redrawn[r]
    return tokens, num_accepted
