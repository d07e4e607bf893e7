"""/v1/completions (app/api/completions.py) over the whole in-process pipeline (ChatService and the tiny
model, no Ray): text and token-id prompts without a chat template, several prompts and `n`, streaming,
legacy log-probabilities, `echo`, stop strings, and what is refused."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from app.api.completions import CompletionService
from app.errors import ClientError
from helpers import run_endpoint, sse_data, world_chat

USER = [{"role": "user", "content": "Tell me a story"}]


@pytest.fixture(scope="module")
def chat(world):
    return world_chat(world)


@pytest.fixture(scope="module")
def svc(chat):
    return CompletionService(chat)


events = sse_data


def run(service, body: dict):
    """The answer (a stream: its events), or the ClientError."""
    return run_endpoint(service, body, events)


def ok(r):
    assert not isinstance(r, ClientError), f"{r.code} {r.param}: {r.message}"
    return r


def refused(r, param: str, code: str | None = None) -> str:
    assert isinstance(r, ClientError) and r.status == 400, r
    assert r.param == param, (r.param, r.message)
    if code is not None:
        assert r.code == code, (r.code, r.message)
    return r.message


@pytest.fixture(scope="module")
def base(chat):
    """The chat path's greedy answer to USER: its prompt ids and text."""
    async def go():
        req, gen, payload = await chat.prepare({"messages": USER, "max_tokens": 8, "temperature": 0, "logprobs": True,
                                                "top_logprobs": 2})
        return gen, await chat.complete(req, gen, payload)

    gen, answer = asyncio.run(go())
    c = answer["choices"][0]
    return SimpleNamespace(ids=gen["input_ids"], text=c["message"]["content"], logprobs=c["logprobs"]["content"],
                           finish=c["finish_reason"])


def greedy(**kw) -> dict:
    return {"max_tokens": 8, "temperature": 0} | kw


def test_token_ids_continue_as_the_chat_path_does(svc, chat, base):
    r = ok(run(svc, greedy(prompt=base.ids)))
    assert r["object"] == "text_completion" and r["id"].startswith("cmpl-") and r["model"] == chat.cfg.model_name
    (c,) = r["choices"]
    assert c["index"] == 0 and c["text"] == base.text and c["finish_reason"] == base.finish and c["logprobs"] is None
    assert r["usage"]["prompt_tokens"] == len(base.ids)
    assert r["usage"]["total_tokens"] == r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"]


def test_a_text_prompt_is_the_tokenizer_s_encoding_without_a_template(svc, world, base):
    text = world["tok"].decode(base.ids)  # the chat prompt's text, template included
    req = asyncio.run(svc.prepare(greedy(prompt=text)))
    assert req.gens[0]["input_ids"] == world["tok"].encode(text) == base.ids
    assert ok(run(svc, greedy(prompt=text)))["choices"][0]["text"] == base.text


def test_several_prompts_and_n_give_choices_in_prompt_order(svc, world, base):
    other = world["tok"].encode("Once upon a time")
    alone = ok(run(svc, greedy(prompt=other)))["choices"][0]["text"]
    r = ok(run(svc, greedy(prompt=[base.ids, other], n=2)))
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in r["choices"]] == [base.text, base.text, alone, alone]
    assert r["usage"]["prompt_tokens"] == len(base.ids) + len(other)
    strings = ok(run(svc, greedy(prompt=["Once upon a time", "Once upon a time"])))
    assert [c["text"] for c in strings["choices"]] == [alone, alone]


def test_a_stream_s_text_joins_to_the_answer_with_usage_last(svc, base):
    evs = run(svc, greedy(prompt=[base.ids, base.ids], stream=True, stream_options={"include_usage": True}))
    assert evs[-1] == "[DONE]"
    usage = evs[-2]
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 2 * len(base.ids)
    chunks = evs[:-2]
    assert all(e["object"] == "text_completion" and e["usage"] is None for e in chunks)
    for k in (0, 1):
        mine = [e["choices"][0] for e in chunks if e["choices"][0]["index"] == k]
        assert "".join(c["text"] for c in mine) == base.text
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == [base.finish]
    plain = run(svc, greedy(prompt=base.ids, stream=True))
    assert plain[-1] == "[DONE]" and all("usage" not in e for e in plain[:-1])


