"""Tool calling (app/api/tools.py): the request's tools checked, the model's call blocks parsed the same
whether streamed or whole, forced calls generated under a grammar, the prompt listing the tools."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from app.api.answer import Answer
from app.api.schemas import parse_chat_request
from app.api.tools import ToolCallStream, parse_tools, split_tool_calls, tool_grammar
from app.errors import ClientError

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
NOOP = {"type": "function", "function": {"name": "noop"}}
NAMES = frozenset({"get_weather", "noop"})
DEEP: dict = {}
for _ in range(300):
    DEEP = {"a": DEEP}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def call_text(name, args, raw=False) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args if raw else json.dumps(args)}}}\n</tool_call>'


# ------------------------------------------------------------------ the request
def test_tools_and_tool_choice_parse_into_a_spec():
    assert parse_tools({}) is None and parse_tools({"tools": []}) is None
    assert parse_tools({"tools": [WEATHER], "tool_choice": "none"}) is None  # ignored: not shown to the model
    assert parse_tools({"tool_choice": "auto"}) is None
    # off values of the legacy fields, and a null parallel_tool_calls, as clients send them
    assert parse_tools({"functions": [], "function_call": "none", "parallel_tool_calls": None, "tools": [NOOP]}).parallel
    spec = parse_tools({"tools": [WEATHER, NOOP]})
    assert (spec.choice, spec.parallel, spec.forced, spec.names) == ("auto", True, False, NAMES)
    spec = parse_tools({"tools": [WEATHER, NOOP], "tool_choice": "required", "parallel_tool_calls": False})
    assert (spec.choice, spec.parallel, spec.forced) == ("required", False, True)
    named = {"type": "function", "function": {"name": "noop"}}
    assert parse_tools({"tools": [WEATHER, NOOP], "tool_choice": named}).choice == "noop"


@pytest.mark.parametrize("extra,param,says", [
    ({"tools": "x"}, "tools", "must be a list"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools", "tools[0] must be"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools", "1-64"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools", "of an object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools",
     "of an object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 1}}]}, "tools", "description"),
    ({"tools": [NOOP, NOOP]}, "tools", "unique"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools", "at most 128"),
    ({"tool_choice": "required"}, "tool_choice", "requires 'tools'"),
    ({"tools": [NOOP], "tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tools": [NOOP], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice",
     "not among"),
    ({"tools": [NOOP], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nope"}}}}}], "tool_choice": "required"}, "tools", "invalid"),
    # what the template shows the model is checked as message text is, and bounded in depth
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "<|video_pad|>"}}]},
     "tools[0].function.description", "reserved vision marker"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"\ud800": {"type": "string"}}}}}]}, "tools[0].function.parameters.properties",
     "surrogate"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "x": DEEP}}}]},
     "tools", "nested deeper"),
    ({"tools": [NOOP], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
])
def test_bad_tools_are_a_400_naming_the_field(extra, param, says):
    with pytest.raises(ClientError) as e:
        parse_chat_request({"messages": USER} | extra, 16, 4)
    assert e.value.status == 400 and e.value.param == param and says in e.value.message


def test_a_conversation_with_earlier_calls_and_their_results_parses_for_the_template():
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C"},
        {"role": "tool", "content": [{"type": "text", "text": "rain"}]}]
    req = parse_chat_request({"messages": messages, "tools": [WEATHER]}, 16, 4)
    assert req.messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert req.messages[2] == {"role": "tool", "content": "12 C", "tool_call_id": "call_1"}
    no_args = [{"role": "assistant", "tool_calls": [{"function": {"name": "noop", "arguments": None}}]}]
    assert parse_chat_request({"messages": no_args}, 16, 4).messages[0]["tool_calls"][0]["function"]["arguments"] == "{}"
    assert req.messages[3] == {"role": "tool", "content": [{"type": "text", "text": "rain"}]}
    for bad, param in [({"role": "user", "content": "x", "tool_calls": []}, "messages[0].tool_calls"),
                       ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
                        "messages[0].tool_calls[0]"),
                       ({"role": "assistant", "tool_calls": [
                           {"function": {"name": "f", "arguments": "<|image_pad|>"}}]},
                        "messages[0].tool_calls[0].function.arguments"),
                       ({"role": "tool", "content": "x", "tool_call_id": 1}, "messages[0].tool_call_id"),
                       ({"role": "assistant", "tool_calls": [{"function": {"name": 'f", "x": "'}}]},
                        "messages[0].tool_calls[0]")]:
        with pytest.raises(ClientError) as e:
            parse_chat_request({"messages": [bad]}, 16, 4)
        assert e.value.param == param


# ------------------------------------------------------------------ the model's text
TEXTS = {
    "one call": (call_text("get_weather", {"city": "Paris", "days": 2}),
                 None, [("get_weather", {"city": "Paris", "days": 2})]),
    "text, then two calls": ("Let me check.\n" + call_text("get_weather", {"city": "Oslo", "days": 1}) + "\n"
                             + call_text("noop", {}), "Let me check.",
                             [("get_weather", {"city": "Oslo", "days": 1}), ("noop", {})]),
    "no call": ("Just text <tool and </tool_call> and <", "Just text <tool and </tool_call> and <", []),
    "unknown tool stays text": (call_text("rm_rf", {}), call_text("rm_rf", {}), []),
    "bad JSON stays text": ("a " + call_text("noop", "{oops", raw=True) + " b",
                            "a " + call_text("noop", "{oops", raw=True) + " b", []),
    "unclosed whole call": ('<tool_call>\n{"name": "noop", "arguments": {}}', None, [("noop", {})]),
    "unclosed cut call": ('ok <tool_call>\n{"name": "noop", "argu', 'ok <tool_call>\n{"name": "noop", "argu', []),
    "string arguments kept": ('<tool_call>{"name": "noop", "arguments": "{\\"x\\":1}"}</tool_call>', None,
                              [("noop", '{"x":1}')]),
    "text between calls": (call_text("noop", {}) + "\nthen\n" + call_text("noop", {"a": "é"}) + "\n",
                           "then", [("noop", {}), ("noop", {"a": "é"})]),
    "a close tag inside an argument": (call_text("noop", {"q": "a</tool_call>b"}) + " done", "done",
                                       [("noop", {"q": "a</tool_call>b"})]),
    "arguments not an object stay text": (call_text("noop", '"s"', raw=True), call_text("noop", '"s"', raw=True), []),
    "string arguments not an object stay text": (call_text("noop", '"[1]"', raw=True),
                                                 call_text("noop", '"[1]"', raw=True), []),
    "a prose block, then a call": ("<tool_call>\nI will call it now\n</tool_call>\nOk. " + call_text("noop", {}),
                                   "<tool_call>\nI will call it now\n</tool_call>\nOk.", [("noop", {})]),
    "a call with junk after it in its block, then a call": (
        '<tool_call>{"name": "noop", "arguments": {}} extra</tool_call> ' + call_text("noop", {"b": 1}),
        '<tool_call>{"name": "noop", "arguments": {}} extra</tool_call>', [("noop", {"b": 1})]),
    "null arguments are an empty object": ('<tool_call>{"name": "noop", "arguments": null}</tool_call>', None,
                                           [("noop", {})]),
    "a closed block never whole stays text": ("x " + call_text("noop", '{"q": "</tool_call>', raw=True) + " y",
                                              "x " + call_text("noop", '{"q": "</tool_call>', raw=True) + " y", []),
}


def _calls(calls):
    return [(c["function"]["name"], c["function"]["arguments"] if c["function"]["arguments"].startswith('{"x"')
             else json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("name", TEXTS)
def test_call_blocks_become_tool_calls_and_the_rest_content(name):
    text, content, calls = TEXTS[name]
    got_content, got_calls = split_tool_calls(text, NAMES)
    assert got_content == content and _calls(got_calls) == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got_calls)
    assert len({c["id"] for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("name", TEXTS)
def test_streamed_in_any_pieces_the_deltas_add_up_to_the_whole_answer(name):
    text, content, calls = TEXTS[name]
    rng = random.Random(name)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stream = ToolCallStream(NAMES)
        deltas = [d for p in pieces for d in stream.feed(p)] + stream.finish()
        assert "".join(d.get("content", "") for d in deltas) == (content or "")
        got = [c for d in deltas for c in d.get("tool_calls", [])]
        assert [c["index"] for c in got] == list(range(len(calls))) and stream.calls == len(calls)
        assert _calls(got) == calls
        assert all(d.get("content") != "" for d in deltas)  # no empty deltas


def test_many_close_tags_inside_a_string_end_the_block_after_a_bound():
    """Each close tag inside an argument string costs a parse of the block so far; past
    MAX_CLOSE_TAGS_IN_STRINGS the next one ends the block (as text), so a hostile answer cannot hold
    the Router's thread, and no text is lost."""
    from app.api.tools import MAX_CLOSE_TAGS_IN_STRINGS

    inner = "x</tool_call>" * (MAX_CLOSE_TAGS_IN_STRINGS + 5)
    text = call_text("noop", {"q": inner}) + " tail " + call_text("noop", {})
    content, calls = split_tool_calls(text, NAMES)
    assert _calls(calls) == [("noop", {})] and content == text[:text.rindex("<tool_call>")].strip()
    few = call_text("noop", {"q": "x</tool_call>" * MAX_CLOSE_TAGS_IN_STRINGS})
    assert _calls(split_tool_calls(few, NAMES)[1]) == [("noop", {"q": "x</tool_call>" * MAX_CLOSE_TAGS_IN_STRINGS})]


