"""SamplingParams validation and the logits processors, on designed logits."""
from __future__ import annotations

import math

import pytest
import torch

from specdec.sample.logits_processors import process_logits
from specdec.sample.rejection_sampler import rejection_sample
from specdec.sample.sampler import make_generator, top_logprobs
from specdec.sampling_params import SamplingParams


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"min_p": 1.2}, "min_p"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": 3.0}, "presence_penalty"), ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"max_tokens": 0}, "max_tokens"), ({"seed": -1}, "seed"), ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-3]}, "stop_token_ids"), ({"logprobs": 21}, "logprobs"),
    ({"max_tokens": 2.5}, "max_tokens"), ({"temperature": "hot"}, "temperature"),
])
def test_invalid_params_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_valid_params_normalize():
    p = SamplingParams(stop="###", top_k=-1)
    assert p.stop == ["###"] and p.top_k == 0 and p.greedy


def test_top_k_keeps_k_best():
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0])
    out = _filters(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.isfinite(out).tolist() == [False, True, False, True, False]


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()

    def keep(p):
        return torch.isfinite(_filters(logits, SamplingParams(temperature=1.0, top_p=p))).tolist()

    assert keep(0.5) == [True, False, False, False]
    assert keep(0.6) == [True, True, False, False]
    assert keep(0.81) == [True, True, True, False]
    assert keep(1.0) == [True] * 4


def test_min_p_relative_to_top():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    out = _filters(logits, SamplingParams(temperature=1.0, min_p=0.35))
    assert torch.isfinite(out).tolist() == [True, True, False, False]  # threshold 0.175


def test_penalties():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    p = SamplingParams(repetition_penalty=2.0)
    out = process_logits(logits, p, prompt_ids=[0], output_ids=[1])
    assert out.tolist() == [1.0, -4.0, 1.0, 0.5]
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = process_logits(logits, p, prompt_ids=[3], output_ids=[2, 2, 0])
    assert out.tolist() == pytest.approx([2.0 - 0.75, -2.0, 1.0 - 1.0, 0.5])  # prompt not counted


def _filters(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature 1 and the filters alone (no penalties set)."""
    return process_logits(logits, params, prompt_ids=[], output_ids=[])


def sample_token(processed: torch.Tensor, p: SamplingParams, g: torch.Generator) -> int:
    """Plain decoding is rejection sampling with no drafts."""
    vocab = processed.shape[-1]
    u = torch.zeros(1) if p.greedy else torch.rand(1, generator=g)
    tokens, _ = rejection_sample(torch.zeros(0, dtype=torch.long), torch.zeros(1, dtype=torch.long), None,
                                 processed.view(1, vocab), torch.tensor([p.greedy]), torch.zeros(0), u)
    return tokens[0][0]


def test_greedy_ignores_temperature_filters_but_not_penalties():
    logits = torch.tensor([1.0, 3.0, 2.9])
    p = SamplingParams(repetition_penalty=1.5)
    processed = process_logits(logits, p, prompt_ids=[1], output_ids=[])
    assert sample_token(processed, p, make_generator(0)) == 2


def test_sampling_follows_distribution_and_seed():
    probs = torch.tensor([0.1, 0.6, 0.3])
    p = SamplingParams(temperature=1.0)
    g = make_generator(123)
    draws = [sample_token(probs.log(), p, g) for _ in range(4000)]
    freq = torch.bincount(torch.tensor(draws), minlength=3).float() / len(draws)
    assert torch.allclose(freq, probs, atol=0.03)
    a = [sample_token(probs.log(), p, make_generator(5)) for _ in range(5)]
    assert len(set(a)) == 1


def test_top_logprobs():
    logits = torch.tensor([0.0, 1.0, 2.0])
    lp = top_logprobs(logits, 0, 2)
    ref = torch.log_softmax(logits, -1)
    assert set(lp) == {0, 1, 2} and lp[2] == pytest.approx(float(ref[2]))
