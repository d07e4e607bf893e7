"""A drop-in for vLLM's OpenAI server, at the API: omitted sampling parameters take the checkpoint's
generation config (or OpenAI's defaults), and every parameter of OpenAI's chat-completions API and of
vLLM's extensions is honoured or refused by name; unknown names are logged once and counted, or
refused. Requests go through the whole in-process pipeline (ChatService over the tiny model)."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest

from app.api.chat import ChatService
from app.api.defaults import OPENAI_DEFAULTS, from_generation_config, load_sampling_defaults
from app.api.params import HONOURED, KNOWN, LABELS, REFUSED
from app.api.schemas import ServerContext, parse_chat_request
from app.checkpoints.checkpoint_tokenizer import GENERATION_DEFAULTS
from app.config import AppConfig
from app.errors import ClientError
from app.media.decode import sample_indices
from app.media.preprocess import smart_resize
from helpers import mp4_bytes, png_bytes, sse_data, world_chat

USER = [{"role": "user", "content": "Tell me a story"}]
BASE = {"messages": USER, "max_tokens": 6, "temperature": 0}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def encoder(tiny_checkpoint):
    from app.vision.service import EncoderService

    return EncoderService(AppConfig(model=str(tiny_checkpoint)), str(tiny_checkpoint))


@pytest.fixture(scope="module")
def chat(world, encoder):
    return world_chat(world, encoder)


events = sse_data


def run(chat: ChatService, body: dict):
    """SimpleNamespace(req, gen, out) (out: the answer, or a stream's events), or the ClientError."""
    async def go():
        req, gen, payload = await chat.prepare(body)
        if req.stream:
            writes = [w async for w in await chat.open_stream(req, gen, payload)]
            return SimpleNamespace(req=req, gen=gen, out=events(writes))
        return SimpleNamespace(req=req, gen=gen, out=await chat.complete(req, gen, payload))

    try:
        return asyncio.run(go())
    except ClientError as e:
        return e


def ok(r) -> SimpleNamespace:
    assert not isinstance(r, ClientError), f"{r.code}: {r.message}"
    return r


def content(r) -> str:
    return ok(r).out["choices"][0]["message"]["content"]


def prompt_text(world, r) -> str:
    return world["tok"].decode(ok(r).gen["input_ids"])


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


IMAGE = {"type": "image_url", "image_url": {"url": data_url(png_bytes(256, 384, seed=2), "image/png")}}
VIDEO = {"type": "video_url", "video_url": {"url": data_url(mp4_bytes(32, fps=4, seed=5), "video/mp4")}}


@pytest.fixture(scope="module")
def base(chat):
    """The greedy answer to BASE: its text and token ids (return_tokens_as_token_ids writes them)."""
    r = ok(run(chat, BASE | {"logprobs": True, "return_tokens_as_token_ids": True}))
    ids = [int(e["token"].removeprefix("token_id:")) for e in r.out["choices"][0]["logprobs"]["content"]]
    text = r.out["choices"][0]["message"]["content"]
    assert len(ids) == 6 and len(text) >= 4
    return SimpleNamespace(text=text, ids=ids, prompt=r.gen["input_ids"])


# ---------------------------------------------------------------- sampling defaults
def test_the_embedded_checkpoint_ships_qwen3_vl_instruct_sampling(tiny_checkpoint):
    config = json.loads((tiny_checkpoint / "generation_config.json").read_text())
    assert {k: config[k] for k in GENERATION_DEFAULTS} == GENERATION_DEFAULTS
    assert GENERATION_DEFAULTS == {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                   "repetition_penalty": 1.0}


def test_omitted_sampling_parameters_take_the_checkpoint_s_generation_config(chat):
    p = ok(run(chat, {"messages": USER, "max_tokens": 2})).gen["params"]
    assert (p["temperature"], p["top_p"], p["top_k"], p["repetition_penalty"], p["min_p"]) == (0.7, 0.8, 20, 1.0, 0.0)
    # what a request gives wins, parameter by parameter
    p = ok(run(chat, {"messages": USER, "max_tokens": 2, "temperature": 1.0, "top_k": -1})).gen["params"]
    assert (p["temperature"], p["top_p"], p["top_k"]) == (1.0, 0.8, 0)
    p = ok(run(chat, {"messages": USER, "max_tokens": 2, "temperature": None, "top_p": 1.0})).gen["params"]
    assert (p["temperature"], p["top_p"]) == (0.7, 1.0)


def test_sampling_defaults_openai_gives_openai_s_defaults(world, encoder):
    chat = world_chat(world, encoder, sampling_defaults="openai")
    p = ok(run(chat, {"messages": USER, "max_tokens": 2})).gen["params"]
    assert (p["temperature"], p["top_p"], p["top_k"], p["repetition_penalty"], p["min_p"]) == (1.0, 1.0, 0, 1.0, 0.0)
    assert chat.model_card()["sampling_defaults"] == {"source": "openai", **OPENAI_DEFAULTS, "max_tokens": 256}


def test_models_lists_the_defaults_in_force(chat):
    card = chat.model_card()
    assert card["object"] == "model" and card["id"] == chat.cfg.model_name and card["max_model_len"] == 8192
    assert card["sampling_defaults"] == {"source": "generation_config.json", "temperature": 0.7, "top_p": 0.8,
                                         "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.0, "max_tokens": 256}


def test_generation_config_reading_follows_vllm(tmp_path, caplog):
    """Only values other than transformers' defaults count (top_k 50 is its default), do_sample is not
    read, max_new_tokens caps the default max_tokens, and values no request could send are dropped."""
    d = from_generation_config({"do_sample": False, "temperature": 0.3, "top_k": 50, "top_p": 1.0, "min_p": 0.05,
                                "repetition_penalty": 1.05, "max_new_tokens": 100})
    assert d.values == {"temperature": 0.3, "top_p": 1.0, "top_k": 0, "min_p": 0.05, "repetition_penalty": 1.05}
    assert d.default_max_tokens(256) == 100 and d.default_max_tokens(64) == 64
    req = parse_chat_request({"messages": USER}, 256, 4, server=ServerContext(defaults=d))
    assert (req.params.max_tokens, req.params.temperature, req.params.min_p) == (100, 0.3, 0.05)
    assert parse_chat_request({"messages": USER, "max_tokens": 300}, 256, 4,
                              server=ServerContext(defaults=d)).params.max_tokens == 300
    with caplog.at_level(logging.WARNING):
        d = from_generation_config({"temperature": 5.0, "top_k": -1, "top_p": 0})
    assert d.values == OPENAI_DEFAULTS and "temperature" in caplog.text
    assert load_sampling_defaults(tmp_path).source == "openai"  # no generation_config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "top_k": 5}))
    got = load_sampling_defaults(tmp_path)
    assert got.source == "generation_config.json" and got["top_k"] == 5 and got["temperature"] == 1.0
    assert load_sampling_defaults(tmp_path, "openai").source == "openai"


# ---------------------------------------------------------------- every parameter: honoured or refused
def _params(r) -> dict:
    return ok(r).gen["params"]


def _refused(name):
    def check(r, world, base):
        assert isinstance(r, ClientError), f"{name} was not refused"
        assert (r.status, r.code, r.param) == (400, "unsupported_parameter", name), (r.code, r.param, r.message)
    return check


def _label(r, world, base):
    assert content(r) == base.text  # accepted; the answer is what it is without it


def _stop_text(base) -> str:
    return base.text[2:4]


def _tokens(hw: tuple[int, int]) -> int:
    return hw[0] * hw[1] // 32 ** 2


def _first_new(ids: list[int]) -> int:
    """The first index past 0 whose id did not come before it."""
    return next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])