def test_a_stream_left_early_stops_every_prompt_s_generation(svc, world):
    """A client that leaves a several-prompt stream: each prompt's generation is stopped (the engine runs
    nothing more), as a chat stream's is."""
    engine = world["engine"]

    async def go():
        req = await svc.prepare({"prompt": ["a b", "c d"], "max_tokens": 8000, "ignore_eos": True, "stream": True})
        stream = await svc.open_stream(req)
        await anext(stream)
        await stream.aclose()
        for _ in range(100):
            load = engine.load()
            if load["running"] == load["waiting"] == 0:
                return True
            await asyncio.sleep(0.05)
        return False

    assert asyncio.run(go())


def test_continuous_usage_counts_the_tokens_so_far(svc, base):
    evs = run(svc, greedy(prompt=base.ids, stream=True, stream_options={"continuous_usage_stats": True}))
    counts = [e["usage"]["completion_tokens"] for e in evs[:-1]]
    whole = ok(run(svc, greedy(prompt=base.ids)))["usage"]["completion_tokens"]
    assert counts == sorted(counts) and counts[-1] == whole
    assert all(e["usage"]["prompt_tokens"] == len(base.ids) for e in evs[:-1])


def test_logprobs_in_the_legacy_shape(svc, base, world):
    r = ok(run(svc, greedy(prompt=base.ids, logprobs=2)))
    lp = r["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert lp["token_logprobs"] == pytest.approx([e["logprob"] for e in base.logprobs])
    assert lp["tokens"] == [e["token"] for e in base.logprobs]
    for top, e in zip(lp["top_logprobs"], base.logprobs):  # the top 2, with the chosen one among them
        assert top == pytest.approx({t["token"]: t["logprob"] for t in e["top_logprobs"]} | {e["token"]: e["logprob"]})
    text = r["choices"][0]["text"]
    # each token's offset is where its text starts in the answer
    assert lp["text_offset"][0] == 0
    special = {t.content for t in world["tok"].added_tokens_decoder.values() if t.special}
    for off, tok, nxt in zip(lp["text_offset"], lp["tokens"], lp["text_offset"][1:] + [len(text)]):
        assert text[off:nxt] == ("" if tok in special else tok) or "\ufffd" in tok
    as_ids = ok(run(svc, greedy(prompt=base.ids, logprobs=0, return_tokens_as_token_ids=True)))
    assert all(t.startswith("token_id:") for t in as_ids["choices"][0]["logprobs"]["tokens"])
    streamed = run(svc, greedy(prompt=base.ids, logprobs=2, stream=True))
    parts = [e["choices"][0]["logprobs"] for e in streamed[:-1] if e["choices"][0]["logprobs"]]
    assert sum((p["text_offset"] for p in parts), []) == lp["text_offset"]
    assert sum((p["tokens"] for p in parts), []) == lp["tokens"]


def test_echo_starts_each_choice_with_the_prompt(svc, world, base):
    r = ok(run(svc, greedy(prompt="Once upon a time", echo=True, n=2)))
    assert all(c["text"].startswith("Once upon a time") for c in r["choices"])
    ids = ok(run(svc, greedy(prompt=base.ids, echo=True)))
    assert ids["choices"][0]["text"] == world["tok"].decode(base.ids) + base.text
    evs = run(svc, greedy(prompt="Once upon a time", echo=True, stream=True))
    assert evs[0]["choices"][0]["text"] == "Once upon a time"
    assert "".join(e["choices"][0]["text"] for e in evs[:-1]) == r["choices"][0]["text"]


def test_a_stop_string_ends_the_text_before_it(svc, base):
    stop = base.text[len(base.text) // 2:][:3]
    r = ok(run(svc, greedy(prompt=base.ids, stop=[stop])))
    c = r["choices"][0]
    assert c["text"] == base.text[:base.text.index(stop)] and c["finish_reason"] == "stop"


def test_omitted_max_tokens_is_openai_s_16(svc, base):
    req = asyncio.run(svc.prepare({"prompt": base.ids}))
    assert req.gens[0]["params"]["max_tokens"] == 16
    assert req.gens[0]["params"]["temperature"] == 0.7  # the checkpoint's sampling defaults, as in chat


@pytest.mark.parametrize("extra,param,code", [
    ({"suffix": "the end"}, "suffix", "unsupported_parameter"),
    ({"best_of": 3}, "best_of", "unsupported_parameter"),
    ({"echo": True, "logprobs": 1}, "echo", "unsupported_parameter"),
    ({"logit_bias": {"5": 1}}, "logit_bias", "unsupported_parameter"),
    ({"logprobs": True}, "logprobs", None),
    ({"logprobs": 21}, "logprobs", None),
    ({"prompt": []}, "prompt", None),
    ({"prompt": [1, "a"]}, "prompt", None),
    ({"prompt": [[1, 2], [10 ** 9]]}, "prompt[1]", "invalid_prompt"),
    ({"prompt": ""}, "prompt", "invalid_prompt"),
    ({"prompt": "look: <|image_pad|>"}, "prompt", "reserved_token"),
    ({"prompt": [[5] * 9000]}, "prompt", "context_length_exceeded"),
    ({"n": 40, "prompt": ["a", "b"]}, "prompt", None),
    ({"stream_options": {"include_usage": True}}, "stream_options", None),
    ({"temperature": 3}, "temperature", None),
])
def test_refusals_name_the_field(svc, extra, param, code):
    refused(run(svc, {"prompt": "Hello", "max_tokens": 2} | extra), param, code)


def test_the_off_values_of_refused_fields_are_accepted(svc):
    ok(run(svc, {"prompt": "Hello", "max_tokens": 2, "suffix": None, "best_of": 2, "n": 2, "echo": False,
                 "logprobs": None, "user": "me"}))


def test_an_image_marker_given_as_a_token_id_is_refused(svc, world):
    pad = world["tok"].convert_tokens_to_ids("<|image_pad|>")
    refused(run(svc, {"prompt": [1, pad, 2]}), "prompt", "reserved_token")


def test_structured_output_applies_to_text_prompts(svc):
    r = ok(run(svc, {"prompt": "JSON:", "max_tokens": 64, "temperature": 0,
                     "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                         "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"],
                         "additionalProperties": False}}}}))
    c = r["choices"][0]
    assert c["finish_reason"] == "stop" and isinstance(json.loads(c["text"])["a"], int)


