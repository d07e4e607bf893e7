"""Safe media fetching (app/media/fetch.py, http_fetch.py, netpolicy.py, local_files.py).

Every loopback, private, link-local and metadata address is refused on direct use and through a
redirect, and the server behind it never sees a request; the socket goes to the checked address; bodies
are capped and deadlines hold; file:// stays inside its root."""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import os

import pytest

from app.config import MediaConfig
from app.errors import ClientError
from app.media.fetch import fetch
from app.media.http_fetch import HttpFetcher, fetcher_for
from app.media.netpolicy import FetchPolicy, is_public, parse_endpoint
from helpers import png_bytes
from netfakes import FakeInternet, MediaServer, self_signed

PUBLIC_IP, PUBLIC_IP2 = "93.184.216.34", "151.101.1.69"
PAYLOAD = png_bytes(20, 30)


@pytest.fixture(scope="module")
def server():
    s = MediaServer(PAYLOAD)
    yield s
    s.close()


def run(coro):
    return asyncio.run(coro)


def get(url: str, cfg: MediaConfig | None = None, http: HttpFetcher | None = None) -> bytes:
    return run(fetch(url, cfg or MediaConfig(), param="p", http=http))


def refused(url: str, cfg: MediaConfig | None = None, http: HttpFetcher | None = None) -> ClientError:
    with pytest.raises(ClientError) as e:
        get(url, cfg, http)
    assert 400 <= e.value.status < 500
    return e.value


NON_PUBLIC = ["127.0.0.1", "127.255.255.254", "0.0.0.0", "10.0.0.1", "172.16.5.4", "192.168.1.1", "100.64.0.1",
              "169.254.169.254", "169.254.170.2", "192.0.0.192", "198.18.0.1", "224.0.0.251", "239.255.255.250",
              "240.0.0.1", "255.255.255.255", "192.0.2.1",
              "::", "::1", "fe80::1", "fc00::1", "fd00:ec2::254", "ff02::1", "ff0e::1", "2001:db8::1",
              "::ffff:127.0.0.1", "::ffff:169.254.169.254", "::ffff:10.0.0.1", "::127.0.0.1",
              "2002:7f00:1::", "2002:a9fe:a9fe::", "64:ff9b::7f00:1", "64:ff9b::a9fe:a9fe",
              "2001:0:4136:e378:8000:63bf:3fff:fdd2",
              "64:ff9b:1::808:808", "64:ff9b:1:a00:1::"]  # NAT64's local-use prefix: the network's own mapping
PUBLIC = ["8.8.8.8", "1.1.1.1", PUBLIC_IP, "2606:4700:4700::1111", "::ffff:8.8.8.8", "2002:808:808::",
          "64:ff9b::808:808"]


def test_only_globally_routable_unicast_addresses_are_public():
    assert [a for a in NON_PUBLIC if is_public(ipaddress.ip_address(a))] == []
    assert [a for a in PUBLIC if not is_public(ipaddress.ip_address(a))] == []


# Spellings that reach loopback, metadata or private addresses without looking like them.
DIRECT = ["http://127.0.0.1:{port}/img.png", "http://127.1:{port}/img.png", "http://2130706433:{port}/img.png",
          "http://0x7f000001:{port}/img.png", "http://0177.0.0.1:{port}/img.png", "http://localhost:{port}/img.png",
          "http://LOCALHOST.:{port}/img.png", "http://[::1]:{port}/img.png", "http://[::ffff:127.0.0.1]:{port}/img.png",
          "http://[::ffff:7f00:1]:{port}/img.png", "http://0.0.0.0:{port}/img.png", "https://127.0.0.1:{port}/img.png",
          "http://169.254.169.254/latest/meta-data/", "http://[fd00:ec2::254]/latest/meta-data/",
          "http://169.254.170.2/v2/credentials", "http://10.0.0.1/", "http://172.16.0.1/", "http://192.168.0.1/",
          "http://100.100.100.200/latest/meta-data/", "http://[fe80::1]/", "http://224.0.0.1/",
          "http://[2002:7f00:1::]:{port}/img.png", "http://[64:ff9b::7f00:1]/",
          # every class once more by name: reserved, broadcast, unspecified v6, multicast v6, mapped metadata
          "http://240.0.0.1/", "http://255.255.255.255/", "http://[::]:{port}/img.png", "http://[ff02::1]/",
          "http://[::ffff:169.254.169.254]/latest/meta-data/", "http://[::ffff:10.0.0.1]/", "http://100.64.0.1/"]


