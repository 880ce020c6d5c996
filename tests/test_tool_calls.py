"""specdec/server/tools.py and tool_calls.py: tools checking, the tool-call grammar (llguidance, on a
byte-level tokenizer with <tool_call> / </tool_call> as special tokens), parsing and streaming of
calls, and messages for the chat template."""
from __future__ import annotations

import copy
import json
import re

import pytest
from hypothesis import given, settings, strategies as st

from specdec.server.tool_calls import ToolCallStream, parse_tool_calls
from specdec.sampling_params import StructuredOutput
from specdec.server.tool_grammar import MAX_PARALLEL_CALLS, auto_grammar, call_grammar
from specdec.server.tools import check_tools, tool_messages

ID = re.compile(r"call_[0-9a-f]{24}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"], "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: takes none
PLACE = {"type": "function", "function": {"name": "place", "parameters": {
    "type": "object", "properties": {"at": {"$ref": "#/$defs/Loc"}}, "required": ["at"],
    "$defs": {"Loc": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]}}}}}


def block(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


# ---- parse_tool_calls -------------------------------------------------------------------------

def test_parse_single_call():
    content, calls = parse_tool_calls(block("get_weather", '{"city": "Paris"}'))
    assert content is None
    assert len(calls) == 1
    assert ID.fullmatch(calls[0]["id"])
    assert calls[0]["type"] == "function"
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_parse_keeps_arguments_as_written():
    text = '<tool_call>{"name":"f","arguments":  {"a":[1, 2],"b":"x\\"}"} }</tool_call>'
    _, calls = parse_tool_calls(text)
    assert calls[0]["function"]["arguments"] == '{"a":[1, 2],"b":"x\\"}"}'


def test_parse_parallel_calls():
    text = block("get_weather", '{"city": "Paris"}') + "\n" + block("now", "{}")
    content, calls = parse_tool_calls(text)
    assert content is None
    assert [c["function"]["name"] for c in calls] == ["get_weather", "now"]
    assert [c["function"]["arguments"] for c in calls] == ['{"city": "Paris"}', "{}"]
    assert calls[0]["id"] != calls[1]["id"]


def test_parse_text_around_calls():
    text = "Let me check.\n" + block("now", "{}") + "\nDone."
    content, calls = parse_tool_calls(text)
    assert content == "Let me check.\n\nDone."
    assert len(calls) == 1


def test_parse_other_key_order():
    _, calls = parse_tool_calls('<tool_call>\n{"arguments": {"x": 1}, "name": "f"}\n</tool_call>')
    assert calls[0]["function"] == {"name": "f", "arguments": '{"x": 1}'}


@pytest.mark.parametrize("body", ['{"name": "f", "arguments": {"a": 1}', "not json",
                                  '{"name": 3, "arguments": {}}', '{"name": "f", "arguments": "{}"}',
                                  '{"name": "f"}', '{"name": "f", "arguments": {}, "x": 1}',
                                  '{"name": "", "arguments": {}}', '{"name": "f", "arguments": {"a": NaN}}',
                                  '{"name": "f", "name": "g", "arguments": {}}', "[1]"])
def test_parse_malformed_block_stays_content(body):
    bad = f"<tool_call>\n{body}\n</tool_call>"
    text = "Hi " + bad + "\n" + block("now", "{}")
    content, calls = parse_tool_calls(text)
    assert content == "Hi " + bad
    assert [c["function"]["name"] for c in calls] == ["now"]


def test_parse_unterminated_block_stays_content():
    text = block("now", "{}") + '\n<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    content, calls = parse_tool_calls(text)
    assert content == '<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    assert len(calls) == 1


def test_parse_plain_text():
    assert parse_tool_calls("  Hello <b>there</b>\n") == ("  Hello <b>there</b>\n", [])
    assert parse_tool_calls(" \n") == (None, [])
    assert parse_tool_calls("") == (None, [])


# ---- ToolCallStream ---------------------------------------------------------------------------

def run_stream(pieces: list[str]) -> tuple[ToolCallStream, list[dict]]:
    stream = ToolCallStream()
    deltas = [d for p in pieces for d in stream.feed(p)]
    return stream, deltas + stream.finish()


def collect(deltas: list[dict]) -> tuple[str, list[dict]]:
    """The content and the calls the deltas add up to, checking their shape on the way."""
    content, calls = "", []
    for d in deltas:
        assert len(d) == 1
        if "content" in d:
            assert d["content"]
            content += d["content"]
            continue
        (entry,) = d["tool_calls"]
        if "id" in entry:  # the header: once, in order, with empty arguments
            assert entry["index"] == len(calls)
            assert entry["type"] == "function" and entry["function"]["arguments"] == ""
            calls.append({"id": entry["id"], "name": entry["function"]["name"], "arguments": ""})
        else:
            assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
            assert entry["index"] == len(calls) - 1 and entry["function"]["arguments"]
            calls[-1]["arguments"] += entry["function"]["arguments"]
    return content, calls


TEXTS = [
    "Just an answer, with a < b and <b>tags</b> and <tool_c not a tag.\n",
    block("get_weather", '{"city": "Paris", "unit": "c"}'),
    "Let me check.\n" + block("get_weather", '{"city": "Par{is}"}') + "\n" + block("now", "{}"),
    block("f", '{"s": "}\\"\\\\", "t": "</tool", "n": [1, {"x": []}], "u": "é\\u00e9"}') + "\nAfter.",
    '<tool_call>{"name":"f","arguments":{"a":1}}</tool_call><tool_call> {"name" : "g" , "arguments" : {} } </tool_call>',
    '<tool_call>\n{"arguments": {"x": 1}, "name": "f"}\n</tool_call>',   # other order: decided at the close
    '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call> then ' + block("now", "{}"),
    "<tool_call>\nnot json at all\n</tool_call>",
    '<tool_call>\n{"name": "f", "arguments": "{}"}\n</tool_call>',
    '<tool_call>\n{"name": "f"}\n</tool_call>',
    'Text <tool_call>\n{"name": "get_weather", "argu',                  # cut off before committing
    "  leading space " + block("now", "{}") + "  \n",
]


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_stream_matches_parse(data):
    text = data.draw(st.sampled_from(TEXTS))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    stream, deltas = run_stream(pieces)
    content, calls = collect(deltas)
    want_content, want_calls = parse_tool_calls(text)
    if want_calls:
        assert content.strip() == (want_content or "")
    else:
        assert content == text
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in want_calls]
    assert [c["id"] for c in calls] == [c["id"] for c in stream.calls]
    assert [c["function"] for c in stream.calls] == [c["function"] for c in want_calls]
    assert all(ID.fullmatch(c["id"]) for c in stream.calls)