# name -> (what the request adds to BASE, how the answer shows it was honoured or refused)
HONOURED_CASES = {
    "messages": ({"messages": [{"role": "user", "content": "Hi there"}]},
                 lambda r, w, b: "Hi there" in prompt_text(w, r)),
    # one model is served, whatever a request names (as before): the answer names it
    "model": ({"model": "any-name"}, lambda r, w, b: ok(r).out["model"] == Path(w["tok"].name_or_path).name),
    "max_tokens": ({"max_tokens": 3, "ignore_eos": True}, lambda r, w, b: ok(r).out["usage"]["completion_tokens"] == 3),
    "max_completion_tokens": ({"max_completion_tokens": 2, "ignore_eos": True},
                              lambda r, w, b: ok(r).out["usage"]["completion_tokens"] == 2),
    "temperature": ({"temperature": 0.5}, lambda r, w, b: _params(r)["temperature"] == 0.5),
    "top_p": ({"top_p": 0.5}, lambda r, w, b: _params(r)["top_p"] == 0.5),
    "frequency_penalty": ({"frequency_penalty": 1.5}, lambda r, w, b: _params(r)["frequency_penalty"] == 1.5),
    "presence_penalty": ({"presence_penalty": -1.0}, lambda r, w, b: _params(r)["presence_penalty"] == -1.0),
    "seed": ({"seed": 11, "temperature": 1.0}, lambda r, w, b: _params(r)["seed"] == 11),
    "stop": (None, lambda r, w, b: content(r) == b.text[:b.text.find(_stop_text(b))]),
    "n": ({"n": 2}, lambda r, w, b: len(ok(r).out["choices"]) == 2),
    "stream": ({"stream": True}, lambda r, w, b: ok(r).out[-1] == "[DONE]"
               and "".join(e["choices"][0]["delta"].get("content", "") for e in ok(r).out[:-1]) == b.text),
    "stream_options": ({"stream": True, "stream_options": {"include_usage": True}},
                       lambda r, w, b: ok(r).out[-2]["usage"]["completion_tokens"] == 6),
    "logprobs": ({"logprobs": True}, lambda r, w, b: len(ok(r).out["choices"][0]["logprobs"]["content"]) == 6),
    "top_logprobs": ({"logprobs": True, "top_logprobs": 3},
                     lambda r, w, b: all(len(e["top_logprobs"]) == 3
                                         for e in ok(r).out["choices"][0]["logprobs"]["content"])),
    "response_format": ({"response_format": {"type": "json_object"}}, lambda r, w, b: _params(r)["grammar"]),
    "tools": ({"tools": [WEATHER]}, lambda r, w, b: "get_weather" in prompt_text(w, r)),
    "tool_choice": ({"tools": [WEATHER], "tool_choice": "required"}, lambda r, w, b: _params(r)["grammar"]),
    "parallel_tool_calls": ({"tools": [WEATHER], "parallel_tool_calls": False},
                            lambda r, w, b: ok(r).req.tools.parallel is False),
    "top_k": ({"top_k": -1, "temperature": 1.0}, lambda r, w, b: _params(r)["top_k"] == 0),
    "min_p": ({"min_p": 0.1}, lambda r, w, b: _params(r)["min_p"] == 0.1),
    "repetition_penalty": ({"repetition_penalty": 1.2}, lambda r, w, b: _params(r)["repetition_penalty"] == 1.2),
    "min_tokens": (None, lambda r, w, b: ok(r).out["usage"]["completion_tokens"] == 6),
    "stop_token_ids": (None, None),  # built from the base answer's ids (_case)
    "ignore_eos": ({"ignore_eos": True}, lambda r, w, b: _params(r)["ignore_eos"] is True),
    "skip_special_tokens": ({"skip_special_tokens": False}, lambda r, w, b: _params(r)["skip_special_tokens"] is False),
    "spaces_between_special_tokens": ({"spaces_between_special_tokens": False}, lambda r, w, b: content(r) == b.text),
    "include_stop_str_in_output": (None, lambda r, w, b: content(r) == b.text[:b.text.find(_stop_text(b)) + 2]),
    "chat_template_kwargs": ({"chat_template_kwargs": {"add_generation_prompt": False}},
                             lambda r, w, b: not prompt_text(w, r).endswith("<|im_start|>assistant\n")
                             and prompt_text(w, r).endswith("Tell me a story<|im_end|>\n")),
    "add_generation_prompt": ({"add_generation_prompt": False},
                              lambda r, w, b: prompt_text(w, r).endswith("<|im_end|>\n")
                              and ok(r).out["choices"][0]["message"]["role"] == "user"),
    "continue_final_message": ({"messages": USER + [{"role": "assistant", "content": "Once upon"}],
                                "add_generation_prompt": False, "continue_final_message": True},
                               lambda r, w, b: prompt_text(w, r).endswith("<|im_start|>assistant\nOnce upon")),
    "add_special_tokens": ({"add_special_tokens": True}, lambda r, w, b: ok(r).gen["input_ids"] == b.prompt),
    "documents": ({"documents": [{"title": "a", "text": "b"}]}, _refused("documents")),  # this template has none
    "mm_processor_kwargs": ({"messages": [{"role": "user", "content": [IMAGE]}],
                             "mm_processor_kwargs": {"max_pixels": 65536}},
                            lambda r, w, b: ok(r).out["usage"]["prompt_tokens_details"]["image_tokens"]
                            == _tokens(smart_resize(256, 384, 32, 65536, 65536))),
    "echo": ({"messages": USER + [{"role": "assistant", "content": "Once upon"}], "add_generation_prompt": False,
              "continue_final_message": True, "echo": True},
             lambda r, w, b: content(r).startswith("Once upon") and len(content(r)) > len("Once upon")),
    "request_id": ({"request_id": "my-id-7"}, lambda r, w, b: ok(r).out["id"] == "chatcmpl-my-id-7"),
    "return_tokens_as_token_ids": ({"logprobs": True, "return_tokens_as_token_ids": True},
                                   lambda r, w, b: [e["token"] for e in ok(r).out["choices"][0]["logprobs"]["content"]]
                                   == [f"token_id:{i}" for i in b.ids]),
    "structured_outputs": ({"structured_outputs": {"choice": ["yes", "no"]}, "max_tokens": 8},
                           lambda r, w, b: content(r) in ("yes", "no")),
    "guided_json": ({"guided_json": {"type": "object"}}, lambda r, w, b: _params(r)["grammar"]),
    "guided_regex": ({"guided_regex": "[ab]{3}", "max_tokens": 8}, lambda r, w, b: re.fullmatch("[ab]{3}", content(r))),
    "guided_choice": ({"guided_choice": ["left", "right"], "max_tokens": 8},
                      lambda r, w, b: content(r) in ("left", "right")),
    "guided_grammar": ({"guided_grammar": 'start: "hi" " " "there"', "max_tokens": 16},
                       lambda r, w, b: content(r) == "hi there"),
}
LABEL_VALUES = {"user": "u-1", "metadata": {"k": "v"}, "store": True, "service_tier": "auto",
                "safety_identifier": "s-1", "prompt_cache_key": "ck"}
