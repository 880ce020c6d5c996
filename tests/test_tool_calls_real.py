"""Tool calls on the real default target (Qwen2.5-Coder-1.5B-Instruct), greedy, through the grammars
and the parser the server uses: a required or named call is one call that ends the turn, "auto"
recognises the calls this model writes (as fenced JSON more often than between tags) with
arguments valid for their schema, leaves plain answers alone, and stays exact under speculation."""
from __future__ import annotations

import json

import jsonschema
import pytest

from conftest import engine_config
from specdec.config import SpeculativeConfig
from specdec.llm import LLM
from specdec.sampling_params import SamplingParams, StructuredOutput
from specdec.server.tool_calls import parse_tool_calls
from specdec.server.tool_grammar import auto_grammar, call_grammar
from specdec.server.tools import check_tools, with_answer_format

pytestmark = pytest.mark.real_model

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def tool(name: str, description: str, **props) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {k: {"type": t} for k, t in props.items()}, "required": list(props)}}}


TOOLS = [tool("get_weather", "Current weather in a city", city="string"),
         tool("convert_currency", "Convert an amount between currencies", amount="number", source="string",
              target="string"),
         tool("search_flights", "Find flights between two airports on a date", origin="string",
              destination="string", date="string"),
         tool("get_stock_price", "Latest price of a stock ticker", ticker="string"),
         tool("send_email", "Send an email", to="string", subject="string", body="string")]
NEED_A_TOOL = ["Is it raining in Lisbon at the moment?",
               "How many Japanese yen is 250 euros today?",
               "Find me a flight from JFK to LHR on 2026-12-24.",
               "What is NVDA trading at right now?",
               "Email bob@example.com that the meeting moved to 3pm, subject 'Meeting'."]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NAMES = tuple(SCHEMAS)


@pytest.fixture(scope="module")
def plain(qwen15_loaded):
    return LLM(config=engine_config(TARGET), loaded=qwen15_loaded, progress=False)


def chat_ids(llm: LLM, question: str) -> list[int]:
    tok = llm.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": question}], tools=TOOLS)
    return tok.encode(prompt, add_special_tokens=False)


def run(llm: LLM, questions: list[str], grammar, max_tokens: int = 80):
    params = SamplingParams(max_tokens=max_tokens, structured=grammar)
    return llm.generate([chat_ids(llm, q) for q in questions], params)


def test_required_and_named_calls_end_with_the_call(plain):
    functions = check_tools(TOOLS)
    for grammar, want in ((call_grammar(functions, None, True), None),
                          (call_grammar(functions, "get_weather", True), "get_weather")):
        out = run(plain, [NEED_A_TOOL[0]], grammar)[0]
        content, calls = parse_tool_calls(out.text, out.finish_reason == "length", NAMES)
        assert out.finish_reason == "stop" and content is None, out.text
        (call,) = calls
        assert want in (None, call["function"]["name"])
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
        own = len(plain.tokenizer.encode(out.text.strip(), add_special_tokens=False))
        assert len(out.token_ids) <= 1.5 * own, (len(out.token_ids), own, out.text)


def test_auto_recognises_the_calls_the_model_writes(plain):
    outs = run(plain, NEED_A_TOOL + ["Write a haiku about the sea."], auto_grammar(check_tools(TOOLS)))
    for question, out in zip(NEED_A_TOOL, outs):
        content, calls = parse_tool_calls(out.text, out.finish_reason == "length", NAMES)
        assert calls and out.finish_reason == "stop", (question, out.text)
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
        assert not (content or "").startswith("```"), out.text  # no call markup left in the content
    content, calls = parse_tool_calls(outs[-1].text, False, NAMES)
    assert calls == [] and content == outs[-1].text


def test_auto_grammar_is_exact_under_speculation(qwen15_loaded, qwen05_loaded, plain):
    config = engine_config(TARGET)
    config.speculative = SpeculativeConfig(method="draft_model", draft_model=DRAFT, num_speculative_tokens=4,
                                           policy="fixed")
    spec = LLM(config=config, loaded=qwen15_loaded, draft_loaded=qwen05_loaded, progress=False)
    grammar = auto_grammar(check_tools(TOOLS))
    questions = NEED_A_TOOL[:2] + ["Explain list comprehensions in one sentence."]
    want = [o.token_ids for o in run(plain, questions, grammar, 48)]
    outs = run(spec, questions, grammar, 48)
    assert [o.token_ids for o in outs] == want
    assert sum(o.stats.accepted_tokens for o in outs) > 0


def test_tools_beside_an_answer_schema(plain):
    """What openai-agents sends for an agent with an output_type: the tool can still be called, and
    the schema holds the final answer once the tool's result is in."""
    answer = StructuredOutput("json_schema", {"type": "object", "properties": {"city": {"type": "string"},
                                                                               "raining": {"type": "boolean"}},
                                              "required": ["city", "raining"], "additionalProperties": False})
    grammar = auto_grammar(check_tools(TOOLS[:1]), answer)
    tok = plain.tokenizer
    first = [{"role": "user", "content": NEED_A_TOOL[0]}]
    out = plain.generate([tok.encode(tok.apply_chat_template(first, tools=TOOLS[:1]), add_special_tokens=False)],
                         SamplingParams(max_tokens=60, structured=grammar))[0]
    _, calls = parse_tool_calls(out.text, False, NAMES)
    assert [c["function"]["name"] for c in calls] == ["get_weather"], out.text
    call = calls[0]
    turn = first + [{"role": "assistant", "content": "", "tool_calls": [
                        {"id": call["id"], "type": "function",
                         "function": {"name": "get_weather", "arguments": json.loads(call["function"]["arguments"])}}]},
                    {"role": "tool", "tool_call_id": call["id"], "content": '{"sky": "heavy rain", "temp_c": 11}'}]
    prompt = tok.apply_chat_template(with_answer_format(turn, answer), tools=TOOLS[:1])
    assert "JSON schema" in prompt   # told the answer's format once the result is in
    out = plain.generate([tok.encode(prompt, add_special_tokens=False)],
                         SamplingParams(max_tokens=60, structured=grammar))[0]
    content, calls = parse_tool_calls(out.text, False, NAMES)
    assert out.finish_reason == "stop", out.text
    if calls:  # the grammar allowed it; this 1.5B asks again for a result it already has (also unconstrained)
        assert content is None
        pytest.xfail(f"model quality: a second call instead of the answer: {out.text!r}")
    jsonschema.validate(json.loads(content), answer.spec)


def test_an_answer_schema_beside_tools_holds_a_plain_answer(plain):
    answer = StructuredOutput("json_schema", {"type": "object", "properties": {"name": {"type": "string"},
                                                                               "language": {"type": "string"}},
                                              "required": ["name", "language"], "additionalProperties": False})
    tok = plain.tokenizer
    ask = [{"role": "user", "content": "Who created Python? Answer with his name and the language."}]
    out = plain.generate([tok.encode(tok.apply_chat_template(ask, tools=TOOLS[:1]), add_special_tokens=False)],
                         SamplingParams(max_tokens=40, structured=auto_grammar(check_tools(TOOLS[:1]), answer)))[0]
    content, calls = parse_tool_calls(out.text, False, NAMES)
    assert calls == [] and out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(content), answer.spec)
