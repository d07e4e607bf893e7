import pytest

from app.api.schemas import parse_chat_request
from app.errors import ClientError


def parse(body):
    return parse_chat_request(body, default_max_tokens=16, max_items=3)


def test_string_and_part_contents_interleaved():
    req = parse({"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "data:x"}},
                                     {"type": "text", "text": "b"}, {"type": "video_url", "video_url": {"url": "http://v"}},
                                     {"type": "image_url", "image_url": "data:y"}]}],
        "max_completion_tokens": 5, "temperature": 0, "top_p": 0.5, "seed": 7, "stop": "END", "stream": True,
        "stream_options": {"include_usage": True}})
    assert [m["type"] for m in req.messages[1]["content"]] == ["text", "image", "text", "video", "image"]
    assert [(r.kind, r.url) for r in req.media] == [("image", "data:x"), ("video", "http://v"), ("image", "data:y")]
    assert req.media[1].param == "messages[1].content[3].video_url"
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.stop) == (5, 0, 0.5, 7, ["END"])
    assert req.stream and req.include_usage


def test_defaults():
    req = parse({"messages": [{"role": "user", "content": "hi"}]})
    assert req.params.max_tokens == 16 and req.params.temperature == 1.0 and not req.stream
    assert req.params.logprobs is None


@pytest.mark.parametrize("fields,want", [({"logprobs": True}, 0), ({"logprobs": True, "top_logprobs": 20}, 20),
                                         ({"logprobs": True, "top_logprobs": 0}, 0), ({"logprobs": False}, None),
                                         ({"top_logprobs": None}, None), ({"logprobs": None}, None)])
def test_logprobs_and_top_logprobs(fields, want):
    assert parse({"messages": [{"role": "user", "content": "hi"}], **fields}).params.logprobs == want


@pytest.mark.parametrize("body,param", [
    ([], None),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].image_url.url"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 65}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 1.5}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": [1]}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 1.5}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "d"}] * 4}]}, "messages"),
    ({"messages": [{"role": "assistant", "content": [{"type": "image_url", "image_url": "d"}]}]},
     "messages[0].content[0].type"),
])
def test_client_mistakes_name_their_param(body, param):
    with pytest.raises(ClientError) as e:
        parse(body)
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": "a\ud800b"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:\ud83d,x"}}]}]},
    {"messages": [{"role": "user", "content": "hi"}], "stop": ["\ud800"]},
    {"messages": [{"role": "user", "content": "hi"}], "model": "\udc00"},
])
def test_lone_surrogates_are_a_400(body):
    """The standard library's JSON parser (used for bracket-heavy bodies) keeps lone surrogates from
    '\\ud800' escapes; the tokenizer raised a TypeError on them."""
    with pytest.raises(ClientError) as e:
        parse_chat_request(body, 16, 4)
    assert e.value.status == 400 and e.value.code == "invalid_unicode"


@pytest.mark.parametrize("field,value", [("model", 7), ("stream_options", []), ("stream_options", {"include_usage": 1}),
                                         ("ignore_eos", "yes")])
def test_wrong_types_of_lenient_fields_are_a_400(field, value):
    with pytest.raises(ClientError) as e:
        parse_chat_request({"messages": [{"role": "user", "content": "hi"}], field: value}, 16, 4)
    assert e.value.status == 400 and e.value.param == field


@pytest.mark.parametrize("text", ["<|image_pad|>", "see <|vision_start|><|video_pad|><|vision_end|>", "<|vision_end|>"])
def test_vision_markers_in_message_text_are_a_400(text):
    """The tokenizer reads them as special tokens: forged placeholders made the prompt builder fail (500)."""
    for content in (text, [{"type": "text", "text": text}]):
        with pytest.raises(ClientError) as e:
            parse_chat_request({"messages": [{"role": "system", "content": content}]}, 16, 4)
        assert e.value.status == 400 and e.value.code == "reserved_token"
    assert parse_chat_request({"messages": [{"role": "user", "content": "<|im_start|> and <|x|>"}]}, 16, 4)


X = {"messages": [{"role": "user", "content": "x"}]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("extra,param", [
    ({"functions": [TOOL["function"]]}, "functions"),  # the legacy form of tools (tools: app/api/tools.py)
    ({"function_call": "auto"}, "function_call"),
    ({"logit_bias": {"50256": -100}}, "logit_bias"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
])
def test_parameters_that_would_be_silently_ignored_are_a_400(extra, param):
    with pytest.raises(ClientError) as e:
        parse(X | extra)
    assert (e.value.status, e.value.param, e.value.code) == (400, param, "unsupported_parameter")


@pytest.mark.parametrize("extra", [
    {"tools": [TOOL], "tool_choice": "none"}, {"tools": []}, {"tool_choice": "auto"}, {"tool_choice": "none"},
    {"response_format": {"type": "text"}}, {"logit_bias": {}}, {"modalities": ["text"]},
    {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "parallel_tool_calls": True},
])
def test_their_off_values_and_labels_are_accepted(extra):
    assert parse(X | extra).messages == [{"role": "user", "content": "x"}]


def test_openai_client_details_found_in_review():
    """An unset max_completion_tokens sent as null falls back to max_tokens (it took the server's
    default); stop strings are at most 1,024 characters (each is matched at every chunk: one of 200k
    held an LLM replica's event loop for seconds); stream_options without stream is a 400, as OpenAI's."""
    base = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat_request(base | {"max_tokens": 100, "max_completion_tokens": None}, 16, 4).params.max_tokens == 100
    assert parse_chat_request(base | {"stop": "x" * 1024}, 16, 4).params.stop == ["x" * 1024]
    for body, param in ((base | {"stop": ["ok", "x" * 1025]}, "stop"),
                        (base | {"stream_options": {"include_usage": True}}, "stream_options")):
        with pytest.raises(ClientError) as e:
            parse_chat_request(body, 16, 4)
        assert (e.value.status, e.value.param) == (400, param)