REFUSED_VALUES = {
    "logit_bias": {"5": 1}, "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"},
    "prediction": {"type": "content", "content": "x"}, "functions": [{"name": "f"}], "function_call": "auto",
    "reasoning_effort": "low", "verbosity": "low", "web_search_options": {}, "prompt_cache_retention": "24h",
    "best_of": 2, "use_beam_search": True, "length_penalty": 0.5, "priority": 1, "truncate_prompt_tokens": 5,
    "prompt_logprobs": 1, "logits_processors": ["x"], "allowed_token_ids": [1, 2], "bad_words": ["x"],
    "chat_template": "{{ messages }}", "return_token_ids": True, "cache_salt": "s", "kv_transfer_params": {},
    "vllm_xargs": {"a": 1}, "include_reasoning": False, "guided_decoding_backend": "xgrammar",
    "guided_whitespace_pattern": " ", "structural_tag": "{}",
}
OFF_VALUES = {
    "logit_bias": {}, "modalities": ["text"], "functions": [], "function_call": "none", "prompt_cache_retention":
    "in_memory", "best_of": 1, "use_beam_search": False, "length_penalty": 1.0, "priority": 0, "logits_processors": [],
    "bad_words": [], "return_token_ids": False, "include_reasoning": True,
}


def _case(name, base):
    if name in HONOURED_CASES:
        extra, check = HONOURED_CASES[name]
        if name == "stop":
            extra = {"stop": [_stop_text(base)]}
        elif name == "include_stop_str_in_output":
            extra = {"stop": [_stop_text(base)], "include_stop_str_in_output": True}
        elif name == "min_tokens":
            extra = {"min_tokens": 6, "stop_token_ids": [base.ids[1]]}  # the stop id is held back to the end
        elif name == "stop_token_ids":
            i = _first_new(base.ids)
            extra = {"stop_token_ids": [base.ids[i]]}
            check = (lambda i: lambda r, w, b: ok(r).out["usage"]["completion_tokens"] == i
                     and ok(r).out["choices"][0]["finish_reason"] == "stop" and content(r) == w["tok"].decode(b.ids[:i]))(i)
        return extra, check
    if name in LABELS:
        return {name: LABEL_VALUES[name]}, _label
    return {name: REFUSED_VALUES[name]}, _refused(name)