OPEN = "<tool_call>"
PIECES = [OPEN, "</tool_call>", '\n{"name": "f", "arguments": ', '{"a": [1, "}"]}', "{}",
          "}\n", "{", "}", "[", "]", '"', "\\", "\n", " ", ":", ",", '"name"', '"arguments"', '"g"', "x", "<"]


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                    max_leaves=6)
ARGUMENTS = st.builds(lambda d, seps: json.dumps(d, ensure_ascii=False, separators=seps),
                      st.dictionaries(st.text(max_size=4), JSON, max_size=3), st.sampled_from([(", ", ": "), (",", ":")]))
SEGMENT = (st.builds(block, st.sampled_from(["f", "get_weather"]), ARGUMENTS)
           | st.lists(st.sampled_from(PIECES), max_size=6).map("".join))


@settings(max_examples=300, deadline=None)
@given(text=st.lists(SEGMENT, max_size=5).map("".join), data=st.data())
def test_stream_fuzz(text, data):
    """Any text: the deltas do not depend on how it is split, and match parse_tool_calls whenever
    every block in it is a call."""
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    content, calls = collect(run_stream(pieces)[1])
    whole_content, whole_calls = collect(run_stream([text])[1])
    assert content == whole_content
    assert [(c["name"], c["arguments"]) for c in calls] == [(c["name"], c["arguments"]) for c in whole_calls]
    want_content, want_calls = parse_tool_calls(text)
    if OPEN not in (want_content or ""):
        assert [(c["name"], c["arguments"]) for c in calls] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in want_calls]
        if want_calls:
            assert content.strip() == (want_content or "")
        else:
            assert content == text and want_content == (text if text.strip() else None)


