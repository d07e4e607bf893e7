"""HTTP straight into each Router process, on one port that all of a node's Routers share.

Why. Through Ray Serve's HTTP proxy a request costs two extra process hops: the proxy hands the request
to a Router replica, the Router fetches the body back from the proxy with one more call, and every
streamed chunk travels Router -> proxy -> client. On the 2-core machine those hops were 8-10 ms of a
trivial request's 24-31 ms at concurrency 1 (benchmarks/ray_hops.py), and a node has one proxy process,
whose single Python thread caps what every GPU of the node can serve.

How. Each Router replica listens on the same port with SO_REUSEPORT, so the kernel spreads incoming
connections over the node's Router processes; there is no proxy and no hop in between. The server is
uvicorn on the replica's own event loop, running the same FastAPI app that Ray Serve calls, so the
routes, the API key check and the error shapes are the same on both ports. Ray Serve's proxy port keeps
working beside it.

What it gives up: Ray Serve neither counts these requests for the Router's autoscaling nor applies its
`max_ongoing_requests` to them (the engine's own admission still answers 503), and a client must reach
the node that runs Routers. Off by default (`router_http_port`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket


def listen_shared(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening socket on host:port that other processes may bind as well (SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


class SharedPortServer:
    """uvicorn serving `app` on a shared port, as a task of the running event loop."""

    def __init__(self, app, host: str, port: int):
        import uvicorn

        self.sock = listen_shared(host, port)
        config = uvicorn.Config(app, lifespan="off", access_log=False, log_level="warning",
                                timeout_keep_alive=30)
        self.server = uvicorn.Server(config)
        self.server.capture_signals = contextlib.nullcontext  # the replica's signals are Ray's
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.sock]))

    async def started(self, timeout_s: float = 10.0) -> None:
        """Until uvicorn accepts connections; raises if it failed to start."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self.server.started:
            if self.task.done():
                self.task.result()  # raises the start-up error
                raise RuntimeError("the shared-port HTTP server stopped during start-up")
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError("the shared-port HTTP server did not start")
            await asyncio.sleep(0.01)

    def stop(self) -> None:
        """Stops taking connections; uvicorn lets requests in flight finish (its graceful shutdown)."""
        self.server.should_exit = True
