"""The Routers' own shared port (app/api/shared_port.py) without Ray: it counts its requests in flight (the
Router reports them for autoscaling), and a drain stops taking connections but lets the answers in flight
finish, since Ray Serve's own drain does not know about them."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route

from app.api.shared_port import SharedPortServer, bind_shared, listen_shared
from app.serving.warmup import WarmupReport


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slow_app(release: asyncio.Event) -> Starlette:
    """One streamed endpoint: a first chunk at once, the last one when `release` is set."""

    async def stream(_request):
        async def body():
            yield b"first;"
            await release.wait()
            yield b"last"

        return StreamingResponse(body(), media_type="text/plain")

    return Starlette(routes=[Route("/slow", stream)])


async def wait_until(condition, timeout_s: float = 5.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_two_listeners_share_one_port():
    port = free_port()
    a = listen_shared("127.0.0.1", port)
    b = listen_shared("127.0.0.1", port)  # a second Router process does the same
    try:
        assert a.getsockname()[1] == b.getsockname()[1] == port
    finally:
        a.close()
        b.close()


def test_a_bound_port_takes_no_connection_until_it_listens_and_a_held_port_fails_the_bind():
    """A Router binds its port in its constructor and listens only once ready: until then the kernel
    gives every new connection to the node's listening Routers. A port another program holds without
    SO_REUSEPORT fails the bind at once (the constructor, so Serve reports the replica failed)."""
    port = free_port()
    ready = listen_shared("127.0.0.1", port)
    joining = bind_shared("127.0.0.1", port)
    try:
        clients = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(20)]
        ready.setblocking(True)
        accepted = [ready.accept()[0] for _ in clients]  # all 20 queued on the listening socket
        joining.listen(16)
        joining.setblocking(False)
        with pytest.raises(BlockingIOError):
            joining.accept()  # nothing was queued on it while it was only bound
        for c in clients + accepted:
            c.close()
    finally:
        ready.close()
        joining.close()
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    try:
        with pytest.raises(OSError):
            bind_shared("127.0.0.1", held.getsockname()[1])
    finally:
        held.close()


def test_requests_in_flight_are_counted_and_a_drain_lets_them_finish():
    async def main():
        release, port = asyncio.Event(), free_port()
        server = SharedPortServer(slow_app(release), bind_shared("127.0.0.1", port))
        await server.started()
        assert server.ongoing == 0
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            async def fetch():
                async with client.stream("GET", "/slow") as r:
                    return r.status_code, b"".join([c async for c in r.aiter_bytes()])

            answers = [asyncio.create_task(fetch()) for _ in range(3)]
            await wait_until(lambda: server.ongoing == 3)
            drain = asyncio.create_task(server.drain(timeout_s=10))
            await wait_until(lambda: server.server.should_exit)
            await asyncio.sleep(0.3)  # uvicorn's main loop notices within 0.1 s and closes the listener
            assert not drain.done() and server.ongoing == 3  # waits for the three answers
            with pytest.raises(httpx.ConnectError):  # no new connections: the kernel sends them elsewhere
                async with httpx.AsyncClient(timeout=2) as fresh:
                    await fresh.get(f"http://127.0.0.1:{port}/slow")
            release.set()
            assert await drain is True
        assert [await a for a in answers] == [(200, b"first;last")] * 3
        assert server.ongoing == 0

    asyncio.run(main())


def test_a_drain_gives_up_after_its_timeout():
    async def main():
        release, port = asyncio.Event(), free_port()
        server = SharedPortServer(slow_app(release), bind_shared("127.0.0.1", port))
        await server.started()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            async def fetch():
                async with client.stream("GET", "/slow") as r:
                    async for _ in r.aiter_bytes():
                        pass

            hung = asyncio.create_task(fetch())
            await wait_until(lambda: server.ongoing == 1)
            assert await server.drain(timeout_s=0.5) is False
            assert server.ongoing == 1  # still in flight: Ray stops the process after its own grace period
            release.set()
            await hung
        await server.task

    asyncio.run(main())


def test_a_client_that_leaves_a_non_streamed_answer_cancels_it_and_one_that_stays_gets_it():
    """uvicorn does not cancel a handler whose client went away: a non-streamed answer on this port runs
    under unless_client_leaves (as the Router's), which cancels its work when the client disconnects,
    and returns the result to a client that waits. The scope is marked as the shared port's."""
    from starlette.responses import JSONResponse, Response

    from app.api.shared_port import SCOPE_KEY, unless_client_leaves

    steps, marked = [], []

    async def answer(request):
        marked.append(request.scope.get(SCOPE_KEY))
        await request.body()

        async def work():
            try:
                for i in range(20):
                    await asyncio.sleep(0.05)
                    steps.append(i)
                return {"ok": True}
            except asyncio.CancelledError:
                steps.append("cancelled")
                raise

        out = await unless_client_leaves(work(), request.receive)
        return JSONResponse(out) if out is not None else Response(status_code=499)

    async def main():
        port = free_port()
        server = SharedPortServer(Starlette(routes=[Route("/a", answer, methods=["POST"])]), bind_shared("127.0.0.1", port))
        await server.started()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.close()  # the client gives up
        await wait_until(lambda: "cancelled" in steps)
        left = len(steps)
        await asyncio.sleep(0.3)
        assert len(steps) == left and steps[-1] == "cancelled"  # nothing ran after it left
        steps.clear()
        async with httpx.AsyncClient() as client:  # one that waits gets its answer
            r = await client.post(f"http://127.0.0.1:{port}/a", content=b"{}")
        assert r.json() == {"ok": True} and steps == list(range(20)) and marked == [True, True]
        await server.drain(2)

    asyncio.run(main())


class _Context:
    servable_object, app_name, deployment = object(), "vlm", "Router"


@pytest.fixture
def router(monkeypatch):
    """deployments/router.py as a Router replica sees it, without Ray Serve: its replica context is set
    and the application reads as having no deployments."""
    import deployments.router as router

    monkeypatch.setattr(router.serve, "get_replica_context", lambda: _Context)
    monkeypatch.setattr(router, "serve_replica_states", lambda name: {})
    return router


def test_the_router_opens_its_port_on_the_app_it_was_given(router):
    """deployments/router.py's `open_shared_port` serves the app its caller passes (the Router's own copy,
    the one holding the API key), not the module's `api` it would find by name, which has no key."""
    given = Starlette(routes=[Route("/given", lambda r: StreamingResponse(iter([b"given"])))])

    async def main():
        sock = bind_shared("127.0.0.1", free_port())
        server = await router.open_shared_port(given, sock)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}") as client:
                assert (await client.get("/given")).text == "given"
                assert (await client.get("/v1/models")).status_code == 404  # not the module's app
        finally:
            assert await server.drain(5)

    asyncio.run(main())


