"""Optional API key: `Authorization: Bearer <key>` on every path but /health and /metrics (Prometheus
scrapes it without a key, as vLLM leaves it open).

A pure ASGI middleware rather than Starlette's BaseHTTPMiddleware, which would wrap streaming
responses and their disconnect handling. It protects every path except the open ones instead of
listing protected prefixes, so a new route, or the app mounted under a route prefix, fails closed.
The key is compared in constant time (on SHA-256 digests, so its length leaks nothing either), is
never echoed, and lives in a SecretStr in the config, whose dumps and reprs print '**********'.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

from ..errors import ClientError

ENV_VAR = "VLM_API_KEY"
OPEN_PATHS = frozenset({"/health", "/metrics"})


def resolve_api_key(configured) -> str | None:
    """The config's key (a SecretStr) if set, else the env var; an empty value means no key."""
    key = configured.get_secret_value() if configured is not None else os.environ.get(ENV_VAR, "")
    return key or None


def key_matches(authorization: str | None, key: str) -> bool:
    scheme, _, token = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer":
        token = ""
    return hmac.compare_digest(hashlib.sha256(token.strip().encode()).digest(),
                               hashlib.sha256(key.encode()).digest())


def unauthorized() -> ClientError:
    return ClientError("Incorrect or missing API key: send 'Authorization: Bearer <key>'.", status=401,
                       code="invalid_api_key", headers={"www-authenticate": "Bearer"})


class ApiKeyMiddleware:
    """Refuses requests without the key with 401 and OpenAI's error body. `get_key()` is read per
    request, so the key can be set after the app is built (by the Router replica's constructor)."""

    def __init__(self, app, get_key):
        self.app, self.get_key = app, get_key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            key = self.get_key()
            path = scope.get("path", "")
            root = scope.get("root_path", "")
            if root and path.startswith(root):
                path = path[len(root):] or "/"
            if key is not None and path not in OPEN_PATHS:
                headers = dict(scope.get("headers") or [])
                raw = headers.get(b"authorization")
                if not key_matches(raw.decode("latin-1") if raw is not None else None, key):
                    await self._refuse(send)
                    return
        await self.app(scope, receive, send)

    @staticmethod
    async def _refuse(send) -> None:
        err = unauthorized()
        body = json.dumps(err.to_json()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.encode(), v.encode()) for k, v in err.headers.items()]
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