@pytest.mark.parametrize("template", DIRECT)
def test_private_loopback_and_metadata_addresses_are_refused_before_connecting(server, template):
    before = len(server.requests)
    err = refused(template.format(port=server.port))
    # httpx itself rejects some spellings (octal '0177.0.0.1') as malformed: refused either way
    assert err.code in ("media_url_forbidden", "invalid_media_url"), err.message
    assert len(server.requests) == before  # nothing reached the local server


def test_names_that_resolve_to_private_addresses_are_refused(server):
    net = FakeInternet(server.port, {"metadata.google.internal": ["169.254.169.254"],
                                     "localtest.me": ["127.0.0.1"], "mixed.example": [PUBLIC_IP, "10.0.0.7"],
                                     "v6only.example": ["::1"]}, {PUBLIC_IP: server.port})
    http = HttpFetcher(FetchPolicy(), net.resolve, net.network)
    for host in ["metadata.google.internal", "localtest.me", "mixed.example", "v6only.example"]:
        err = refused(f"http://{host}/img.png", http=http)
        assert err.code == "media_url_forbidden"
        assert not any(a in err.message for a in ("169.254", "127.0", "10.0", "::1"))  # no internal DNS leaked
    assert net.connects == []  # refused before any connection, the mixed answer included


REDIRECT_TARGETS = ["http://127.0.0.1:{port}/img.png", "http://localhost:{port}/img.png", "http://[::1]:{port}/img.png",
                    "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
                    "http://metadata.google.internal/computeMetadata/v1/", "http://10.0.0.1/", "http://192.168.1.1/",
                    "http://[::ffff:127.0.0.1]:{port}/img.png", "http://2130706433:{port}/img.png",
                    "http://internal.example/img.png", "file:///etc/passwd", "data:image/png;base64,AAAA",
                    "gopher://127.0.0.1:6379/_INFO", "ftp://example.com/x.png",
                    # one target per remaining class: link-local v6, multicast v4/v6, reserved, unspecified
                    # v4/v6, mapped metadata, shared address space, private 172.16/12
                    "http://[fe80::1]/", "http://224.0.0.251/", "http://[ff02::1]/", "http://240.0.0.1/",
                    "http://0.0.0.0:{port}/img.png", "http://[::]:{port}/img.png",
                    "http://[::ffff:169.254.169.254]/latest/meta-data/", "http://100.64.0.1/", "http://172.16.5.4/"]


@pytest.mark.parametrize("target", REDIRECT_TARGETS)
@pytest.mark.parametrize("code", [302, 307])
def test_a_public_host_redirecting_to_private_addresses_is_refused(server, target, code):
    from urllib.parse import quote

    names = {"media.example": [PUBLIC_IP], "metadata.google.internal": ["169.254.169.254"],
             "internal.example": ["10.9.8.7"], "localhost": ["127.0.0.1"]}
    real_resolver_hosts = {"127.0.0.1", "::1", "169.254.169.254", "10.0.0.1", "192.168.1.1",
                           "::ffff:127.0.0.1", "2130706433", "fe80::1", "224.0.0.251", "ff02::1", "240.0.0.1",
                           "0.0.0.0", "::", "::ffff:169.254.169.254", "100.64.0.1", "172.16.5.4"}
    net = FakeInternet(server.port, names, {PUBLIC_IP: server.port})

    async def resolve(host, port):  # literals as the system resolver reads them, names from the fake DNS
        if host in real_resolver_hosts:
            from app.media.http_fetch import system_resolver

            return await system_resolver(host, port)
        return await net.resolve(host, port)

    http = HttpFetcher(FetchPolicy(), resolve, net.network)
    before = server.paths()
    url = f"http://media.example/redirect?code={code}&to=" + quote(target.format(port=server.port), safe="")
    err = refused(url, http=http)
    assert err.code == "media_url_forbidden", err.message
    assert server.paths()[len(before):] == ["/redirect"]  # the first hop only; never the private target
    assert {h for h, _ in net.connects} == {PUBLIC_IP}