def test_every_known_parameter_has_a_case_here():
    assert set(HONOURED_CASES) == HONOURED, set(HONOURED_CASES) ^ HONOURED
    assert set(LABEL_VALUES) == LABELS and set(REFUSED_VALUES) == set(REFUSED)
    assert KNOWN == HONOURED | LABELS | set(REFUSED)


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_each_parameter_is_honoured_or_refused(world, chat, base, name):
    """None silently ignored: each one changes what is asked of the model or the answer (the engine's
    and the text side's tests check that these settings do what they say), or is a 400 naming it."""
    extra, check = _case(name, base)
    r = run(chat, BASE | extra)
    assert check(r, world, base) is not False


@pytest.mark.parametrize("name", sorted(OFF_VALUES))
def test_a_refused_parameter_s_off_value_is_accepted(chat, base, name):
    assert content(run(chat, BASE | {name: OFF_VALUES[name]})) == base.text


def test_refused_values_name_why(chat):
    r = run(chat, BASE | {"use_beam_search": True})
    assert "beam search" in r.message
    r = run(chat, BASE | {"mm_processor_kwargs": {"do_resize": False}})
    assert (r.code, r.param) == ("unsupported_parameter", "mm_processor_kwargs.do_resize")
    r = run(chat, BASE | {"stream": True, "stream_options": {"include_obfuscation": True}})
    assert (r.code, r.param) == ("unsupported_parameter", "stream_options.include_obfuscation")