# ---------------------------------------------------------------------------------------------------------
# The three endpoints over HTTP, the application deployed once on Ray Serve (CPU), with the official
# `openai` client: /v1/completions, /v1/responses, and /tokenize and /detokenize over httpx.

PORT = 8797
SERVER_ARGS = {"model": "embedded:tiny", "encoder": {"min_budget": 64, "max_budget": 1024, "batch_wait_ms": 20},
               "media": {"max_input_pixels": 1_000_000, "max_items_per_request": 4}}


@pytest.fixture(scope="module")
def server(model_cache):
    ray = pytest.importorskip("ray")
    import httpx
    import openai
    from ray import serve

    from deployments.app import build_app
    from deployments.ray_env import apply_serve_env

    apply_serve_env()  # as `make serve` starts Ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    serve.run(build_app(SERVER_ARGS | {"cache_dir": model_cache}), name="vlm", route_prefix="/")
    http = httpx.Client(base_url=f"http://127.0.0.1:{PORT}", timeout=120)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        yield SimpleNamespace(http=http, client=client, model=client.models.list().data[0].id)
    finally:
        http.close()
        serve.shutdown()
        ray.shutdown()


def _png() -> str:
    import base64
    import io

    from PIL import Image, ImageDraw

    img = Image.new("RGB", (96, 64), (200, 220, 255))
    ImageDraw.Draw(img).ellipse((20, 10, 70, 55), fill=(240, 120, 30))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _tokenize(server, **body) -> dict:
    r = server.http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.integration
