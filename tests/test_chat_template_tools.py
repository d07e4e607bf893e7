"""The embedded checkpoints' chat templates render OpenAI tool calling in Qwen's (Hermes) format: a system
message listing the tools, assistant <tool_call> blocks and user turns of <tool_response> blocks; without
tools they render exactly what they did before tool calling was added."""

from __future__ import annotations

import pytest

from app.checkpoints.minicpmv_builder import MINICPMV_CHAT_TEMPLATE, MINICPMV_TOKENS
from app.checkpoints.model_builder import QWEN_FAMILIES, SPECIAL_TOKENS, build_checkpoint, build_tokenizer

FAMILIES = ("qwen3_vl", "qwen2_5_vl", "minicpmv")


def _tokenizer(family: str):
    """As the builders make it (model_builder._write_qwen, minicpmv_builder.write_minicpmv)."""
    if family == "minicpmv":
        tok = build_tokenizer(template=MINICPMV_CHAT_TEMPLATE, specials=SPECIAL_TOKENS + MINICPMV_TOKENS)
        tok.unk_token = "<unk>"
        return tok
    return build_tokenizer(template=QWEN_FAMILIES[family]["template"])


@pytest.fixture(scope="module")
def tokenizers():
    return {family: _tokenizer(family) for family in FAMILIES}


def render(tok, messages, **kwargs):
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


# Key order is the caller's (transformers' tojson does not sort keys) and neither non-ASCII nor HTML
# characters are escaped.
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Météo <à> & \"now\"",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "zoom", "parameters": {"type": "object",
                                                                     "properties": {"factor": {"type": "number"}}}}},
]
TOOLS_SYSTEM_BODY = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Météo <à> & \\"now\\"", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n'
    '{"type": "function", "function": {"name": "zoom", "parameters": {"type": "object", '
    '"properties": {"factor": {"type": "number"}}}}}\n'
    "</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n"
)

# (a) tools, a system message (text parts) and a user message with an image.
SYSTEM_AND_USER = [
    {"role": "system", "content": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Answer in French."}]},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is here?"}]},
]
WANT_SYSTEM_AND_USER = {
    "qwen3_vl": "<|im_start|>system\nBe brief.Answer in French.\n\n" + TOOLS_SYSTEM_BODY
    + "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is here?<|im_end|>\n<|im_start|>assistant\n",
    "qwen2_5_vl": "<|im_start|>system\nBe brief.Answer in French.\n\n" + TOOLS_SYSTEM_BODY
    + "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is here?<|im_end|>\n<|im_start|>assistant\n",
    "minicpmv": "<|im_start|>system\nBe brief.\nAnswer in French.\n\n" + TOOLS_SYSTEM_BODY
    + "<|im_start|>user\n(<image>./</image>)\nWhat is here?<|im_end|>\n<|im_start|>assistant\n",
}

# (b) tools without a system message: Qwen2.5-VL keeps its default system text before the tools.
USER_ONLY = [{"role": "user", "content": "hi"}]
WANT_USER_ONLY = {
    "qwen3_vl": "<|im_start|>system\n" + TOOLS_SYSTEM_BODY + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "qwen2_5_vl": "<|im_start|>system\nYou are a helpful assistant.\n\n" + TOOLS_SYSTEM_BODY
    + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "minicpmv": "<|im_start|>system\n" + TOOLS_SYSTEM_BODY + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
}

# (c) a tool-calling round trip: two calls (string and object arguments, no content), two responses.
ROUND_TRIP = [
    {"role": "user", "content": "Weather in Paris and Zürich?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Zürich", "unit": "C"}}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18°C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "12°C"},
                                                           {"type": "text", "text": ", rain"}]},
]
ROUND_TRIP_TURNS = {  # after the system message
    family: "<|im_start|>user\nWeather in Paris and Zürich?<|im_end|>\n"
    "<|im_start|>assistant\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "C"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\n18°C, sunny\n</tool_response>\n"
    f"<tool_response>\n{response}\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
    for family, response in [("qwen3_vl", "12°C, rain"), ("qwen2_5_vl", "12°C, rain"), ("minicpmv", "12°C\n, rain")]
}
WANT_ROUND_TRIP = {
    "qwen3_vl": "<|im_start|>system\n" + TOOLS_SYSTEM_BODY + ROUND_TRIP_TURNS["qwen3_vl"],
    "qwen2_5_vl": "<|im_start|>system\nYou are a helpful assistant.\n\n" + TOOLS_SYSTEM_BODY
    + ROUND_TRIP_TURNS["qwen2_5_vl"],
    "minicpmv": "<|im_start|>system\n" + TOOLS_SYSTEM_BODY + ROUND_TRIP_TURNS["minicpmv"],
}

