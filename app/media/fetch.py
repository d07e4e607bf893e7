"""The bytes behind a media URL: `data:` URLs decoded in place, `http(s)://` URLs fetched."""

from __future__ import annotations

import base64
import binascii

from ..errors import ClientError


async def fetch(url: str, *, timeout_s: float, max_bytes: int, param: str) -> bytes:
    """Bytes behind a `data:` or `http(s):` URL."""
    if url.startswith("data:"):
        head, sep, payload = url.partition(",")
        if not sep:
            raise ClientError("malformed data URL: no ',' separator", param=param, code="invalid_media_url")
        try:
            data = base64.b64decode(payload, validate=False) if head.endswith(";base64") else payload.encode()
        except (binascii.Error, ValueError) as e:
            raise ClientError(f"malformed base64 in data URL: {e}", param=param, code="invalid_media_url") from e
    elif url.startswith(("http://", "https://")):
        import httpx

        try:
            async with httpx.AsyncClient(timeout=timeout_s, follow_redirects=True) as client:
                resp = await client.get(url)
        except httpx.HTTPError as e:
            raise ClientError(f"could not fetch {url}: {type(e).__name__}: {e}", param=param,
                              code="media_fetch_failed") from e
        if resp.status_code >= 400:
            raise ClientError(f"could not fetch {url}: HTTP {resp.status_code}", param=param, code="media_fetch_failed")
        data = resp.content
    else:
        raise ClientError("media URLs must be data: or http(s): URLs", param=param, code="invalid_media_url")
    if not data:
        raise ClientError("empty media payload", param=param, code="invalid_media")
    if len(data) > max_bytes:
        raise ClientError(f"media payload of {len(data)} bytes exceeds the limit of {max_bytes}", param=param,
                          code="media_too_large", status=413)
    return data