@pytest.mark.parametrize("failure", ["start", "cancel"])
def test_a_failed_or_cancelled_opening_closes_the_port(router, monkeypatch, failure):
    """A server that does not start, or an opening cancelled (the replica stopping), leaves nothing
    listening: the socket is closed and the server told to stop."""
    made = []

    class Failing(SharedPortServer):
        def __init__(self, app, sock):
            super().__init__(app, sock)
            made.append(self)

        async def started(self, timeout_s: float = 10.0) -> None:
            if failure == "start":
                raise TimeoutError("did not start")
            await asyncio.sleep(60)

    monkeypatch.setattr(router, "SharedPortServer", Failing)

    async def main():
        sock = bind_shared("127.0.0.1", free_port())
        task = asyncio.get_running_loop().create_task(router.open_shared_port(slow_app(asyncio.Event()), sock))
        if failure == "cancel":
            await wait_until(lambda: bool(made))
            task.cancel()
        with pytest.raises(TimeoutError if failure == "start" else asyncio.CancelledError):
            await task
        assert sock.fileno() == -1 and made[0].server.should_exit
        await asyncio.sleep(0.05)
        assert made[0].task.done()

    asyncio.run(main())


def test_a_router_of_a_first_deploy_listens_only_once_the_app_serves_and_it_has_warmed(router, monkeypatch):
    """At a first deploy the LLM replicas are still loading when a Router's constructor returns. Its port
    used to listen at once, cold: its first requests after ready met the Router's cold paths. It now waits
    until the other deployments serve, sends its warm-up requests, and only then listens."""
    states = {"LLM": ("UPDATING", {"STARTING": 2}), "Router": ("UPDATING", {"RUNNING": 1})}
    polls = []

    def read(name):
        polls.append(name)
        if len(polls) == 2:  # a controller busy for a moment: the Router asks again, it does not open cold
            raise TimeoutError("the controller did not answer")
        return dict(states)

    monkeypatch.setattr(router, "serve_replica_states", read)
    monkeypatch.setattr(router, "APP_POLL_S", 0.01)
    warmed = []

    async def warm(app, key):
        warmed.append(app)
        return WarmupReport(requests=1)

    monkeypatch.setattr(router, "warm_router", warm)
    given = Starlette(routes=[Route("/given", lambda r: StreamingResponse(iter([b"given"])))])

    async def main():
        sock = bind_shared("127.0.0.1", free_port())
        port = sock.getsockname()[1]
        task = asyncio.get_running_loop().create_task(router.open_shared_port(given, sock))
        await asyncio.sleep(0.2)
        assert len(polls) > 2  # past the failed poll
        assert not task.done() and not warmed  # the LLM replicas are not running yet: no warm-up, no listening
        with pytest.raises(httpx.ConnectError):
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                await client.get("/given", timeout=1)
        states["LLM"] = ("UPDATING", {"RUNNING": 1, "STARTING": 1})
        server = await asyncio.wait_for(task, 5)
        try:
            assert warmed == [given]
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                assert (await client.get("/given")).text == "given"
        finally:
            assert await server.drain(5)

    asyncio.run(main())


def test_a_router_whose_app_never_serves_opens_its_port_cold_after_its_wait(router, monkeypatch):
    """An app whose LLM never starts: the Router gives up waiting after ROUTER_WAIT_FOR_APP_S and listens
    without a warm-up (its /health then says why the app is not ready)."""
    monkeypatch.setattr(router, "serve_replica_states", lambda name: {"LLM": ("DEPLOY_FAILED", {})})
    monkeypatch.setattr(router, "APP_POLL_S", 0.01)
    monkeypatch.setattr(router, "ROUTER_WAIT_FOR_APP_S", 0.1)
    warmed = []
    monkeypatch.setattr(router, "warm_router", lambda app, key: warmed.append(app))

    async def main():
        sock = bind_shared("127.0.0.1", free_port())
        server = await asyncio.wait_for(router.open_shared_port(slow_app(asyncio.Event()), sock), 5)
        assert not warmed
        assert await server.drain(5)

    asyncio.run(main())