def test_a_whole_answer_reports_its_calls_with_the_tool_calls_finish():
    """The server's and batch jobs' chat.completion (app/api/answer.py): content null, tool_calls, and
    "tool_calls" as the finish where the model stopped; "length" stays."""
    req = parse_chat_request({"messages": USER, "tools": [WEATHER, NOOP]}, 16, 4)
    gen = {"image_tokens": 0, "video_tokens": 0}
    for finish, want in (("stop", "tool_calls"), ("length", "length")):
        answer = Answer(1)
        text = call_text("noop", {})
        for k, piece in enumerate((text[:9], text[9:])):
            answer.add({"text": piece, "token_ids": [], "finish_reason": finish if k else None, "prompt_tokens": 5,
                        "completion_tokens": 7, "vision_embeddings": 0})
        c = answer.response(req, "m", gen)["choices"][0]
        assert c["finish_reason"] == want and c["message"]["content"] is None
        assert [t["function"] for t in c["message"]["tool_calls"]] == [{"name": "noop", "arguments": "{}"}]
    plain = parse_chat_request({"messages": USER}, 16, 4)  # no tools: the text as it is, no tool_calls key
    answer = Answer(1)
    answer.add({"text": text, "token_ids": [], "finish_reason": "stop", "prompt_tokens": 5, "completion_tokens": 7,
                "vision_embeddings": 0})
    assert answer.response(plain, "m", gen)["choices"][0]["message"] == {"role": "assistant", "content": text}