def test_stream_char_by_char_shapes():
    text = "Sure.\n" + block("get_weather", '{"city": "Paris"}')
    stream, deltas = run_stream(list(text))
    assert "".join(d["content"] for d in deltas[:5]) == "Sure."  # one delta per feed
    header = deltas[5]["tool_calls"][0]
    assert header == {"index": 0, "id": stream.calls[0]["id"], "type": "function",
                      "function": {"name": "get_weather", "arguments": ""}}
    fragments = [d["tool_calls"][0]["function"]["arguments"] for d in deltas[6:]]
    assert len(fragments) == len('{"city": "Paris"}')
    assert "".join(fragments) == '{"city": "Paris"}'
    assert fragments[-1] == "}"  # the arguments' own brace, not the outer one


def test_stream_holds_back_a_partial_tag():
    stream = ToolCallStream()
    assert stream.feed("Hi <tool") == [{"content": "Hi"}]
    assert stream.feed("box>") == [{"content": " <toolbox>"}]
    assert stream.feed(" <tool_") == []
    assert stream.feed('call>\n{"name": "now", "arguments": {') == [
        {"tool_calls": [{"index": 0, "id": stream.calls[0]["id"], "type": "function",
                         "function": {"name": "now", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}]
    assert stream.feed("}") == [{"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}]
    assert stream.feed("}\n</tool") == []       # the outer brace and the close tag are no arguments
    assert stream.feed("_call>") == []
    assert stream.finish() == []                  # the trailing space is dropped: there were calls
    assert stream.calls[0]["function"] == {"name": "now", "arguments": "{}"}


def test_stream_finish_flushes_held_text():
    stream = ToolCallStream()
    assert stream.feed("a <tool_call") == [{"content": "a"}]
    assert stream.finish() == [{"content": " <tool_call"}]
    stream = ToolCallStream()
    assert stream.feed('x<tool_call>\n{"name": "f", ') == [{"content": "x"}]
    assert stream.finish() == [{"content": '<tool_call>\n{"name": "f", '}]
    assert stream.calls == []


def test_stream_cut_off_after_commit_keeps_the_call():
    # documented divergence: parse_tool_calls keeps this block as content
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    stream, deltas = run_stream([text])
    content, calls = collect(deltas)
    assert content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": "Pa')]
    assert parse_tool_calls(text) == (text, [])


def test_stream_cut_off_in_closing_drops_scaffolding():
    stream, deltas = run_stream([block("now", "{}")[:-4]])
    assert collect(deltas) == ("", [{"id": stream.calls[0]["id"], "name": "now", "arguments": "{}"}])


def test_stream_junk_after_arguments_becomes_content():
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1}, "b": 2}\n</tool_call>'
    stream, deltas = run_stream([text[:30], text[30:]])
    content, calls = collect(deltas)
    assert content == ', "b": 2}\n</tool_call>'
    assert calls[0]["arguments"] == '{"a": 1}'


# ---- check_tools ------------------------------------------------------------------------------

def test_check_tools_returns_functions():
    fns = check_tools([WEATHER, NOW])
    assert fns[0] == {"name": "get_weather", "description": "Current weather",
                      "parameters": WEATHER["function"]["parameters"]}
    assert fns[1] == {"name": "now", "parameters": {"type": "object", "properties": {}}}


@pytest.mark.parametrize("tools, message", [
    ([], r"tools must be a non-empty list"),
    ("x", r"tools must be a non-empty list"),
    ([WEATHER, 3], r"tools\[1\] must be an object"),
    ([{"type": "retrieval", "function": {"name": "a"}}], r"tools\[0\]\.type must be 'function'"),
    ([{"type": "function"}], r"tools\[0\]\.function must be an object"),
    ([{"type": "function", "function": {"name": "get weather"}}], r"tools\[0\]\.function\.name must be"),
    ([{"type": "function", "function": {"name": "a" * 65}}], r"tools\[0\]\.function\.name must be"),
    ([{"type": "function", "function": {}}], r"tools\[0\]\.function\.name must be"),
    ([{"type": "function", "function": {"name": "a", "description": 1}}], r"tools\[0\]\.function\.description"),
    ([{"type": "function", "function": {"name": "a", "parameters": "{}"}}], r"tools\[0\]\.function\.parameters"),
    ([{"type": "function", "function": {"name": "a", "parameters": {"type": "array"}}}], r"tools\[0\]\.function\.parameters"),
    ([{"type": "function", "function": {"name": "a", "strict": "yes"}}], r"tools\[0\]\.function\.strict"),
    ([WEATHER, NOW, WEATHER], r"tools\[2\]\.function\.name 'get_weather' repeats tools\[0\]"),
])
def test_check_tools_errors(tools, message):
    with pytest.raises(ValueError, match=message):
        check_tools(tools)


# ---- tool_messages ----------------------------------------------------------------------------

def test_tool_messages_parses_arguments():
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "assistant", "content": "It is 18C."},
    ]
    before = copy.deepcopy(messages)
    out = tool_messages(messages)
    assert messages == before  # the input is not touched
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert out[1]["tool_calls"][1]["function"]["arguments"] == {}
    assert out[1]["tool_calls"][0]["id"] == "call_1"
    assert out[0] == messages[0] and out[2] == messages[2] and out[3] == messages[3]
    assert out[2] is not messages[2]


@pytest.mark.parametrize("arguments, message", [
    ('{"city": ', r"messages\[1\]\.tool_calls\[0\]\.function\.arguments is not valid JSON"),
    ("[1, 2]", r"messages\[1\]\.tool_calls\[0\]\.function\.arguments must be a JSON object"),
])
def test_tool_messages_rejects_bad_arguments(arguments, message):
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                      "function": {"name": "f", "arguments": arguments}}]}]
    with pytest.raises(ValueError, match=message):
        tool_messages(messages)


