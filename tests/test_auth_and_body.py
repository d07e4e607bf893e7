"""The optional API key (app/api/auth.py) and the request body cap (app/api/body.py), without Ray. The
Ray application's 401s are checked in tests/test_faults.py, which runs it with a key."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient

from app.api.auth import ApiKeyMiddleware, key_matches, resolve_api_key
from app.api.body import parse_json, read_body
from app.config import AppConfig
from app.errors import ClientError

KEY = "sk-test-0123456789"


def make_app(key: str | None) -> FastAPI:
    api = FastAPI()
    api.add_middleware(ApiKeyMiddleware, get_key=lambda: key)

    @api.get("/health")
    async def health():
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models():
        return {"data": []}

    @api.get("/docs-like")
    async def other():
        return {"x": 1}

    @api.get("/v1/stream")
    async def stream():
        async def gen():
            for i in range(3):
                yield f"data: {i}\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    return api


def test_no_key_configured_means_open():
    client = TestClient(make_app(None))
    assert client.get("/v1/models").status_code == 200


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer wrong", f"Basic {KEY}", f"Bearer {KEY}x",
                                    f"Bearer {KEY[:-1]}", KEY, "Bearer  ", f"bearer{KEY}"])
def test_a_missing_or_wrong_key_is_a_401_with_openais_error_body(header):
    client = TestClient(make_app(KEY))
    headers = {} if header is None else {"authorization": header}
    for path in ("/v1/models", "/v1/stream", "/docs-like", "/v1/nope"):
        resp = client.get(path, headers=headers)
        assert resp.status_code == 401, (path, header)
        err = resp.json()["error"]
        assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
        assert set(err) == {"message", "type", "param", "code"} and KEY not in resp.text
        assert resp.headers["www-authenticate"] == "Bearer"


def test_the_right_key_passes_and_health_stays_open():
    client = TestClient(make_app(KEY))
    ok = {"authorization": f"Bearer {KEY}"}
    assert client.get("/v1/models", headers=ok).json() == {"data": []}
    assert client.get("/v1/models", headers={"Authorization": f"bearer  {KEY} "}).status_code == 200
    assert client.get("/v1/stream", headers=ok).text == "data: 0\n\ndata: 1\n\ndata: 2\n\n"  # streams untouched
    assert client.get("/health").json() == {"status": "ok"}


def test_under_a_route_prefix_the_check_still_applies():
    outer = FastAPI()
    outer.mount("/vlm", make_app(KEY))
    client = TestClient(outer)
    assert client.get("/vlm/v1/models").status_code == 401
    assert client.get("/vlm/health").status_code == 200
    assert client.get("/vlm/v1/models", headers={"authorization": f"Bearer {KEY}"}).status_code == 200


def test_key_comparison():
    assert key_matches(f"Bearer {KEY}", KEY) and not key_matches(f"Bearer {KEY} extra", KEY)
    assert not key_matches(None, KEY) and not key_matches("Bearer ", KEY)


def test_the_key_comes_from_config_or_env_and_is_never_printed(monkeypatch, caplog):
    monkeypatch.delenv("VLM_API_KEY", raising=False)
    assert resolve_api_key(AppConfig().api_key) is None
    monkeypatch.setenv("VLM_API_KEY", "from-env")
    assert resolve_api_key(AppConfig().api_key) == "from-env"
    cfg = AppConfig(api_key=KEY)
    assert resolve_api_key(cfg.api_key) == KEY  # the config wins over the env
    monkeypatch.setenv("VLM_API_KEY", "")
    assert resolve_api_key(AppConfig().api_key) is None
    for text in (repr(cfg), str(cfg), cfg.model_dump_json(), repr(cfg.model_dump()), json.dumps(cfg.model_dump(mode="json"))):
        assert KEY not in text
    with caplog.at_level(logging.DEBUG):
        logging.getLogger("test").info("config %s", cfg)
    assert KEY not in caplog.text
    assert AppConfig(**cfg.model_dump()).api_key.get_secret_value() == KEY  # survives the trip to replicas


async def _chunks(parts):
    for p in parts:
        yield p


def test_the_body_cap():
    assert asyncio.run(read_body(_chunks([b"ab", b"cd"]), "4", 4)) == b"abcd"
    for length, parts in [("5", [b"abcde"]), (str(10**12), [b"a"]), (None, [b"ab"] * 3), ("1", [b"ab"] * 3)]:
        with pytest.raises(ClientError) as e:
            asyncio.run(read_body(_chunks(parts), length, 4))
        assert e.value.status == 413 and e.value.code == "request_too_large"


@pytest.mark.parametrize("raw", [b"{", b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000, b"", b"NaN{"])
def test_bad_json_is_a_400(raw):
    with pytest.raises(ClientError) as e:
        parse_json(raw)
    assert e.value.status == 400 and e.value.code == "invalid_json"


@pytest.mark.parametrize("depth", [600, 100_000])
def test_deeply_nested_objects_are_refused_without_crashing_the_parser(depth):
    """orjson crashed the process (SIGSEGV) on 100,000 nested objects; bodies with many brackets go
    through the standard library's parser, which refuses nesting past the recursion limit."""
    raw = b'{"a":' * depth + b"1" + b"}" * depth
    if depth < 900:
        value = parse_json(raw)
        for _ in range(depth):
            value = value["a"]
        assert value == 1
    else:
        with pytest.raises(ClientError) as e:
            parse_json(raw)
        assert e.value.status == 400 and e.value.code == "invalid_json"