def test_every_hop_is_checked_and_redirects_are_limited(server):
    from urllib.parse import quote

    net = FakeInternet(server.port, {"a.example": [PUBLIC_IP], "b.example": [PUBLIC_IP2],
                                     "c.example": ["192.168.7.7"]}, {PUBLIC_IP: server.port, PUBLIC_IP2: server.port})
    http = HttpFetcher(FetchPolicy(max_redirects=3), net.resolve, net.network)
    # public -> public -> private: refused at the second hop
    hop1 = "http://b.example/redirect?to=" + quote("http://c.example/img.png", safe="")
    url = "http://a.example/redirect?to=" + quote(hop1, safe="")
    assert refused(url, http=http).code == "media_url_forbidden"
    assert net.lookups[-1] == "c.example" and ("192.168.7.7", 80) not in net.connects
    # three redirects are followed, a fourth is not
    assert get("http://a.example/chain/2", http=http) == PAYLOAD  # /chain/2 -> 1 -> 0 -> /img.png
    err = refused("http://a.example/chain/3", http=http)
    assert err.code == "media_fetch_failed" and "redirects" in err.message


def test_the_socket_goes_to_the_checked_address_and_keeps_the_hostname(server):
    """DNS rebinding: the first answer is public, every later one loopback. The check and the connect
    use the same single answer, so the connection goes to the public address, with Host = the name."""
    answers = iter([[PUBLIC_IP]] + [["127.0.0.1"]] * 10)
    net = FakeInternet(server.port, {"rebind.example": lambda: next(answers)}, {PUBLIC_IP: server.port})
    http = HttpFetcher(FetchPolicy(), net.resolve, net.network)
    assert get("http://rebind.example/img.png", http=http) == PAYLOAD
    assert net.lookups == ["rebind.example"] and net.connects == [(PUBLIC_IP, 80)]
    assert server.requests[-1]["host"] == "rebind.example"

    async def two_fetches_in_one_loop():  # a new connection needs a new answer, which is now loopback
        ok = await fetch("http://rebind.example/img.png", MediaConfig(), param="p", http=http2)
        await http2.transport().aclose()  # drop the pooled connection
        http2._pools.clear()
        with pytest.raises(ClientError) as e:
            await fetch("http://rebind.example/img.png", MediaConfig(), param="p", http=http2)
        return ok, e.value

    answers2 = iter([[PUBLIC_IP], ["127.0.0.1"]])
    net2 = FakeInternet(server.port, {"rebind.example": lambda: next(answers2)}, {PUBLIC_IP: server.port})
    http2 = HttpFetcher(FetchPolicy(), net2.resolve, net2.network)
    ok, err = run(two_fetches_in_one_loop())
    assert ok == PAYLOAD and err.code == "media_url_forbidden" and net2.connects == [(PUBLIC_IP, 80)]


def test_tls_uses_the_hostname_for_sni_and_the_certificate_while_connecting_to_the_checked_address(tmp_path):
    server_ctx, client_ctx = self_signed("media.example", tmp_path)
    tls_server = MediaServer(PAYLOAD, tls=server_ctx)
    try:
        net = FakeInternet(tls_server.port, {"media.example": [PUBLIC_IP], "other.example": [PUBLIC_IP]},
                           {PUBLIC_IP: tls_server.port})
        http = HttpFetcher(FetchPolicy(), net.resolve, net.network, ssl_context=client_ctx)
        assert get("https://media.example/img.png", http=http) == PAYLOAD
        assert tls_server.sni == ["media.example"] and tls_server.requests[-1]["host"] == "media.example"
        assert net.connects == [(PUBLIC_IP, 443)]
        # same address, a name the certificate does not cover: the certificate check still applies
        err = refused("https://other.example/img.png", http=http)
        assert err.code == "media_fetch_failed"
    finally:
        tls_server.close()


