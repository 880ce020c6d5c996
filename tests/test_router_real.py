"""The router on the real 0.5B, with deterministic costs so the outcome depends on accepted tokens
only: on code edits prompt lookup pays (the output copies the prompt, and a draft model would first
have to prefill the long prompt), on free prose the draft model does. The draft here is the 0.5B
itself (the default pair's draft would make this test slow), priced at a static cost ratio of 0.2
(about what the 0.5B costs next to a 3B target): it pays on prose, while catching up on a 600-token
code-edit prompt costs more than 16 tokens can win back. Suffix decoding is a third candidate,
tried after prompt lookup on code edits and after the draft's rivals elsewhere."""
from __future__ import annotations

import pytest

from conftest import engine_config
from specdec.config import ControllerConfig, RouterConfig, SpeculativeConfig
from specdec.llm import LLM
from specdec.prompts import PROMPTS_DIR, read_prompts_file
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.real_model
DRAFT = "qwen2.5-coder-0.5b-instruct"


def test_router_picks_ngram_on_code_edits_and_the_draft_on_prose(qwen05_loaded):
    cfg = engine_config(DRAFT, target_cache_blocks=512)
    cfg.speculative = SpeculativeConfig(method="draft_model", draft_model=DRAFT, num_speculative_tokens=4,
                                        router=RouterConfig(enabled=True, exploration=0.0),
                                        controller=ControllerConfig(deterministic=True, draft_cost_ratio=0.2))
    llm = LLM(config=cfg, loaded=qwen05_loaded, draft_loaded=qwen05_loaded, progress=False)
    router = llm.engine.speculator.router
    params = SamplingParams(max_tokens=16)
    chosen: dict[str, list[str]] = {}
    for domain in ("code_edit", "prose"):
        for prompt in read_prompts_file(str(PROMPTS_DIR / f"{domain}.jsonl"))[:4]:
            out = llm.chat([{"role": "user", "content": prompt}], params)
            assert out.stats.domain == domain
            chosen.setdefault(domain, []).append(out.stats.proposers_used[0])
    gains = {d: {p: a["gain"] for p, a in arms.items()} for d, arms in router.snapshot().items()}
    # each proposer tried once (prior order first), then the best measured one
    names = {"ngram": "ngram[1-4]", "suffix": "suffix", DRAFT: DRAFT}
    assert chosen["code_edit"][:3] == ["ngram[1-4]", "suffix", DRAFT], (chosen, gains)
    best_edit = max(gains["code_edit"], key=gains["code_edit"].get)
    assert best_edit in ("ngram", "suffix") and chosen["code_edit"][3] == names[best_edit], (chosen, gains)
    assert chosen["prose"][:3] == [DRAFT, "ngram[1-4]", "suffix"], (chosen, gains)
    assert max(gains["prose"], key=gains["prose"].get) == DRAFT and chosen["prose"][3] == DRAFT, (chosen, gains)
