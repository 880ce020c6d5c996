"""Structured outputs on tiny random models: every output matches its constraint, speculative greedy
output equals plain greedy output under the same constraint for every proposer, grammar-forced
drafts are verified and counted, sampled constrained output is distributed as plain constrained
decoding, bad constraints fail before anything is queued, and unconstrained neighbours in a batch
are untouched."""
from __future__ import annotations

import json
import re
from collections import Counter

import jsonschema
import pytest
import torch
from conftest import engine_config

from specdec.config import SpeculativeConfig
from specdec.llm import LLM
from specdec.quality.chi_square import chi_square_two_sample
from specdec.sample.structured import GrammarCompiler
from specdec.sampling_params import SamplingParams, StructuredOutput

PROMPTS = ["hello there", "the cat sat on the mat and then the cat sat", "a"]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "maximum": 150},
                         "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["x", "yy", "zzz"]}}}}
REGEX = r"[a-z]{3,8}( [a-z]{2,5}){2}"
CONSTRAINTS = {
    "json_schema": StructuredOutput("json_schema", SCHEMA),
    "regex": StructuredOutput("regex", REGEX),
    "choice": StructuredOutput("choice", ["alpha", "beta", "gamma delta"]),
    "lark": StructuredOutput("grammar", 'start: "(" NUM (", " NUM)* ")"\nNUM: /[0-9]{1,3}/'),
    "gbnf": StructuredOutput("grammar", 'root ::= "yes" | "no" | "maybe " [a-z]+'),
    "json": StructuredOutput("json"),
}


def matches(kind: str, text: str) -> bool:
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if kind == "json":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in ("alpha", "beta", "gamma delta")
    if kind == "lark":
        return re.fullmatch(r"\(\d{1,3}(, \d{1,3})*\)", text) is not None
    return re.fullmatch(r"yes|no|maybe [a-z]+", text) is not None


def checked(llm: LLM) -> LLM:
    """After every step, each constrained request's grammar has consumed exactly the tokens it
    emitted (but an EOS that ended it), with no lookahead left open."""
    eng, step = llm.engine, llm.engine.step

    def step_and_check():
        reqs = [r for r in eng.requests.values() if r.grammar is not None]
        outputs = step()
        for r in reqs:
            consumed, emitted = r.grammar.committed_tokens, r.output_token_ids
            assert r.grammar.depth == 0
            assert consumed == emitted[: len(consumed)], (consumed, emitted)
            assert len(consumed) == len(emitted) or (r.finished and len(consumed) == len(emitted) - 1)
        return outputs
    eng.step = step_and_check
    return llm


def spec_llm(target, method, draft=None, k=3):
    cfg = engine_config(str(target))
    cfg.speculative = SpeculativeConfig(method=method, draft_model=str(draft) if draft else None,
                                        num_speculative_tokens=k, policy="fixed")
    return checked(LLM(config=cfg, progress=False))


@pytest.fixture(scope="module")
def plain(tiny_qwen):
    return checked(LLM(config=engine_config(str(tiny_qwen)), progress=False))


@pytest.fixture(scope="module")
def plain_outputs(plain):
    return {kind: plain.generate(PROMPTS, SamplingParams(max_tokens=96, structured=so))
            for kind, so in CONSTRAINTS.items()}


def test_plain_outputs_match_their_constraints(plain_outputs):
    for kind, outs in plain_outputs.items():
        for o in outs:
            assert o.finish_reason == "stop", (kind, o.text)
            assert matches(kind, o.text), (kind, o.text)
            assert o.stats.structured == ("grammar" if kind in ("lark", "gbnf") else kind)
            assert o.stats.num_masks >= len(o.token_ids)


@pytest.mark.parametrize("method,with_draft", [("ngram", False), ("suffix", False), ("draft_model", True),
                                               ("hybrid", True)])
def test_speculative_greedy_equals_plain_under_each_constraint(plain_outputs, tiny_qwen, tiny_llama, method,
                                                               with_draft):
    llm = spec_llm(tiny_qwen, method, tiny_llama if with_draft else None)
    for kind, so in CONSTRAINTS.items():
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=96, structured=so))
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain_outputs[kind]], (method, kind)
    eng = llm.engine
    assert eng.kv.num_free_blocks() == eng.kv.num_blocks


def test_forced_drafts_are_verified_and_always_kept(plain_outputs, tiny_qwen):
    # the random model agrees with no lookup: what is accepted is what the grammar forced
    llm = spec_llm(tiny_qwen, "ngram")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=96, structured=CONSTRAINTS["json_schema"]))
    for o, ref in zip(outs, plain_outputs["json_schema"]):
        assert o.token_ids == ref.token_ids
        assert o.stats.forced_drafted_tokens >= 8   # '{"', 'name', '":', ... 'tags', '":'
        assert o.stats.forced_accepted_tokens == o.stats.forced_drafted_tokens
        assert o.stats.mean_accepted_length > 1.2
    assert llm.engine.stats().speculation.free_drafts["grammar"].accepted_tokens > 0


def test_a_proposer_capped_at_zero_still_gets_forced_drafts(plain_outputs, tiny_qwen):
    from specdec.request import SpecOptions
    llm = spec_llm(tiny_qwen, "ngram")
    eng = llm.engine
    req = eng.add_request(PROMPTS[0], SamplingParams(max_tokens=96, structured=CONSTRAINTS["json_schema"]),
                          speculative=SpecOptions(max_k=0))
    while eng.has_unfinished():
        eng.step()
    assert req.output_token_ids == plain_outputs["json_schema"][0].token_ids
    assert req.spec.forced_accepted_tokens == req.spec.drafted_tokens > 0


