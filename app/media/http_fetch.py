"""http(s) media fetching that cannot be turned against the server's own network.

The address check (app/media/netpolicy.py) runs inside the connection pool's network backend, on the
addresses the name resolved to, and the socket is opened to one of exactly those addresses
(`PinnedBackend`). Redirects are followed here, every hop checked (`HttpFetcher._follow`); the body
streams under a running byte cap (`HttpFetcher._body`); one deadline covers the lookups, every hop
and the body. One pooled client per policy, per event loop and process, created on first use and
reused. No proxies from the environment (a proxy would make the connection the check never sees).
"""

from __future__ import annotations

import asyncio
import re
import socket
import ssl
import weakref
from collections.abc import Awaitable, Callable

import httpcore
import httpx

from ..errors import ClientError
from .budget import Reservation
from .netpolicy import FetchPolicy, ForbiddenAddress, normalise_host

Resolver = Callable[[str, int], Awaitable[list[str]]]
REDIRECTS = (301, 302, 303, 307, 308)
HEADERS = {"accept-encoding": "identity", "user-agent": "vlm-serve media fetcher"}
_SCHEME = re.compile(r"^\s*([A-Za-z][A-Za-z0-9+.-]*):")
CHUNK = 64 * 1024


async def system_resolver(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (IPv4 and IPv6), in the resolver's order."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [info[4][0] for info in infos]


class PinnedBackend(httpcore.AsyncNetworkBackend):
    """Resolves, checks every answer against the policy, then connects to a checked address.

    The URL keeps its hostname, so the Host header, TLS SNI and certificate checks use the name as
    usual, while a DNS answer that changes between a check and the connect (rebinding) cannot reach a
    second address: there is no second lookup. Pooled connections are keyed by hostname and were
    checked when opened."""

    def __init__(self, policy: FetchPolicy, resolver: Resolver = system_resolver,
                 inner: httpcore.AsyncNetworkBackend | None = None):
        self.policy, self.resolver = policy, resolver
        self.inner = inner or httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options=None) -> httpcore.AsyncNetworkStream:
        host = normalise_host(host)  # 'LOCALHOST.' is looked up as the allowlist reads it: 'localhost'
        try:
            addresses = await self.resolver(host, port)
        except (OSError, UnicodeError) as e:
            raise httpcore.ConnectError(f"could not resolve the media host: {getattr(e, 'strerror', None) or e}") from None
        last: Exception | None = None
        for ip in self.policy.check_addresses(host, addresses, port):
            try:
                return await self.inner.connect_tcp(ip, port, timeout=timeout, local_address=local_address,
                                                    socket_options=socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as e:
                last = e
        raise last if last is not None else httpcore.ConnectError("no address to connect to")

    async def connect_unix_socket(self, path, timeout=None, socket_options=None):
        raise ForbiddenAddress("unix sockets are not media sources")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


class PinnedTransport(httpx.AsyncHTTPTransport):
    """httpx's transport over a pool whose connections go through PinnedBackend. (httpx 0.28 takes
    no network backend argument; its transport sends every request through `self._pool`.)"""

    def __init__(self, backend: PinnedBackend, limits: httpx.Limits, ssl_context: ssl.SSLContext | None = None):
        super().__init__(trust_env=False, limits=limits)
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=ssl_context or httpx.create_ssl_context(trust_env=False),
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections, keepalive_expiry=limits.keepalive_expiry,
            network_backend=backend)


def _redirect_target(base: httpx.URL, location: str) -> httpx.URL:
    scheme = _SCHEME.match(location)
    if scheme and scheme.group(1).lower() not in ("http", "https"):  # data:, file:, gopher: ... never followed
        raise ForbiddenAddress(f"media redirect to a {_short(scheme.group(1), 20)}: URL refused; only http(s)")
    return base.join(location)


def _short(url: str | httpx.URL, n: int = 200) -> str:
    text = str(url)
    return text if len(text) <= n else text[:n] + "..."