# (d) no tools: what the templates rendered before tool calling (test_model_builder.py and
# test_llm_families.py pin single user messages; these add system, assistant, list and video content).
PLAIN = [
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "What?"},
                                  {"type": "image"}]},
     {"role": "assistant", "content": "A cat."},
     {"role": "user", "content": [{"type": "text", "text": "And"}, {"type": "video"}, {"type": "text", "text": " this?"}]}],
    [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "y"}}, {"type": "text", "text": "Describe."}]},
     {"role": "assistant", "content": [{"type": "text", "text": "A dog"}, {"type": "text", "text": " runs."}]},
     {"role": "user", "content": "Thanks"}],
    [{"role": "user", "content": "hi"}, {"role": "system", "content": [{"type": "text", "text": "late system"}]}],
]
WANT_PLAIN = {
    "qwen3_vl": [
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What?<|vision_start|><|image_pad|><|vision_end|>"
        "<|im_end|>\n<|im_start|>assistant\nA cat.<|im_end|>\n"
        "<|im_start|>user\nAnd<|vision_start|><|video_pad|><|vision_end|> this?<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>Describe.<|im_end|>\n"
        "<|im_start|>assistant\nA dog runs.<|im_end|>\n<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>system\nlate system<|im_end|>\n<|im_start|>assistant\n",
    ],
    "qwen2_5_vl": [
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What?<|vision_start|><|image_pad|><|vision_end|>"
        "<|im_end|>\n<|im_start|>assistant\nA cat.<|im_end|>\n"
        "<|im_start|>user\nAnd<|vision_start|><|video_pad|><|vision_end|> this?<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>Describe.<|im_end|>\n"
        "<|im_start|>assistant\nA dog runs.<|im_end|>\n<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>system\nlate system<|im_end|>\n<|im_start|>assistant\n",
    ],
    "minicpmv": [  # parts one per line; a video part renders nothing (the prompt builder sends them as images)
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\n(<image>./</image>)\nWhat?\n(<image>./</image>)<|im_end|>\n"
        "<|im_start|>assistant\nA cat.<|im_end|>\n"
        "<|im_start|>user\nAnd\n\n this?<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>user\n\nDescribe.<|im_end|>\n"
        "<|im_start|>assistant\nA dog\n runs.<|im_end|>\n<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>system\nlate system<|im_end|>\n<|im_start|>assistant\n",
    ],
}


@pytest.mark.parametrize("family", FAMILIES)
def test_tools_with_a_system_message(tokenizers, family):
    assert render(tokenizers[family], SYSTEM_AND_USER, tools=TOOLS) == WANT_SYSTEM_AND_USER[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_tools_without_a_system_message(tokenizers, family):
    assert render(tokenizers[family], USER_ONLY, tools=TOOLS) == WANT_USER_ONLY[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_tool_calls_and_responses(tokenizers, family):
    tok = tokenizers[family]
    assert render(tok, ROUND_TRIP, tools=TOOLS) == WANT_ROUND_TRIP[family]
    # the turns render the same without tools (only the tools' system message goes)
    default_system = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n" if family == "qwen2_5_vl" else ""
    assert render(tok, ROUND_TRIP) == default_system + ROUND_TRIP_TURNS[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_without_tools_the_rendering_is_unchanged(tokenizers, family):
    tok = tokenizers[family]
    for messages, want in zip(PLAIN, WANT_PLAIN[family]):
        assert render(tok, messages) == want
        assert render(tok, messages, tools=[]) == want  # an empty tool list is no tools
        assert render(tok, messages, tools=None) == want
        assert tok.apply_chat_template(messages, tokenize=False) == want.removesuffix("<|im_start|>assistant\n")


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl"])
def test_call_shapes_content_and_separate_tool_runs(tokenizers, family):
    """A call without the "function" wrapper, string arguments kept verbatim, content before the calls,
    and tool messages split by a user message: two user turns."""
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "zoom twice"},
        {"role": "assistant", "content": "Zooming.", "tool_calls": [{"name": "zoom", "arguments": '{"factor":2}'}]},
        {"role": "tool", "content": "ok"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "zoom",
                                                                                               "arguments": {}}}]},
        {"role": "tool", "content": "done"},
        {"role": "assistant", "content": "Zoomed."},
    ]
    assert render(tokenizers[family], messages, tools=TOOLS[1:]) == (
        "<|im_start|>system\nS\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "zoom", "parameters": {"type": "object", '
        '"properties": {"factor": {"type": "number"}}}}}\n</tools>\n\n'
        "For each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\nzoom twice<|im_end|>\n"
        '<|im_start|>assistant\nZooming.\n<tool_call>\n{"name": "zoom", "arguments": {"factor":2}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n"
        "<|im_start|>user\nagain<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "zoom", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\ndone\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nZoomed.<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("preset,family", [("tiny", "qwen3_vl"), ("tiny-qwen2.5-vl", "qwen2_5_vl"),
                                           ("tiny-minicpm-v-4.5", "minicpmv")])
def test_built_checkpoints_carry_the_template(tmp_path, preset, family):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(build_checkpoint(tmp_path / preset, preset, with_weights=False))
    assert render(tok, ROUND_TRIP, tools=TOOLS) == WANT_ROUND_TRIP[family]
    assert render(tok, PLAIN[0]) == WANT_PLAIN[family][0]