def test_bodies_are_capped_while_streaming_and_declared_lengths_refused_early(server):
    cfg = MediaConfig(allow_private_networks=True, max_media_bytes=1 << 20)
    base = f"http://127.0.0.1:{server.port}"
    err = refused(f"{base}/declared-huge", cfg)
    assert err.status == 413 and err.code == "media_too_large" and str(10**12) in err.message
    err = refused(f"{base}/endless", cfg)  # 6.5 GB on offer, no length: stopped at the cap
    assert err.status == 413 and err.code == "media_too_large"
    assert get(f"{base}/img.png", MediaConfig(allow_private_networks=True, max_media_bytes=len(PAYLOAD))) == PAYLOAD
    assert refused(f"{base}/img.png", MediaConfig(allow_private_networks=True,
                                                  max_media_bytes=len(PAYLOAD) - 1)).status == 413


def test_one_deadline_covers_the_whole_fetch(server):
    cfg = MediaConfig(allow_private_networks=True, fetch_timeout_s=1.0)
    err = refused(f"http://127.0.0.1:{server.port}/slow", cfg)  # one byte every 0.1 s, forever
    assert err.code == "media_fetch_failed" and "within 1 s" in err.message


def test_compressed_bodies_and_http_errors_are_refused(server):
    cfg = MediaConfig(allow_private_networks=True)
    assert refused(f"http://127.0.0.1:{server.port}/gzip", cfg).code == "media_fetch_failed"
    err = refused(f"http://127.0.0.1:{server.port}/nope.png", cfg)
    assert err.code == "media_fetch_failed" and "404" in err.message


def test_allowed_domains_apply_to_every_hop(server):
    from urllib.parse import quote

    names = {"media.example": [PUBLIC_IP], "img.cdn.example": [PUBLIC_IP], "cdn.example": [PUBLIC_IP],
             "evil.example": [PUBLIC_IP]}
    net = FakeInternet(server.port, names, {PUBLIC_IP: server.port})
    http = HttpFetcher(FetchPolicy(allowed_domains=("media.example", "*.cdn.example")), net.resolve, net.network)
    assert get("http://media.example/img.png", http=http) == PAYLOAD
    assert get("http://IMG.CDN.example./img.png", http=http) == PAYLOAD
    assert refused("http://cdn.example/img.png", http=http).code == "media_url_forbidden"
    assert refused("http://evil.example/img.png", http=http).code == "media_url_forbidden"
    url = "http://media.example/redirect?to=" + quote("http://evil.example/img.png", safe="")
    assert refused(url, http=http).code == "media_url_forbidden"
    assert net.lookups[-1] == "media.example"  # evil.example was refused before any lookup


def test_allowed_private_endpoints_open_exactly_one_address_and_port(server):
    base = f"http://127.0.0.1:{server.port}"
    cfg = MediaConfig(allowed_private_endpoints=[f"127.0.0.1:{server.port}"])
    assert get(f"{base}/img.png", cfg) == PAYLOAD
    assert refused(f"http://127.0.0.1:{server.port + 1}/img.png", cfg).code == "media_url_forbidden"
    assert refused(f"http://[::1]:{server.port}/img.png", cfg).code == "media_url_forbidden"
    assert get(f"{base}/img.png", MediaConfig(allowed_private_endpoints=["127.0.0.0/8"])) == PAYLOAD
    assert get(f"{base}/img.png", MediaConfig(allow_private_networks=True)) == PAYLOAD
    assert parse_endpoint("[fd00::1]:8080")[1] == 8080 and parse_endpoint("fd00::/8")[1] is None
    with pytest.raises(ValueError, match="allowed_private_endpoints"):
        MediaConfig(allowed_private_endpoints=["not-an-address"])