class HttpFetcher:
    """Fetches http(s) media under one policy. `resolver`, `network` and `ssl_context` are injectable
    so tests can put a "public" host (with its own CA) on a local server; production uses the system
    resolver, real sockets and certifi's CAs."""

    def __init__(self, policy: FetchPolicy, resolver: Resolver = system_resolver,
                 network: httpcore.AsyncNetworkBackend | None = None, max_connections: int = 64,
                 ssl_context: ssl.SSLContext | None = None):
        self.policy, self.resolver, self.network, self.ssl_context = policy, resolver, network, ssl_context
        self.limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=16,
                                   keepalive_expiry=30)
        # a pool's connections belong to the event loop that opened them
        self._pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, PinnedTransport] = \
            weakref.WeakKeyDictionary()

    def transport(self) -> PinnedTransport:
        """This loop's pooled transport. Requests go to it directly, not through httpx.AsyncClient,
        whose redirect handling parses every Location (even when not following it) and would add
        cookies and proxies this fetcher does not want."""
        loop = asyncio.get_running_loop()
        t = self._pools.get(loop)
        if t is None:
            t = self._pools[loop] = PinnedTransport(PinnedBackend(self.policy, self.resolver, self.network),
                                                    self.limits, self.ssl_context)
        return t

    async def fetch(self, url: str, *, timeout_s: float, max_bytes: int, param: str,
                    hold: Reservation | None = None) -> bytes:
        """The body; `hold` (app/media/budget.py) reserves its bytes as they arrive."""
        try:
            target = httpx.URL(url)
        except (httpx.InvalidURL, ValueError) as e:
            raise ClientError(f"malformed media URL: {_short(str(e))}", param=param, code="invalid_media_url") from None
        try:
            async with asyncio.timeout(timeout_s):
                return await self._follow(target, max_bytes, param, timeout_s, hold)
        except TimeoutError:
            if hold is not None and hold.waiting:  # the deadline passed while waiting for this replica's room
                raise hold.budget.overloaded() from None
            raise ClientError(f"could not fetch {_short(url)}: no complete answer within {timeout_s:g} s",
                              param=param, code="media_fetch_failed") from None
        except ForbiddenAddress as e:
            raise ClientError(str(e), param=param, code="media_url_forbidden") from None
        except (httpx.HTTPError, httpx.InvalidURL) as e:
            raise ClientError(f"could not fetch {_short(url)}: {type(e).__name__}: {_short(str(e))}", param=param,
                              code="media_fetch_failed") from None

    async def _follow(self, target: httpx.URL, max_bytes: int, param: str, timeout_s: float,
                      hold: Reservation | None = None) -> bytes:
        """Redirects are followed here, not by httpx, so every hop's URL is checked (scheme, domain
        allowlist) and every new connection's address too; at most `max_redirects` hops."""
        transport, url, timeout = self.transport(), target, httpx.Timeout(timeout_s).as_dict()
        for _ in range(self.policy.max_redirects + 1):
            if target.scheme not in ("http", "https") or not target.host:
                raise ForbiddenAddress(f"media URL {_short(target)} refused: only http(s) URLs with a host "
                                       "(redirects included)")
            self.policy.check_host(target.host)
            request = httpx.Request("GET", target, headers=HEADERS, extensions={"timeout": timeout})
            resp = await transport.handle_async_request(request)
            resp.request = request
            try:
                if resp.status_code in REDIRECTS and "location" in resp.headers:
                    target = _redirect_target(resp.url, resp.headers["location"])
                    continue
                if not 200 <= resp.status_code < 300:
                    raise ClientError(f"could not fetch {_short(url)}: HTTP {resp.status_code}", param=param,
                                      code="media_fetch_failed")
                return await self._body(resp, max_bytes, param, hold)
            finally:
                await resp.aclose()
        raise ClientError(f"could not fetch {_short(url)}: more than {self.policy.max_redirects} redirects",
                          param=param, code="media_fetch_failed")

    @staticmethod
    async def _body(resp: httpx.Response, max_bytes: int, param: str, hold: Reservation | None = None) -> bytes:
        """The body under a running byte cap; a `Content-Length` over the cap is refused before any
        body byte is read. `Accept-Encoding: identity` and raw reads: a gzip body could otherwise
        inflate past the cap inside a single chunk. `hold` reserves a declared body whole before it is
        read, an undeclared one chunk by chunk as it arrives (app/media/budget.py)."""
        def too_large(n: str) -> ClientError:
            return ClientError(f"media payload of {n} bytes exceeds the limit of {max_bytes}", param=param,
                               code="media_too_large", status=413)

        declared = resp.headers.get("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
            raise too_large(declared.strip())
        encoding = resp.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise ClientError(f"media served with content-encoding {_short(encoding, 40)!r}; the server asks "
                              "for and accepts only uncompressed bodies", param=param, code="media_fetch_failed")
        if hold is not None and declared is not None and declared.strip().isdigit():
            # the whole declared body before reading it: partly received bodies that each wait for more
            # room would hold the budget among them and all time out (a slow body claiming much is cut
            # by the fetch's deadline); an undeclared (chunked) body reserves as it arrives
            await hold.grow_to(int(declared))
        buf, size = bytearray(), 0
        async for chunk in resp.aiter_raw(CHUNK):
            size += len(chunk)
            if size > max_bytes:
                raise too_large(f"more than {max_bytes}")
            if hold is not None:
                await hold.grow_to(size)
            buf += chunk
        return bytes(buf)


_fetchers: dict[FetchPolicy, HttpFetcher] = {}


def fetcher_for(policy: FetchPolicy) -> HttpFetcher:
    """The process's fetcher (and so its pooled client) for `policy`."""
    f = _fetchers.get(policy)
    if f is None:
        f = _fetchers[policy] = HttpFetcher(policy)
    return f
