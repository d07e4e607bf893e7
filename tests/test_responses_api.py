"""/v1/responses (app/api/responses.py) over the whole in-process pipeline (ChatService and the tiny
model, no Ray): input as text or messages with input_text and input_image parts, instructions,
max_output_tokens, text.format, the streamed event sequence, and the explicit refusals."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest

from app.api.chat import ChatService
from app.api.responses import ResponseService
from app.errors import ClientError
from helpers import png_bytes, run_endpoint, world_chat

IMAGE = "data:image/png;base64," + base64.b64encode(png_bytes(64, 96, seed=3)).decode()
SCHEMA = {"type": "object", "properties": {"label": {"enum": ["cat", "dog"]}}, "required": ["label"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def chat(world):
    return world_chat(world)


@pytest.fixture(scope="module")
def svc(chat):
    return ResponseService(chat)


def sse(writes: list[str]) -> list[dict]:
    out = []
    for w in writes:
        for block in w.split("\n\n"):
            if not block:
                continue
            kind, data = block.split("\n")
            assert kind.startswith("event: ") and data.startswith("data: ")
            ev = json.loads(data[len("data: "):])
            assert ev["type"] == kind[len("event: "):]
            out.append(ev)
    return out


def run(service, body: dict):
    return run_endpoint(service, body, sse)


def chat_answer(chat: ChatService, messages: list, **kw) -> dict:
    async def go():
        req, gen, payload = await chat.prepare({"messages": messages, "temperature": 0, **kw})
        return await chat.complete(req, gen, payload)

    return asyncio.run(go())


def ok(r):
    assert not isinstance(r, ClientError), f"{r.code} {r.param}: {r.message}"
    return r


def text_of(r: dict) -> str:
    (item,) = r["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["id"].startswith("msg_")
    (part,) = item["content"]
    assert part["type"] == "output_text" and part["annotations"] == []
    return part["text"]


def test_text_input_answers_as_the_chat_path(svc, chat):
    r = ok(run(svc, {"input": "Tell me a story", "instructions": "Be brief.", "max_output_tokens": 8,
                     "temperature": 0}))
    want = chat_answer(chat, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story"}],
                       max_tokens=8)
    assert r["object"] == "response" and r["id"].startswith("resp_") and r["model"] == chat.cfg.model_name
    assert text_of(r) == want["choices"][0]["message"]["content"]
    u = r["usage"]
    assert (u["input_tokens"], u["output_tokens"]) == (want["usage"]["prompt_tokens"], want["usage"]["completion_tokens"])
    assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]
    assert r["instructions"] == "Be brief." and r["store"] is False and r["temperature"] == 0


def test_messages_with_an_image_answer_as_the_chat_path(svc, chat):
    r = ok(run(svc, {"input": [
        {"role": "developer", "content": "Answer in one word."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_image", "image_url": IMAGE, "detail": "auto"},
            {"type": "input_text", "text": "What is this?"}]}], "max_output_tokens": 6, "temperature": 0}))
    want = chat_answer(chat, [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": IMAGE}}, {"type": "text", "text": "What is this?"}]}], max_tokens=6)
    assert text_of(r) == want["choices"][0]["message"]["content"]
    assert r["usage"]["input_tokens"] == want["usage"]["prompt_tokens"]
    assert want["usage"]["prompt_tokens_details"]["image_tokens"] > 0


def test_max_output_tokens_makes_an_incomplete_response(svc):
    r = ok(run(svc, {"input": "Tell me a story", "max_output_tokens": 3, "ignore_eos": True}))
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert r["output"][0]["status"] == "incomplete" and r["usage"]["output_tokens"] == 3


def test_the_stream_is_the_responses_event_sequence(svc):
    body = {"input": "Tell me a story", "max_output_tokens": 8, "temperature": 0}
    whole = ok(run(svc, body))
    evs = run(svc, body | {"stream": True})
    kinds = [e["type"] for e in evs]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    deltas = "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta")
    assert deltas == text_of(whole) == evs[-4]["text"]
    final = evs[-1]["response"]
    assert final["status"] == whole["status"] and text_of(final) == deltas and final["usage"] == whole["usage"]
    assert evs[0]["response"]["status"] == "in_progress" and evs[0]["response"]["id"] == final["id"]


def test_text_format_json_schema_goes_through_structured_output(svc):
    r = ok(run(svc, {"input": "Cat or dog?", "max_output_tokens": 32, "temperature": 0,
                     "text": {"format": {"type": "json_schema", "name": "pet", "schema": SCHEMA, "strict": True}}}))
    assert json.loads(text_of(r))["label"] in ("cat", "dog")
    assert r["text"]["format"]["type"] == "json_schema" and r["text"]["format"]["name"] == "pet"


@pytest.mark.parametrize("extra,param,code", [
    ({"store": True}, "store", "unsupported_parameter"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "unsupported_parameter"),
    ({"conversation": "conv_1"}, "conversation", "unsupported_parameter"),
    ({"background": True}, "background", "unsupported_parameter"),
    ({"tools": [{"type": "web_search"}]}, "tools", "unsupported_parameter"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools", "unsupported_parameter"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type",
     "unsupported_content_type"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "input[0].content[0].type", "unsupported_content_type"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input[0].type",
     "unsupported_parameter"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", None),
    ({"input": []}, "input", None),
    ({"max_output_tokens": 0}, "max_output_tokens", None),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", None),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text.format",
     "invalid_response_format"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]},
     "input[0].content[0].image_url", None),
    ({"input": [{"role": "assistant", "content": [{"type": "input_image", "image_url": IMAGE}]}]},
     "input[0].content[0].type", None),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options", "unsupported_parameter"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options",
     "unsupported_parameter"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options", "unsupported_parameter"),
    ({"input": "look: <|image_pad|>"}, "input", "reserved_token"),
    ({"instructions": "<|vision_start|>"}, "instructions", "reserved_token"),
    ({"input": [{"role": "user", "content": "<|image_pad|>"}]}, "input[0].content", "reserved_token"),
])
def test_refusals_name_the_field(svc, extra, param, code):
    r = run(svc, {"input": "Hello", "max_output_tokens": 2} | extra)
    assert isinstance(r, ClientError) and r.status == 400, r
    assert r.param == param, (r.param, r.message)
    if code is not None:
        assert r.code == code, (r.code, r.message)
    if param == "tools":
        assert "/v1/chat/completions" in r.message


def test_off_values_and_labels_are_accepted(svc):
    ok(run(svc, {"input": "Hello", "max_output_tokens": 2, "store": False, "tools": [], "tool_choice": "auto",
                 "previous_response_id": None, "truncation": "disabled", "metadata": {"k": "v"}, "user": "me",
                 "text": {"format": {"type": "text"}}, "parallel_tool_calls": True}))


def test_stream_options_of_chat_clients_are_accepted(svc):
    """AIPerf's `responses` endpoint type sends chat's `stream_options: {"include_usage": true}` (vLLM ignores
    it): accepted, and the usage is in `response.completed` as always."""
    body = {"input": "Hello", "max_output_tokens": 2, "stream": True}
    for opts in ({"include_usage": True}, {"include_usage": False, "include_obfuscation": False}, {}):
        evs = run(svc, body | {"stream_options": opts})
        assert not isinstance(evs, ClientError), (opts, evs)
        assert evs[-1]["type"] == "response.completed" and evs[-1]["response"]["usage"]["output_tokens"] == 2