# ---- tool_grammar -----------------------------------------------------------------------------

try:
    import llguidance
except ImportError:  # the grammar is only text; checking it needs the library
    llguidance = None
needs_llguidance = pytest.mark.skipif(llguidance is None, reason="llguidance is not installed")


@pytest.fixture(scope="module")
def toks():
    """A byte-level tokenizer (one token per byte, no merges) with the chat's special tokens, and
    llguidance's view of it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<tool_call>", "</tool_call>"])
    eos = tok.token_to_id("<|endoftext|>")
    return tok, llguidance.LLTokenizer(tok.to_str(), eos_token=eos), eos


def accepts(toks, structured, text: str) -> bool:
    """Whether the grammar takes all of `text` (special tokens as such) and then end of sequence."""
    tok, lltok, eos = toks
    ids = tok.encode(text).ids + [eos]
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(structured.spec))
    assert not matcher.is_error(), matcher.get_error()
    return matcher.validate_tokens(ids) == len(ids)


@needs_llguidance
def test_grammar_is_valid(toks):
    structured = call_grammar(check_tools([WEATHER, NOW, PLACE]), None, True)
    assert structured.kind == "grammar"
    grammar = llguidance.LLMatcher.grammar_from_lark(structured.spec)
    assert llguidance.LLMatcher.validate_grammar_with_warnings(grammar, toks[1]) == (False, [])


@needs_llguidance
def test_grammar_special_tokens_are_tokens(toks):
    tok, _, _ = toks
    assert tok.encode(block("now", "{}")).ids[0] == tok.token_to_id("<tool_call>")
    assert tok.encode(block("now", "{}")).ids[-1] == tok.token_to_id("</tool_call>")


@needs_llguidance
def test_grammar_accepts_calls(toks):
    g = call_grammar(check_tools([WEATHER, NOW, PLACE]), None, False)
    assert accepts(toks, g, block("get_weather", '{"city": "Paris"}'))
    assert accepts(toks, g, block("get_weather", '{"city": "Paris", "unit": "f"}'))
    assert accepts(toks, g, block("now", "{}"))
    assert accepts(toks, g, block("place", '{"at": {"lat": 1.5}}'))  # a $ref into $defs
    assert not accepts(toks, g, block("place", '{"at": {"lon": 1.5}}'))


@needs_llguidance
def test_grammar_rejects_wrong_calls(toks):
    g = call_grammar(check_tools([WEATHER, NOW, PLACE]), None, False)
    assert not accepts(toks, g, block("get_wether", '{"city": "Paris"}'))           # no such function
    assert not accepts(toks, g, block("get_weather", '{"unit": "c"}'))              # city missing
    assert not accepts(toks, g, block("get_weather", '{"city": "Paris", "x": 1}'))  # extra property
    assert not accepts(toks, g, block("get_weather", '{"city": "Paris", "unit": "k"}'))
    assert not accepts(toks, g, block("get_weather", '{"city":"Paris"}'))           # json.dumps spacing only
    assert not accepts(toks, g, block("now", '{"x": 1}'))                           # takes no arguments
    assert not accepts(toks, g, '<tool_call>\n{"name": "now", "arguments": {}, "x": 1}\n</tool_call>')
    assert not accepts(toks, g, "Sure. " + block("now", "{}"))                      # nothing but calls


@needs_llguidance
def test_grammar_wants_the_special_token_not_its_text(toks):
    tok, lltok, _ = toks
    g = call_grammar(check_tools([NOW]), None, False)
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(g.spec))
    spelled = tok.encode("<").ids + tok.encode("tool_call>").ids  # the tag as byte tokens
    assert len(spelled) == len("<tool_call>")
    assert matcher.validate_tokens(spelled) == 0
    assert matcher.validate_tokens([tok.token_to_id("<tool_call>")]) == 1


@needs_llguidance
def test_grammar_parallel(toks):
    two = block("get_weather", '{"city": "Paris"}') + "\n" + block("now", "{}")
    assert accepts(toks, call_grammar(check_tools([WEATHER, NOW]), None, True), two)
    assert accepts(toks, call_grammar(check_tools([WEATHER, NOW]), None, True), block("now", "{}"))
    tok, lltok, _ = toks
    single = call_grammar(check_tools([WEATHER, NOW]), None, False)
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(single.spec))
    first = tok.encode(block("get_weather", '{"city": "Paris"}')).ids
    # the "\n" after a call may end the turn; a second call may not follow it
    assert matcher.validate_tokens(tok.encode(two).ids) == len(first) + 1


@needs_llguidance
def test_grammar_parallel_calls_are_bounded(toks):
    g = call_grammar(check_tools([NOW]), None, True)
    calls = [block("now", "{}")] * MAX_PARALLEL_CALLS
    assert accepts(toks, g, "\n".join(calls))
    assert not accepts(toks, g, "\n".join(calls + [block("now", "{}")]))   # the grammar ends: the model stops


def test_truncated_output_drops_the_unfinished_call():
    text = "Sure." + block("now", "{}") + '\n<tool_call>\n{"name": "get_weather", "argu'
    content, calls = parse_tool_calls(text, truncated=True)
    assert content == "Sure." and [c["function"]["name"] for c in calls] == ["now"]
    assert parse_tool_calls("Hi <tool_c", truncated=True) == ("Hi ", [])
    assert parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {"a', truncated=True) == (None, [])
    for pieces in (["a <tool_call"], ['x<tool_call>\n{"name": "f", '], ["Hi <tool_"]):
        stream = ToolCallStream()
        deltas = [d for p in pieces for d in stream.feed(p)] + stream.finish(truncated=True)
        assert "<" not in "".join(d.get("content", "") for d in deltas) and stream.calls == []


@needs_llguidance
def test_grammar_open_schema(toks):
    anything = {"type": "function", "function": {"name": "any", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": True}}}
    assert accepts(toks, call_grammar(check_tools([anything]), None, False), block("any", '{"x": [1]}'))


@needs_llguidance
def test_grammar_required_name(toks):
    g = call_grammar(check_tools([WEATHER, NOW]), "now", True)
    assert accepts(toks, g, block("now", "{}"))
    assert accepts(toks, g, block("now", "{}") + "\n")
    assert not accepts(toks, g, block("get_weather", '{"city": "Paris"}'))
    assert not accepts(toks, g, block("now", "{}") + "\n" + block("now", "{}"))  # named: exactly one call
    with pytest.raises(ValueError, match="'nope'"):
        call_grammar(check_tools([WEATHER, NOW]), "nope", True)


def test_grammar_argument_errors():
    with pytest.raises(ValueError, match="no tools"):
        call_grammar([], None, True)
    with pytest.raises(ValueError, match="special token"):
        call_grammar(check_tools([NOW]), None, True, open_tag="tool_call")
    g = call_grammar(check_tools([NOW]), None, True, open_tag="<[151657]>", close_tag="<[151658]>")
    assert "tagged: <[151657]> " in g.spec and g.spec.count("<[151658]>") == 1


@needs_llguidance
def test_grammar_lets_the_turn_end_after_any_call(toks):
    """The model ends a turn as "</tool_call>\n" + EOS: the "\n" must not commit it to another call."""
    g = call_grammar(check_tools([WEATHER, NOW]), None, True)
    one = block("now", "{}")
    for text in (one + "\n", one + "\n" + one + "\n", one + " \n\n"):
        assert accepts(toks, g, text)


@needs_llguidance
def test_auto_grammar_is_free_until_a_call_starts(toks):
    g = auto_grammar(check_tools([WEATHER, NOW]))
    assert accepts(toks, g, "")
    assert accepts(toks, g, "Any text { with braces }, ```code``` and JSON {\"name\": \"Ada\"}.")
    assert accepts(toks, g, "Let me look. " + block("now", "{}") + "\nDone.")
    fenced = '```json\n{\n  "name": "get_weather", "arguments": {"city": "Paris"}\n}\n```'
    assert accepts(toks, g, fenced)
    assert accepts(toks, g, 'I will call {"name": "now", "arguments": {}} now.')
    # once `{"name": "<an offered tool>"` is written, the rest of the call follows its schema
    assert not accepts(toks, g, '{"name": "get_weather", "arguments": {"town": "Paris"}}')
    assert not accepts(toks, g, '{"name": "get_weather", "arguments": {"city": "Paris", "x": 1}}')
    assert not accepts(toks, g, '{"name": "now", "arguments": {"x": 1}}')


@needs_llguidance
def test_auto_grammar_with_an_answer_schema(toks):
    answer = StructuredOutput("json_schema", {"type": "object", "properties": {"title": {"type": "string"}},
                                              "required": ["title"], "additionalProperties": False})
    g = auto_grammar(check_tools([WEATHER, NOW]), answer)
    assert accepts(toks, g, '{"title": "Dune"}')                      # the final answer, as its schema says
    assert accepts(toks, g, block("now", "{}") + "\n")                # or calls
    assert accepts(toks, g, '{"name": "get_weather", "arguments": {"city": "Paris"}}')
    # no fence: the model's favourite opening would otherwise steer every answer into a call
    assert not accepts(toks, g, '```json\n{"name": "now", "arguments": {}}\n```')
    assert not accepts(toks, g, "Dune")                                # no free text
    assert not accepts(toks, g, '{"author": "Herbert"}')
    with pytest.raises(ValueError, match="response_format"):
        auto_grammar(check_tools([NOW]), StructuredOutput("regex", "a+"))


@needs_llguidance
def test_arguments_close_unless_told_otherwise(toks):
    open_args = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}}}}}
    g = call_grammar(check_tools([open_args]), None, False)
    assert accepts(toks, g, block("f", '{"a": {"b": 1}}'))
    assert not accepts(toks, g, block("f", '{"a": {"b": 1}, "c": 2}'))
    assert not accepts(toks, g, block("f", '{"a": {"b": 1, "c": 2}}'))


# ---- calls in JSON form (tool_choice auto) ----------------------------------------------------

FENCED = '```json\n{\n  "name": "get_weather", "arguments": {"city": "Paris"}\n}\n```'
JSON_FORMS = [
    (FENCED, None, [("get_weather", '{"city": "Paris"}')]),
    ("Sure.\n" + FENCED + "\nDone.", "Sure.\n\nDone.", [("get_weather", '{"city": "Paris"}')]),
    ('{"name": "now", "parameters": {}}', None, [("now", "{}")]),
    ('```\n{"name":"now","arguments":{}}```', None, [("now", "{}")]),
    ('{"name": "Ada", "arguments": {}}', '{"name": "Ada", "arguments": {}}', []),   # not an offered tool
    ("```python\nx = {'name': 1}\n```", "```python\nx = {'name': 1}\n```", []),
    ('{"title": "x"} and { broken', '{"title": "x"} and { broken', []),
    (block("now", "{}") + "\n" + FENCED, None, [("now", "{}"), ("get_weather", '{"city": "Paris"}')]),
]


@pytest.mark.parametrize("text,content,calls", JSON_FORMS)
def test_json_form_calls_whole_and_streamed(text, content, calls):
    names = ("get_weather", "now")
    got_content, got = parse_tool_calls(text, names=names)
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got] == calls
    for pieces in ([text], list(text)):
        stream = ToolCallStream(names)
        deltas = [d for p in pieces for d in stream.feed(p)] + stream.finish()
        streamed, streamed_calls = collect(deltas)
        assert [(c["name"], c["arguments"]) for c in streamed_calls] == calls
        assert (streamed.strip() if calls else streamed) == (content or "")


def test_json_form_cut_off_is_dropped():
    content, calls = parse_tool_calls("Sure. " + FENCED[:30], truncated=True, names=("get_weather",))
    assert (content, calls) == ("Sure. ", [])
    assert parse_tool_calls("```js", truncated=True, names=("now",)) == (None, [])


@settings(max_examples=200, deadline=None)
@given(text=st.lists(st.sampled_from([FENCED, block("now", "{}"), '{"name": "now", "arguments": {}}', "```", "{",
                                      "}", '"name"', "json", "\n", " ", "text", '{"a": 1}']), max_size=8).map("".join),
       data=st.data())
def test_json_form_stream_does_not_depend_on_the_split(text, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    names = ("get_weather", "now")
    split, whole = ToolCallStream(names), ToolCallStream(names)
    a = collect([d for p in pieces for d in split.feed(p)] + split.finish())
    b = collect(whole.feed(text) + whole.finish())
    assert a[0] == b[0] and [(c["name"], c["arguments"]) for c in a[1]] == [(c["name"], c["arguments"]) for c in b[1]]


def test_an_object_with_more_than_a_call_stays_text():
    """Qwen2.5's system prompt shows a call as `{{"name": ...}}`; a model that echoes that, adding its
    own "response", wrote an answer, not a call."""
    text = '{{"name": "now", "arguments": {}, "response": "7Q-ALPHA-93"}}'
    assert parse_tool_calls(text, names=("now",)) == (text, [])
    stream = ToolCallStream(("now",))
    assert collect([d for c in text for d in stream.feed(c)] + stream.finish()) == (text, [])


def test_the_answer_format_is_told_once_a_tool_result_is_in():
    from specdec.server.tools import with_answer_format
    answer = StructuredOutput("json_schema", {"type": "object", "properties": {"code": {"type": "string"}}})
    first = [{"role": "user", "content": "code?"}]
    assert with_answer_format(first, answer) == first     # before any result: a call is the likely turn
    turn = first + [{"role": "assistant", "content": "", "tool_calls": []},
                    {"role": "tool", "tool_call_id": "c", "content": "7Q"}]
    told = with_answer_format(turn, answer)
    assert told[0]["role"] == "system" and '"code"' in told[0]["content"] and told[1:] == turn
    system = [{"role": "system", "content": "Be brief."}] + turn
    told = with_answer_format(system, StructuredOutput("json"))
    assert told[0]["content"].startswith("Be brief.\n\n") and "JSON object" in told[0]["content"]
    assert system[0]["content"] == "Be brief."            # the caller's messages are not changed