def test_one_pooled_client_per_policy_reuses_connections(server):
    cfg = MediaConfig(allow_private_networks=True)
    policy = FetchPolicy.from_config(cfg)
    assert fetcher_for(policy) is fetcher_for(FetchPolicy.from_config(MediaConfig(allow_private_networks=True)))
    assert fetcher_for(policy) is not fetcher_for(FetchPolicy())

    async def three():
        return [await fetch(f"http://127.0.0.1:{server.port}/img.png", cfg, param="p") for _ in range(3)]

    before = len(server.requests)
    assert run(three()) == [PAYLOAD] * 3
    ports = {r["port"] for r in server.requests[before:]}
    assert len(ports) == 1  # one kept-alive connection served all three


def test_schemes_and_data_urls():
    for url in ["ftp://x/y.png", "gopher://127.0.0.1/", "javascript:alert(1)", "//example.com/x.png", "x",
                "ws://example.com/"]:
        assert refused(url).code == "invalid_media_url", url
    for url in ["data:image/png;base64", "http://[::1/x", "http://exa mple.com/x"]:
        assert refused(url).code in ("invalid_media_url", "media_url_forbidden", "media_fetch_failed"), url
    b64 = base64.b64encode(PAYLOAD).decode()
    assert get(f"DATA:image/png;BASE64,{b64}") == PAYLOAD
    assert get("data:text/plain,%00%01hello") == b"\x00\x01hello"
    err = refused(f"data:image/png;base64,{b64}", MediaConfig(max_media_bytes=100))
    assert err.status == 413 and err.code == "media_too_large"
    assert refused("data:image/png;base64,").code == "invalid_media"


# ---------------------------------------------------------------- file://
@pytest.fixture
def media_root(tmp_path):
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "cat.png").write_bytes(PAYLOAD)
    (root / "sub" / "dog.png").write_bytes(PAYLOAD)
    (tmp_path / "secret.png").write_bytes(b"secret")
    os.symlink(tmp_path / "secret.png", root / "escape.png")
    os.symlink(tmp_path, root / "up")
    os.symlink(root / "cat.png", root / "alias.png")
    os.mkfifo(root / "fifo.png")
    return root


def test_file_urls_are_off_by_default(media_root):
    assert refused(f"file://{media_root}/cat.png").code == "media_url_forbidden"


def test_file_urls_stay_inside_the_allowed_directory(media_root):
    cfg = MediaConfig(allowed_local_media_path=str(media_root), max_media_bytes=1 << 20)
    assert get(f"file://{media_root}/cat.png", cfg) == PAYLOAD
    assert get(f"file://{media_root}/sub/dog.png", cfg) == PAYLOAD
    assert get(f"file://localhost{media_root}/alias.png", cfg) == PAYLOAD  # a link that stays inside
    for bad in [f"file://{media_root}/../secret.png", f"file://{media_root}/sub/%2e%2e/../secret.png",
                f"file://{media_root}/escape.png", f"file://{media_root}/up/secret.png", "file:///etc/passwd",
                f"file://{media_root.parent}/secret.png", f"file://otherhost{media_root}/cat.png",
                f"file://{media_root}/fifo.png", f"file://{media_root}/sub", "file://cat.png",
                f"file://{media_root}/cat.png%00.txt"]:
        assert refused(bad, cfg).code == "media_url_forbidden", bad
    assert refused(f"file://{media_root}/missing.png", cfg).code == "media_fetch_failed"
    small = MediaConfig(allowed_local_media_path=str(media_root), max_media_bytes=10)
    assert refused(f"file://{media_root}/cat.png", small).status == 413
    with pytest.raises(ValueError, match="absolute"):
        MediaConfig(allowed_local_media_path="relative/dir")