def test_continuous_usage_stats_put_the_tokens_so_far_on_every_chunk(chat, base):
    """vLLM's stream_options.continuous_usage_stats (GuideLLM sends it by default): each content chunk
    carries usage with the completion tokens streamed so far; the last usage chunk is unchanged."""
    body = BASE | {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    out = ok(run(chat, body)).out
    chunks = [e for e in out[:-1] if e["choices"] and e["choices"][0]["delta"].get("content")]
    counts = [e["usage"]["completion_tokens"] for e in chunks]
    assert counts == sorted(counts) and counts[-1] <= 6 and counts[0] >= 1
    assert all(e["usage"]["total_tokens"] == e["usage"]["prompt_tokens"] + e["usage"]["completion_tokens"]
               for e in chunks)
    assert out[-2]["usage"]["completion_tokens"] == 6 and not out[-2]["choices"]
    assert "".join(e["choices"][0]["delta"]["content"] for e in chunks) == base.text
    plain = ok(run(chat, BASE | {"stream": True})).out
    assert all("usage" not in e for e in plain[:-1])  # without it, no usage field at all


@pytest.mark.parametrize("extra,param", [
    ({"top_k": -2}, "top_k"), ({"min_p": 1.5}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": 7}, "min_tokens"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": list(range(33))}, "stop_token_ids"), ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"echo": 1}, "echo"), ({"request_id": ""}, "request_id"), ({"chat_template_kwargs": []}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
    ({"documents": ["x"]}, "documents"), ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"),
    ({"mm_processor_kwargs": {"fps": 0}}, "mm_processor_kwargs.fps"),
])
def test_bad_values_are_a_400_naming_the_parameter(chat, extra, param):
    r = run(chat, BASE | extra)
    assert isinstance(r, ClientError) and (r.status, r.param) == (400, param), getattr(r, "message", r)


# ---------------------------------------------------------------- unknown names
def test_unknown_names_are_logged_once_and_counted(world, encoder, caplog):
    seen = []
    chat = world_chat(world, encoder, on_unknown=seen.append)
    with caplog.at_level(logging.WARNING, logger="app.api.params"):
        for _ in range(3):
            ok(run(chat, BASE | {"frobnicate": 1, "chat_template_kwargs": {"enable_thinking": False},
                                 "stream": True, "stream_options": {"include_usage": True, "zzz": 1}}))
    assert seen == ["frobnicate", "stream_options.zzz", "chat_template_kwargs.enable_thinking"] * 3
    for name in ("frobnicate", "chat_template_kwargs.enable_thinking", "stream_options.zzz"):
        assert sum(name in rec.getMessage() for rec in caplog.records) == 1