def test_sampled_constrained_output_is_distributed_as_plain(tiny_qwen, tiny_llama):
    """A different draft model (q != p) under the same mask: the speculative choice distribution
    must match plain constrained sampling (chi-square, fixed seeds)."""
    options = ["ab", "ba", "abc", "cab", "bca", "c"]
    so = StructuredOutput("choice", options)
    plain = checked(LLM(config=engine_config(str(tiny_qwen), max_batch_size=64, max_queued_requests=1024),
                        progress=False))
    cfg = engine_config(str(tiny_qwen), max_batch_size=64, max_queued_requests=1024)
    cfg.speculative = SpeculativeConfig(method="draft_model", draft_model=str(tiny_llama), num_speculative_tokens=3,
                                        policy="fixed")
    spec = checked(LLM(config=cfg, progress=False))
    n = 600
    counts = {}
    for name, llm, offset in (("plain", plain, 0), ("spec", spec, 10_000)):
        params = [SamplingParams(temperature=1.5, max_tokens=8, seed=offset + i, structured=so) for i in range(n)]
        texts = [o.text for o in llm.generate(["x"] * n, params)]
        assert set(texts) <= set(options)
        c = Counter(texts)
        counts[name] = [c[o] for o in options]
    assert sum(1 for v in counts["plain"] if v > 20) >= 3, counts   # the test has something to compare
    assert chi_square_two_sample(counts["plain"], counts["spec"]).p_value > 0.001, counts
    assert spec.engine.stats().speculation is not None


@pytest.mark.parametrize("so,fragment", [
    (StructuredOutput("json_schema", {"type": "object", "properties": {"a": {"type": "frobnicate"}}}), "frobnicate"),
    (StructuredOutput("regex", "(ab"), "unclosed group"),
    (StructuredOutput("grammar", "start: foo"), "foo"),
])
def test_invalid_constraints_fail_before_anything_is_queued(plain, so, fragment):
    eng = plain.engine
    before = eng.stats()
    with pytest.raises(ValueError, match=fragment):
        eng.add_request("hello", SamplingParams(structured=so))
    assert not eng.has_unfinished() and eng.stats().num_waiting == before.num_waiting


def test_malformed_constraints_are_refused_by_their_shape():
    for kind, spec, fragment in [("yaml", None, "kind"), ("json_schema", "{not json", "not valid JSON"),
                                 ("json_schema", [1], "object"), ("regex", "", "non-empty"),
                                 ("choice", [], "non-empty"), ("choice", ["a", 3], "non-empty"),
                                 ("json", {"x": 1}, "takes no spec")]:
        with pytest.raises(ValueError, match=fragment):
            StructuredOutput(kind, spec)
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured=StructuredOutput("json"))


def test_unconstrained_neighbours_are_untouched(plain):
    params = SamplingParams(max_tokens=24)
    alone = plain.generate(PROMPTS, params)
    mixed = plain.generate(PROMPTS + PROMPTS, [params] * 3 + [SamplingParams(max_tokens=24,
                                                                             structured=CONSTRAINTS["regex"])] * 3)
    assert [o.token_ids for o in mixed[:3]] == [o.token_ids for o in alone]
    assert all(o.stats.structured is None and o.stats.num_masks == 0 for o in alone)


def test_mask_rows_masks_each_row_after_the_drafts_before_it(plain):
    """Designed logits: row j is masked with the state after drafts[:j]; a forbidden draft stops the
    advance; the lookahead leaves the state where it was, and commit moves it over the emitted tokens."""
    tok = plain.tokenizer
    compiler = GrammarCompiler(tok)
    m = compiler.matcher(StructuredOutput("choice", ["abc", "abd"]))
    a, b, c, d, x = (tok.encode(ch, add_special_tokens=False)[0] for ch in "abcdx")
    rows = torch.zeros(4, tok.vocab_size)
    masked = m.mask_rows(rows, [a, b, x])
    assert m.depth == 0 and m.committed_tokens == [] and m.valid_prefix([a]) == 1
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [a]
    assert torch.isfinite(masked[1]).nonzero().flatten().tolist() == [b]
    assert sorted(torch.isfinite(masked[2]).nonzero().flatten().tolist()) == sorted([c, d])
    assert torch.isfinite(masked[3]).all()          # after the forbidden draft: never used
    m.commit([a, b, d])                             # a, b accepted, then d
    assert m.is_accepting and m.committed_tokens == [a, b, d]
    assert m.valid_prefix([c]) == 0


def test_cli_generate_with_a_json_schema_file(capsys, tiny_qwen, tmp_path):
    from specdec.cli import main
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    code = main(["generate", "--model", str(tiny_qwen), "--precision", "float32", "--max-tokens", "96", "--json",
                 "--json-schema", str(path), "hello", "a"])
    out = capsys.readouterr()
    assert code == 0, out.err
    lines = [json.loads(line) for line in out.out.splitlines()]
    assert len(lines) == 2
    for line in lines:
        jsonschema.validate(json.loads(line["text"]), SCHEMA)
        assert line["stats"]["structured"] == "json_schema"
    assert main(["generate", "--model", str(tiny_qwen), "--precision", "float32", "--regex", "(ab", "x"]) != 0
    assert "regular expression" in capsys.readouterr().err
