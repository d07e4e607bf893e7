"""The request body, read with a byte cap: a declared `Content-Length` over the cap is refused before
any byte is read, and a chunked body is counted as it arrives, so a multi-gigabyte POST never sits in
the Router's memory. 413 `request_too_large`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from ..errors import ClientError
from . import fastjson


def _too_large(max_bytes: int) -> ClientError:
    return ClientError(f"request body exceeds the limit of {max_bytes} bytes", status=413, code="request_too_large")


async def read_body(chunks: AsyncIterator[bytes], content_length: str | None, max_bytes: int) -> bytes:
    if content_length is not None and content_length.strip().isdigit() and int(content_length) > max_bytes:
        raise _too_large(max_bytes)
    buf = bytearray()
    async for chunk in chunks:
        buf += chunk
        if len(buf) > max_bytes:
            raise _too_large(max_bytes)
    return bytes(buf)


# orjson (3.8 here) parses nesting recursively without a limit: '{"a":' * 100_000 crashed the whole
# process with a segmentation fault. The standard library's scanner stops at the interpreter's
# recursion limit with a RecursionError. A body with few brackets cannot nest deeply, and counting
# them is a C loop (well under a millisecond for a 1 MB base64 image), so only bodies with many
# brackets take the slower, guarded parser.
ORJSON_MAX_BRACKETS = 512


def parse_json(raw: bytes):
    try:
        if raw.count(b"[") + raw.count(b"{") <= ORJSON_MAX_BRACKETS:
            return fastjson.loads(raw)
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ClientError(f"request body is not valid JSON: {str(e)[:200]}", code="invalid_json") from None
