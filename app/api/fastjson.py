"""JSON for the ingress's hot path: orjson where installed, else the standard library. orjson parses
a large base64-image request several times faster, and every streamed chunk is serialised too
(benchmarks/results/2026-11-23-ray-hops-routers-own-port-cpu.md)."""

from __future__ import annotations

import json

try:
    import orjson
except ImportError:  # pragma: no cover - orjson is a dependency; a bare GPU bundle may lack it
    orjson = None


def loads(data: bytes | str):
    """Raises ValueError (orjson.JSONDecodeError is one) or UnicodeDecodeError on bad input."""
    return orjson.loads(data) if orjson is not None else json.loads(data)


def dumps(obj) -> str:
    return orjson.dumps(obj).decode() if orjson is not None else json.dumps(obj)


def dumps_bytes(obj) -> bytes:
    return orjson.dumps(obj) if orjson is not None else json.dumps(obj).encode()