def test_reject_unknown_parameters_makes_them_a_400(world, encoder):
    chat = world_chat(world, encoder, reject_unknown_parameters=True)
    for extra, name in (({"frobnicate": 1}, "frobnicate"),
                        ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs.enable_thinking")):
        r = run(chat, BASE | extra)
        assert isinstance(r, ClientError) and (r.status, r.code, r.param) == (400, "unsupported_parameter", name)
    ok(run(chat, BASE | {"user": "u", "top_k": -1}))  # known ones still pass


def test_the_metric_counts_a_bounded_set_of_names():
    from deployments.metrics import MAX_UNKNOWN_NAMES, RouterMetrics

    counted = []
    m = RouterMetrics.__new__(RouterMetrics)
    m.unknown, m._unknown_names = SimpleNamespace(inc=lambda tags: counted.append(tags["name"])), set()
    for i in range(MAX_UNKNOWN_NAMES + 3):
        m.unknown_parameter(f"p{i}")
    m.unknown_parameter("p0")
    assert counted[:MAX_UNKNOWN_NAMES] == [f"p{i}" for i in range(MAX_UNKNOWN_NAMES)]
    assert counted[MAX_UNKNOWN_NAMES:] == ["other"] * 3 + ["p0"]


# ---------------------------------------------------------------- the chat template
GREETING = "{%- if greeting -%}{{- '<|im_start|>system\\n' + greeting + '<|im_end|>\\n' -}}{%- endif -%}"
DOCS = ("{%- if documents -%}{%- for d in documents -%}{{- '<|im_start|>system\\n' + d['title'] + ': ' + d['text'] "
        "+ '<|im_end|>\\n' -}}{%- endfor -%}{%- endif -%}")


def test_chat_template_kwargs_and_documents_reach_a_template_that_reads_them(world, encoder):
    import copy

    tok = copy.deepcopy(world["tok"])
    tok.chat_template = GREETING + DOCS + tok.chat_template
    chat = world_chat(world, encoder, tokenizer=tok)
    text = prompt_text(world, run(chat, BASE | {"chat_template_kwargs": {"greeting": "Be kind"}}))
    assert text.startswith("<|im_start|>system\nBe kind<|im_end|>\n<|im_start|>user\nTell me a story")
    text = prompt_text(world, run(chat, BASE | {"documents": [{"title": "Doc", "text": "a fact"}]}))
    assert text.startswith("<|im_start|>system\nDoc: a fact<|im_end|>\n")
    r = run(chat, BASE | {"chat_template_kwargs": {"greeting": "<|image_pad|>"}})  # rendered text is checked too
    assert isinstance(r, ClientError) and r.code == "reserved_token"


def test_echo_and_the_role_in_a_stream(chat):
    body = BASE | {"messages": USER + [{"role": "assistant", "content": "Once upon"}], "add_generation_prompt": False,
                   "continue_final_message": True, "echo": True, "stream": True}
    out = ok(run(chat, body)).out
    deltas = [e["choices"][0]["delta"] for e in out[:-1]]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[1] == {"content": "Once upon"}
    whole = content(run(chat, body | {"stream": False}))
    assert "".join(d.get("content", "") for d in deltas) == whole
    # without a generation prompt the answer continues the last message, in its role (as vLLM)
    out = ok(run(chat, BASE | {"add_generation_prompt": False, "stream": True})).out
    assert out[0]["choices"][0]["delta"]["role"] == "user"


# ---------------------------------------------------------------- mm_processor_kwargs
def test_min_and_max_pixels_resize_within_the_request_s_bounds(chat):
    spec = chat.media.spec
    for kw in ({}, {"max_pixels": 65536}, {"min_pixels": 200_000}, {"min_pixels": 70_000, "max_pixels": 90_000}):
        body = BASE | {"messages": [{"role": "user", "content": [IMAGE]}], "max_tokens": 1}
        r = ok(run(chat, body | ({"mm_processor_kwargs": kw} if kw else {})))
        m = chat.cfg.media
        h, w = smart_resize(256, 384, spec.factor, kw.get("min_pixels", m.image_min_pixels),
                            kw.get("max_pixels", m.image_max_pixels))
        assert r.out["usage"]["prompt_tokens_details"]["image_tokens"] == h * w // spec.factor ** 2, kw


def test_fps_samples_a_video_s_frames(chat):
    m = chat.cfg.media
    for fps in (None, 1.0, 0.5):
        body = BASE | {"messages": [{"role": "user", "content": [VIDEO]}], "max_tokens": 1}
        r = ok(run(chat, body | ({"mm_processor_kwargs": {"fps": fps}} if fps else {})))
        frames = len(sample_indices(32, 4.0, fps or m.video_fps, m.video_min_frames, m.video_max_frames))
        h, w = smart_resize(64, 64, chat.media.spec.factor, m.video_min_pixels, m.video_max_pixels)
        groups = frames // chat.media.spec.temporal
        assert r.out["usage"]["prompt_tokens_details"]["video_tokens"] == groups * h * w // chat.media.spec.factor ** 2


@pytest.mark.parametrize("kw,media,limit", [
    ({"max_pixels": 2_000_000}, [IMAGE], "media.image_max_pixels (1048576)"),
    ({"min_pixels": 1000}, [IMAGE], "media.image_min_pixels (65536)"),
    ({"max_pixels": 1_000_000}, [VIDEO], "media.video_max_pixels (262144)"),
    ({"min_pixels": 100_000, "max_pixels": 80_000}, [IMAGE], "must not exceed"),
    ({"fps": 1000}, [VIDEO], "media.video_max_frames"),
])
def test_values_outside_the_server_s_limits_are_a_400_naming_the_limit(chat, kw, media, limit):
    r = run(chat, BASE | {"messages": [{"role": "user", "content": media}], "mm_processor_kwargs": kw})
    assert isinstance(r, ClientError) and r.status == 400 and r.code == "invalid_mm_processor_kwargs"
    assert limit in r.message and r.param.startswith("mm_processor_kwargs")


def test_a_slicing_model_refuses_pixel_bounds_but_takes_fps():
    body = {"messages": [{"role": "user", "content": [IMAGE]}], "mm_processor_kwargs": {"max_pixels": 65536}}
    with pytest.raises(ClientError) as e:
        parse_chat_request(body, 16, 4, server=ServerContext(slices_images=True))
    assert (e.value.code, e.value.param) == ("unsupported_parameter", "mm_processor_kwargs.max_pixels")
    req = parse_chat_request(body | {"mm_processor_kwargs": {"fps": 1}}, 16, 4, server=ServerContext(slices_images=True))
    assert asdict(req.media[0].options) == {"min_pixels": None, "max_pixels": None, "fps": 1.0}


def test_usage_says_how_many_prompt_tokens_the_prefix_cache_served_when_asked(world, encoder):
    """vLLM's --enable-prompt-tokens-details: off, no `cached_tokens` (a repeated prompt's usage equals its
    first); on, the whole blocks of a repeated prompt, less the token whose logits are computed again."""
    import uuid

    from app.api.completions import CompletionService
    from app.api.responses import ResponseService

    words = " ".join(f"w{uuid.uuid4().hex[:6]}" for _ in range(40))  # a prompt the cache has never seen
    body = {"messages": [{"role": "user", "content": words}], "max_tokens": 2, "temperature": 0}
    off = ok(run(world_chat(world, encoder), body)).out["usage"]
    assert "cached_tokens" not in off["prompt_tokens_details"]
    chat = world_chat(world, encoder, enable_prompt_tokens_details=True)
    again = ok(run(chat, body)).out["usage"]
    n, block = again["prompt_tokens"], world["engine"].blocks.block_size
    assert again["prompt_tokens_details"]["cached_tokens"] == (n - 1) // block * block > 0
    streamed = ok(run(chat, {**body, "stream": True, "stream_options": {"include_usage": True}})).out
    assert streamed[-2]["usage"] == again  # the usage chunk, before [DONE]
    unseen = {**body, "messages": [{"role": "user", "content": "x" + uuid.uuid4().hex}]}
    assert ok(run(chat, unseen)).out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # text completions and Responses report the same count in their own shapes
    ids = ok(run(chat, body)).gen["input_ids"]
    completion = asyncio.run(_complete(CompletionService(chat), {"prompt": ids, "max_tokens": 2, "temperature": 0}))
    assert completion["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(ids) - 1) // block * block
    response = asyncio.run(_complete(ResponseService(chat), {"input": words, "max_output_tokens": 2,
                                                             "temperature": 0}))
    assert response["usage"]["input_tokens_details"]["cached_tokens"] == again["prompt_tokens_details"][
        "cached_tokens"]


async def _complete(service, body: dict) -> dict:
    return await service.complete(await service.prepare(body))