# ------------------------------------------------------------------ forced calls
def _matcher(grammar, tokenizer):
    import llguidance
    import llguidance.hf

    return llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer)), grammar, log_level=0)


def _accepts(grammar, tokenizer, text) -> bool:
    m = _matcher(grammar, tokenizer)
    return all(m.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) and m.is_accepting()


def test_a_forced_choice_allows_only_calls_whose_arguments_follow_the_schema(world):
    tok = world["tok"]
    tools = {"tools": [WEATHER, NOOP]}
    required = tool_grammar(parse_tools(tools | {"tool_choice": "required"}))
    one = tool_grammar(parse_tools(tools | {"tool_choice": "required", "parallel_tool_calls": False}))
    named = tool_grammar(parse_tools(tools | {"tool_choice": {"type": "function", "function": {"name": "noop"}}}))
    weather = call_text("get_weather", '{"city":"Paris","days":2}', raw=True)
    assert _accepts(required, tok, weather) and _accepts(one, tok, weather) and not _accepts(named, tok, weather)
    assert _accepts(required, tok, weather + "\n" + call_text("noop", "{}", raw=True))
    assert not _accepts(one, tok, weather + "\n" + call_text("noop", "{}", raw=True))
    assert _accepts(named, tok, call_text("noop", "{}", raw=True))
    for bad in ('{"city":"Paris"}', '{"city":"Paris","days":9}', '{"city":"Paris","days":2,"x":1}',
                '{"city": "Paris", "days": 2}'):  # missing, out of range, extra, loose whitespace
        assert not _accepts(required, tok, call_text("get_weather", bad, raw=True)), bad
    assert not _accepts(required, tok, "Sure! " + weather)
    assert tool_grammar(parse_tools(tools)) is None  # auto: free text
    # arguments in the schema's property order (as the model sees the tool), not sorted
    ordered = {"type": "function", "function": {"name": "search", "parameters": {
        "type": ["object", "null"], "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
        "required": ["query", "limit"], "additionalProperties": False}}}
    g = tool_grammar(parse_tools({"tools": [ordered], "tool_choice": "required"}))
    assert _accepts(g, tok, call_text("search", '{"query":"x","limit":1}', raw=True))
    assert not _accepts(g, tok, call_text("search", '{"limit":1,"query":"x"}', raw=True))


