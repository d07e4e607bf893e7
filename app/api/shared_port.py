"""HTTP straight into each Router process, on one port that all of a node's Routers share.

Why: Ray Serve's proxy adds process hops (handing the request over, the body fetched back, every chunk
relayed), a large share of a small request's time (benchmarks/results/2026-11-23-ray-hops-routers-own-port-cpu.md),
and a node's one proxy thread caps what all its GPUs serve. Each Router listens on the same port with
SO_REUSEPORT (the kernel spreads connections), serving the same FastAPI app with uvicorn on its own
loop, so routes, API key and errors match Ray Serve's port, which keeps working beside it.

What it gives up: Serve neither counts these requests (the Router reports its `ongoing` ones and
app.serving.autoscaling.RouterAutoscalingPolicy adds them, so scaling sees the whole load) nor applies
`max_ongoing_requests` (the engine's admission still answers 503); `drain` must itself wait for them;
a client must reach a node that runs Routers. Off by default (`router_http_port`); GPU presets turn it on.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket


def bind_shared(host: str, port: int) -> socket.socket:
    """A socket bound to host:port that other processes may bind as well (SO_REUSEPORT), not yet
    listening: the kernel hands a node's new connections only to the listening ones, so a Router can
    take its port (and fail at once if another program holds it) before it is ready to serve."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def listen_shared(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening socket on host:port that other processes may bind as well (SO_REUSEPORT)."""
    sock = bind_shared(host, port)
    sock.listen(backlog)
    return sock


SCOPE_KEY = "vlm.shared_port"  # in the ASGI scope of requests that came in on the shared port


async def unless_client_leaves(work, receive):
    """`work`'s result, or None (the work cancelled) if the client disconnects first. For answers that
    are not streamed, on this port: uvicorn does not cancel a handler whose client went away, so a client
    that timed out would leave its generation running to max_tokens (and a retrying one would multiply
    it). Ray Serve's proxy cancels its handlers itself. Call it once the request's body has been read:
    the next message is then the disconnect."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    return None


class CountInFlight:
    """ASGI middleware: how many HTTP requests are inside `app` now (from the call until it returns,
    which for a streamed answer is after its last chunk). It marks their scope (SCOPE_KEY)."""

    def __init__(self, app):
        self.app = app
        self.ongoing = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope[SCOPE_KEY] = True
        self.ongoing += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.ongoing -= 1


class SharedPortServer:
    """uvicorn serving `app` on a shared port, as a task of the running event loop."""

    def __init__(self, app, sock: socket.socket, backlog: int = 2048):
        """`sock`: a `bind_shared` socket, which starts listening here."""
        import uvicorn

        sock.listen(backlog)
        self.sock = sock
        self.counter = CountInFlight(app)
        # log_config=None: uvicorn's default runs logging.config.dictConfig, which closes every handler the
        # process has, Ray Serve's too, and the replica's log file went silent from here on
        config = uvicorn.Config(self.counter, lifespan="off", access_log=False, log_level="warning",
                                timeout_keep_alive=30, log_config=None)
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

    @property
    def ongoing(self) -> int:
        """Requests in flight on this port."""
        return self.counter.ongoing

    def stop(self) -> None:
        """Stops taking connections; uvicorn lets requests in flight finish (its graceful shutdown)."""
        self.server.should_exit = True

    async def drain(self, timeout_s: float) -> bool:
        """Stops taking connections and waits up to `timeout_s` for the requests in flight to finish;
        True if they did. uvicorn closes the listening socket first, so the kernel hands new connections
        to the node's other Routers, and closes idle keep-alive connections."""
        self.stop()
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout_s)
            return True
        except TimeoutError:
            return False
