"""The bytes behind a media URL: `data:` decoded in place (`inline_bytes`, synchronous, so that the
pipeline decodes base64 in its worker threads, not on the event loop), `http(s)://` fetched under the network policy
(app/media/http_fetch.py), `file://` read from the one allowed directory (app/media/local_files.py).
Every failure is a ClientError: 400 `invalid_media_url`, `media_url_forbidden`, `media_fetch_failed`,
`invalid_media`, or 413 `media_too_large`; and 503 `overloaded` when the process's budget of payload
bytes in flight has no room (app/media/budget.py)."""

from __future__ import annotations

import base64
import binascii
from functools import partial
from urllib.parse import unquote_to_bytes

from ..config import MediaConfig
from ..errors import ClientError
from .budget import Reservation, budget_for
from .http_fetch import HttpFetcher, fetcher_for
from .local_files import read_local
from .netpolicy import FetchPolicy


def _too_large(n: int, max_bytes: int, param: str) -> ClientError:
    return ClientError(f"media payload of {n} bytes exceeds the limit of {max_bytes}", param=param,
                       code="media_too_large", status=413)


def decode_data_url(url: str, *, max_bytes: int, param: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep:
        raise ClientError("malformed data URL: no ',' separator", param=param, code="invalid_media_url")
    if head.lower().endswith(";base64"):
        if len(payload) * 3 // 4 > max_bytes + 3:  # refused before the decoded copy exists
            raise _too_large(len(payload) * 3 // 4, max_bytes, param)
        try:
            return base64.b64decode(payload, validate=False)
        except (binascii.Error, ValueError) as e:
            raise ClientError(f"malformed base64 in data URL: {e}", param=param, code="invalid_media_url") from e
    if len(payload) > 3 * (max_bytes + 1):  # percent-encoding at most triples a byte
        raise _too_large(len(payload), max_bytes, param)
    return unquote_to_bytes(payload)


def _scheme(url: str) -> str:
    return url.partition(":")[0].lower() if ":" in url[:16] else ""


def is_inline(url: str) -> bool:
    return _scheme(url) == "data"


def inline_size(url: str) -> int:
    """At most the bytes a `data:` URL decodes to (base64: 3 per 4 characters), without copying it."""
    comma = url.find(",")
    if comma < 0:
        return 0
    n = len(url) - comma - 1
    return n * 3 // 4 if url[:comma].lower().endswith(";base64") else n


def _checked(data: bytes, cfg: MediaConfig, param: str) -> bytes:
    if not data:
        raise ClientError("empty media payload", param=param, code="invalid_media")
    if len(data) > cfg.max_media_bytes:
        raise _too_large(len(data), cfg.max_media_bytes, param)
    return data


def inline_bytes(url: str, cfg: MediaConfig, *, param: str) -> bytes:
    """The bytes of a `data:` URL, within `cfg`'s limits."""
    return _checked(decode_data_url(url, max_bytes=cfg.max_media_bytes, param=param), cfg, param)


async def fetch(url: str, cfg: MediaConfig, *, param: str, http: HttpFetcher | None = None,
                hold: Reservation | None = None) -> bytes:
    """Bytes behind a `data:`, `http(s):` or `file:` URL, within `cfg`'s limits and network policy.
    `http` replaces the process's pooled fetcher (tests inject a resolver through it). `hold`: the
    item's reservation in the process's byte budget, which the caller releases once it is done with
    the bytes (app/media/pipeline.py); without one the bytes count only while they are fetched."""
    if hold is not None:
        return await _fetch(url, cfg, param, http, hold)
    hold = budget_for(cfg).hold(param)
    try:
        return await _fetch(url, cfg, param, http, hold)
    finally:
        hold.release()


async def _fetch(url: str, cfg: MediaConfig, param: str, http: HttpFetcher | None, hold: Reservation) -> bytes:
    scheme = _scheme(url)
    if scheme == "data":
        await hold.grow_to(min(inline_size(url), cfg.max_media_bytes))  # more is refused as it decodes
        return inline_bytes(url, cfg, param=param)
    if scheme in ("http", "https"):
        fetcher = http or fetcher_for(FetchPolicy.from_config(cfg))
        data = await fetcher.fetch(url, timeout_s=cfg.fetch_timeout_s, max_bytes=cfg.max_media_bytes, param=param,
                                   hold=hold)
    elif scheme == "file":
        data = await hold.read_capped(cfg.max_media_bytes, partial(
            read_local, url, root=cfg.allowed_local_media_path, max_bytes=cfg.max_media_bytes, param=param))
    else:
        raise ClientError("media URLs must be data:, http(s): or file: URLs", param=param, code="invalid_media_url")
    return _checked(data, cfg, param)
