"""/tokenize and /detokenize (app/api/tokenize.py), as vLLM has them, on the tiny model's tokenizer and
chat path (no Ray): a prompt's tokens are the tokenizer's, messages' those the chat endpoint builds."""

from __future__ import annotations

import asyncio

import pytest

from app.api.tokenize import TokenizeService
from app.errors import ClientError
from helpers import world_chat

TEXT = "Hello world, ünïcode and 日本語 text: 1 2 3"


@pytest.fixture(scope="module")
def chat(world):
    return world_chat(world)


@pytest.fixture(scope="module")
def svc(chat):
    return TokenizeService(chat)


def refused(call, body, param: str, code: str | None = None) -> None:
    with pytest.raises(ClientError) as e:
        call(body)
    assert e.value.status == 400 and e.value.param == param, (e.value.param, e.value.message)
    if code is not None:
        assert e.value.code == code


def test_a_prompt_s_tokens_are_the_tokenizer_s_and_detokenize_inverts_them(svc, world, chat):
    r = svc.tokenize({"model": "x", "prompt": TEXT})
    assert r["tokens"] == world["tok"].encode(TEXT) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == chat.cfg.llm.max_model_len and r["token_strs"] is None
    assert svc.detokenize({"tokens": r["tokens"]}) == {"prompt": TEXT}
    strs = svc.tokenize({"prompt": TEXT, "return_token_strs": True, "add_special_tokens": False})["token_strs"]
    assert strs == world["tok"].convert_ids_to_tokens(r["tokens"])


def test_messages_tokens_are_the_chat_path_s_prompt(svc, chat):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": TEXT}]}]

    async def prompt(**kw):
        _, gen, _ = await chat.prepare({"messages": messages, **kw})
        return gen["input_ids"]

    assert svc.tokenize({"messages": messages})["tokens"] == asyncio.run(prompt())
    assert (svc.tokenize({"messages": messages, "add_generation_prompt": False})["tokens"]
            == asyncio.run(prompt(add_generation_prompt=False)))
    assert len(svc.tokenize({"messages": messages})["tokens"]) > len(svc.tokenize({"prompt": TEXT})["tokens"])


def test_special_tokens_round_trip(svc, world):
    ids = svc.tokenize({"prompt": "<|im_start|>user\nhi<|im_end|>"})["tokens"]
    assert world["tok"].convert_tokens_to_ids("<|im_end|>") in ids
    assert svc.detokenize({"tokens": ids})["prompt"] == "<|im_start|>user\nhi<|im_end|>"


def test_refusals(svc, world):
    vocab = len(world["tok"])
    refused(svc.detokenize, {"tokens": [1, vocab]}, "tokens", "invalid_token_id")
    refused(svc.detokenize, {"tokens": [-1]}, "tokens", "invalid_token_id")
    refused(svc.detokenize, {"tokens": "abc"}, "tokens")
    refused(svc.tokenize, {}, "prompt")
    refused(svc.tokenize, {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "messages")
    refused(svc.tokenize, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
        "messages[0].content[0].image_url", "unsupported_content_type")
    refused(svc.tokenize, {"messages": [{"role": "user", "content": "<|image_pad|>"}]}, "messages[0].content",
            "reserved_token")
