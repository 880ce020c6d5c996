"""The proposer registry is the one place a proposer kind is declared: a toy proposer defined here,
registered here and nowhere else, serves requests (configured, or chosen per request), drafts,
and leaves the output the target's."""
from __future__ import annotations

import pytest

from conftest import engine_config
from specdec.config import SpeculativeConfig
from specdec.llm import LLM
from specdec.request import SpecOptions
from specdec.sampling_params import SamplingParams
from specdec.speculation import registry
from specdec.speculation.proposers.base import DraftProposal, Drafts

PROMPT = "one two three one two three one two three one two"


class RepeatLast:
    """Proposes the request's last token k times: often wrong, always exactly verified."""
    kind = "repeat_last"

    def __init__(self) -> None:
        self.name = "repeat-last"
        self.verified: list[tuple[int, int]] = []

    def propose(self, requests, num_tokens, model_k) -> Drafts:
        return Drafts([DraftProposal([r.all_token_ids[-1]] * k) for r, k in zip(requests, num_tokens)])

    def catch_up_tokens(self, request) -> int:
        return 0

    def on_verified(self, request, num_drafted, num_accepted) -> None:
        self.verified.append((num_drafted, num_accepted))

    def free(self, request_id) -> None:
        pass


@pytest.fixture
def toy_kind():
    registry.register(registry.ProposerKind("repeat_last", lambda ctx: RepeatLast(), "repeats the last token",
                                            needs_model=False, cost_hint=0.01))
    yield "repeat_last"
    registry.unregister("repeat_last")


def _fixed(method: str) -> SpeculativeConfig:
    return SpeculativeConfig(method=method, num_speculative_tokens=3, policy="fixed")


def test_a_registered_toy_proposer_serves_requests(tiny_qwen, toy_kind):
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = LLM(config=engine_config(str(tiny_qwen)), progress=False).generate(PROMPT, params)[0]
    cfg = engine_config(str(tiny_qwen))
    cfg.speculative = _fixed(toy_kind)
    llm = LLM(config=cfg, progress=False)
    out = llm.generate(PROMPT, params)[0]
    assert out.token_ids == plain.token_ids
    assert out.stats.method == toy_kind and out.stats.proposer == "repeat-last"
    assert out.stats.drafted_tokens > 0
    toy = llm.engine.speculator.proposers[toy_kind]
    assert toy.verified and all(0 <= a <= d for d, a in toy.verified)
    assert any(p.kind == toy_kind for p in llm.engine.stats().speculation.proposers)


def test_a_request_can_choose_the_toy_proposer(tiny_qwen, toy_kind):
    cfg = engine_config(str(tiny_qwen))
    cfg.speculative = _fixed("ngram")
    llm = LLM(config=cfg, progress=False)
    eng = llm.engine
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    rid = eng.add_request(PROMPT, params, speculative=SpecOptions(method=toy_kind)).request_id
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    assert outs[rid].stats.method == toy_kind and outs[rid].stats.drafted_tokens > 0
    plain = LLM(config=engine_config(str(tiny_qwen)), progress=False).generate(PROMPT, params)[0]
    assert outs[rid].token_ids == plain.token_ids


def test_an_unknown_kind_is_refused_before_loading(tiny_qwen):
    cfg = engine_config(str(tiny_qwen))
    cfg.speculative = _fixed("no_such_kind")
    with pytest.raises(ValueError, match="unknown speculative method 'no_such_kind'"):
        LLM(config=cfg, progress=False)
    with pytest.raises(ValueError, match="already registered"):
        registry.register(registry.get("ngram"))
