"""Local stand-ins for the internet, for fetch tests on a machine without one.

- `MediaServer`: a threaded HTTP(S) server on 127.0.0.1 with routes for media, redirects, oversized,
  slow and stalled bodies; it records every request (path, Host header, TLS SNI, client port).
- `FakeInternet`: a resolver that gives made-up names public addresses, and a network backend that
  carries connections to those public addresses to the local server, recording every address it was
  asked to connect to. The fetcher's policy code is the production code: only DNS and routing are
  simulated, as a test of "a public host that redirects to 169.254.169.254" needs.
"""

from __future__ import annotations

import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import httpcore


class MediaServer:
    def __init__(self, payload: bytes, tls: ssl.SSLContext | None = None):
        self.payload, self.requests, self.sni = payload, [], []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, code: int, body: bytes = b"", headers: dict | None = None):
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                if "content-length" not in {k.lower() for k in (headers or {})}:
                    self.send_header("content-length", str(len(body)))
                self.end_headers()
                if body:
                    self.wfile.write(body)

            def do_GET(self):  # noqa: N802
                parts = urlsplit(self.path)
                q = {k: v[0] for k, v in parse_qs(parts.query).items()}
                server.requests.append({"path": parts.path, "host": self.headers.get("host"),
                                        "port": self.client_address[1]})
                route = parts.path
                if route == "/img.png":
                    self._send(200, server.payload, {"content-type": "image/png"})
                elif route == "/redirect":
                    self._send(int(q.get("code", 302)), headers={"location": q["to"]})
                elif route.startswith("/chain/"):
                    n = int(route.rsplit("/", 1)[1])
                    self._send(302, headers={"location": f"/chain/{n - 1}" if n else "/img.png"})
                elif route == "/declared-huge":
                    self._send(200, b"x" * 10, {"content-length": str(10**12)})
                    self.close_connection = True
                elif route == "/endless":  # no length: read until the connection closes
                    self.send_response(200)
                    self.send_header("connection", "close")
                    self.end_headers()
                    try:
                        for _ in range(100_000):
                            self.wfile.write(b"\0" * 65536)
                    except OSError:
                        pass
                    self.close_connection = True
                elif route == "/slow":
                    self.send_response(200)
                    self.send_header("content-length", "1000000")
                    self.end_headers()
                    try:
                        for _ in range(600):
                            self.wfile.write(b"\0")
                            self.wfile.flush()
                            time.sleep(0.1)
                    except OSError:
                        pass
                    self.close_connection = True
                elif route == "/stall":  # a quarter of its 1 MiB at once, then nothing for 30 s
                    self.send_response(200)
                    self.send_header("content-length", str(1 << 20))
                    self.end_headers()
                    try:
                        self.wfile.write(b"\0" * (256 << 10))
                        self.wfile.flush()
                        time.sleep(30)
                    except OSError:
                        pass
                    self.close_connection = True
                elif route == "/halves":  # the payload's first half, a pause of 0.3 s, the second half
                    self.send_response(200)
                    self.send_header("content-length", str(len(server.payload)))
                    self.end_headers()
                    half = len(server.payload) // 2
                    try:
                        self.wfile.write(server.payload[:half])
                        self.wfile.flush()
                        time.sleep(0.3)
                        self.wfile.write(server.payload[half:])
                    except OSError:
                        pass
                    self.close_connection = True
                elif route == "/gzip":
                    self._send(200, b"\x1f\x8b" + b"\0" * 20, {"content-encoding": "gzip"})
                else:
                    self._send(404, b"missing")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        if tls is not None:
            tls.sni_callback = lambda sock, name, ctx: self.sni.append(name)
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def paths(self) -> list[str]:
        return [r["path"] for r in self.requests]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class FakeInternet:
    """Names -> addresses (lists, or callables for answers that change), and public addresses routed to
    the local server's port."""

    def __init__(self, port: int, names: dict, routes: dict[str, int] | None = None):
        self.port, self.names, self.routes = port, names, routes
        self.lookups: list[str] = []
        self.connects: list[tuple[str, int]] = []
        inner = httpcore.AnyIOBackend()
        fake = self

        class Network(httpcore.AsyncNetworkBackend):
            async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
                fake.connects.append((host, port))
                target = (fake.routes or {}).get(host)
                if target is None:
                    raise httpcore.ConnectError(f"{host} is unreachable in the fake internet")
                return await inner.connect_tcp("127.0.0.1", target, timeout=timeout)

            async def sleep(self, seconds):
                await inner.sleep(seconds)

        self.network = Network()

    async def resolve(self, host: str, port: int) -> list[str]:
        self.lookups.append(host)
        answer = self.names.get(host)
        if answer is None:
            raise OSError(-2, "Name or service not known")
        return list(answer()) if callable(answer) else list(answer)


def self_signed(hostname: str, tmp_path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server context with a certificate for `hostname`, client context that trusts only it)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hostname)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(hostname)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    (tmp_path / "cert.pem").write_bytes(cert_pem)
    (tmp_path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                         serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    client = ssl.create_default_context(cafile=str(tmp_path / "cert.pem"))
    return server, client


def serve_aiohttp(app):
    """Serve an aiohttp `app` on a free port from its own event loop in a background thread: yields the
    base URL, then stops the server (use with `yield from` in a pytest fixture)."""
    import asyncio

    from aiohttp import web

    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