def test_forced_calls_name_the_tags_as_tokens_where_the_vocabulary_has_them(world):
    """Qwen's real tokenizers have <tool_call> and </tool_call> as tokens of their own, which llguidance
    treats as special: a grammar with the tags as text refuses them, so the model would have to spell
    the tag in pieces. With the tags as tokens the grammar takes exactly Qwen's encoding of a call."""
    import copy

    from app.api.tools import has_tag_tokens

    tok = copy.deepcopy(world["tok"])
    assert not has_tag_tokens(tok)
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    assert has_tag_tokens(tok)
    spec = parse_tools({"tools": [WEATHER, NOOP], "tool_choice": "required"})
    text = call_text("noop", "{}", raw=True)
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<tool_call>") and ids[-1] == tok.convert_tokens_to_ids("</tool_call>")
    assert _accepts(tool_grammar(spec, tag_tokens=True), tok, text)
    assert not _accepts(tool_grammar(spec), tok, text)  # the tags as text: the single tokens are refused
    assert parse_chat_request({"messages": USER, "tools": [NOOP], "tool_choice": "required"}, 16, 4,
                              tool_tags=True).params.grammar == tool_grammar(
        parse_tools({"tools": [NOOP], "tool_choice": "required"}), tag_tokens=True)


def test_forced_calls_from_the_engine_are_valid_calls_streamed_and_whole(world, tiny_checkpoint):
    """End to end in one process (ChatService over the local backend): the random-weight model answers a
    forced choice with a call whose arguments follow the schema, finishing "tool_calls"; the stream's
    deltas carry the same call; a prompt lists the tools (the template's header and the tool's JSON)."""
    from app.config import AppConfig
    from helpers import local_chat

    chat = local_chat(AppConfig(model="embedded:tiny"), tiny_checkpoint)

    async def run(body):
        req, gen, payload = await chat.prepare(body)
        whole = await chat.complete(req, gen, payload)
        req, gen, payload = await chat.prepare(body | {"stream": True})
        events = [e async for e in await chat.open_stream(req, gen, payload)]
        return gen, whole, events

    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        body = {"messages": USER, "tools": [WEATHER, NOOP], "tool_choice": choice, "max_tokens": 300,
                "temperature": 0, "parallel_tool_calls": False}
        gen, whole, events = asyncio.run(run(body))
        c = whole["choices"][0]
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
        (call,) = c["message"]["tool_calls"]
        args = json.loads(call["function"]["arguments"])
        if call["function"]["name"] == "get_weather":
            assert set(args) == {"city", "days"} and len(args["city"]) <= 12 and 1 <= args["days"] <= 7
        else:
            assert choice == "required" and call["function"]["name"] == "noop"
        chunks = [json.loads(e[6:]) for part in events for e in part.split("\n\n") if e.startswith("data: {")]
        streamed = [t for ch in chunks for d in ch["choices"] for t in d["delta"].get("tool_calls", [])]
        assert [(t["index"], t["function"]) for t in streamed] == [(0, call["function"])]
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        prompt = chat.prompts.tok.decode(gen["input_ids"])
        assert "# Tools" in prompt and json.dumps(WEATHER, ensure_ascii=False) in prompt


def test_a_template_that_does_not_render_tools_is_a_400(world):
    from app.api.prompt import PromptBuilder

    class NoTools:  # a checkpoint whose chat template ignores tools would drop them silently
        chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        name_or_path = None

        def __getattr__(self, name):
            return getattr(world["tok"], name)

    with pytest.raises(ClientError) as e:
        PromptBuilder(NoTools()).build(USER, [], tools=[WEATHER])
    assert e.value.param == "tools" and e.value.code == "unsupported_parameter"
    assert PromptBuilder(NoTools()).build(USER, []).input_ids  # without tools it renders as before