def test_completions_through_the_official_client(server):
    """Greedy text of the chat prompt's token ids equals the chat endpoint's answer; streamed, n, logprobs,
    echo and stop over the SDK; the usage counts what /tokenize counts."""
    c, model = server.client, server.model
    messages = [{"role": "user", "content": "Tell me a story"}]
    answer = c.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    ids = _tokenize(server, messages=messages)["tokens"]
    full = c.completions.create(model=model, prompt=ids, max_tokens=6, temperature=0)
    assert full.object == "text_completion" and full.choices[0].text == answer.choices[0].message.content
    assert full.usage.prompt_tokens == len(ids) == answer.usage.prompt_tokens

    prompt = "Once upon a time"
    text = c.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
    assert text.usage.prompt_tokens == _tokenize(server, prompt=prompt)["count"]
    chunks = list(c.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text.choices[0].text
    assert chunks[-1].usage.completion_tokens == text.usage.completion_tokens

    two = c.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, n=2)
    assert [ch.index for ch in two.choices] == [0, 1] and {ch.text for ch in two.choices} == {text.choices[0].text}
    lp = c.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, logprobs=2).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == text.usage.completion_tokens
    assert all(len(t) <= 3 for t in lp.top_logprobs)
    echo = c.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, echo=True)
    assert echo.choices[0].text == prompt + text.choices[0].text
    stop = text.choices[0].text[2:4]
    stopped = c.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, stop=[stop])
    assert stopped.choices[0].text == text.choices[0].text[:text.choices[0].text.index(stop)]
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=model, prompt=prompt, echo=True, logprobs=1)
    assert e.value.body["param"] == "echo" and e.value.body["code"] == "unsupported_parameter"


@pytest.mark.integration
def test_responses_through_the_official_client(server):
    """Text and image input answer as the chat endpoint does, streamed events join to the same text, and
    text.format json_schema gives JSON; stored responses are refused."""
    c, model = server.client, server.model
    image = _png()
    content = [{"type": "input_image", "image_url": image}, {"type": "input_text", "text": "What is this?"}]
    r = c.responses.create(model=model, instructions="Be brief.", max_output_tokens=6, temperature=0,
                           input=[{"role": "user", "content": content}])
    chat = c.chat.completions.create(model=model, max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                     {"type": "text", "text": "What is this?"}]}])
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.status in ("completed", "incomplete")

    plain = c.responses.create(model=model, input="Tell me a story", max_output_tokens=6, temperature=0)
    events = list(c.responses.create(model=model, input="Tell me a story", max_output_tokens=6, temperature=0,
                                     stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == plain.output_text
    assert events[-1].response.output_text == plain.output_text

    schema = {"type": "object", "properties": {"label": {"enum": ["cat", "dog"]}}, "required": ["label"],
              "additionalProperties": False}
    structured = c.responses.create(model=model, input="Cat or dog?", max_output_tokens=32, temperature=0,
                                    text={"format": {"type": "json_schema", "name": "pet", "schema": schema}})
    assert json.loads(structured.output_text)["label"] in ("cat", "dog")
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model=model, input="hi", store=True)
    assert e.value.body["param"] == "store"


@pytest.mark.integration
def test_tokenize_and_detokenize_over_http(server):
    text = "Hello world, ünïcode 日本語"
    got = _tokenize(server, prompt=text, return_token_strs=True)
    assert got["count"] == len(got["tokens"]) == len(got["token_strs"]) and got["max_model_len"] > 0
    r = server.http.post("/detokenize", json={"tokens": got["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": text}
    bad = server.http.post("/detokenize", json={"tokens": [10 ** 9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
