"""One process's budget of media payload bytes in flight (`media.max_media_bytes_in_flight`).

`max_media_bytes` bounds one item, not how many a replica holds: 64 concurrent calls each fetching 256
MiB would hold 16 GiB and kill the replica, and every other request's work with it. So a payload
reserves its bytes here (a body its declared length before reading, else chunk by chunk, growth ahead of
new items; a `data:` URL its decoded size; a file the cap then its size) and gives them back when the
item's decode job has finished (a job the request no longer waits for still holds its bytes), or at once
on failure or cancellation. An item that cannot get its bytes within `media.media_bytes_wait_s` is
refused with 503 `overloaded` and Retry-After. Waiters are served in order. Thread-safe: releases come
from worker threads, and a process may run more than one event loop (warm-up runs on a thread of its
own).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable

from ..errors import ClientError, Overloaded


class _Waiter:
    __slots__ = ("n", "loop", "fut", "granted")

    def __init__(self, n: int, loop: asyncio.AbstractEventLoop, fut: asyncio.Future):
        self.n, self.loop, self.fut, self.granted = n, loop, fut, False


class ByteBudget:
    """At most `capacity` bytes reserved at once; a reservation waits up to `wait_s` for room."""

    def __init__(self, capacity: int, wait_s: float):
        self.capacity, self.wait_s = capacity, wait_s
        self.used = 0
        self._lock = threading.Lock()
        self._waiters: deque[_Waiter] = deque()

    def hold(self, param: str | None = None) -> Reservation:
        """An empty reservation for one item, to grow as its bytes arrive and release once."""
        return Reservation(self, param)

    async def acquire(self, n: int, param: str | None = None, ahead: bool = False) -> None:
        """Reserve `n` bytes: at once when there is room and nobody waits before; else wait in line
        (`ahead`: at its head, for an item that already holds bytes and needs more to finish: new items
        must not starve the ones half received). 413 `media_too_large` for more than the whole budget;
        503 `overloaded` past the wait."""
        if n <= 0:
            return
        if n > self.capacity:
            raise ClientError(f"media payload of {n} bytes exceeds this server's media budget of {self.capacity}",
                              param=param, code="media_too_large", status=413)
        loop = asyncio.get_running_loop()
        with self._lock:
            if not self._waiters and self.used + n <= self.capacity:
                self.used += n
                return
            w = _Waiter(n, loop, loop.create_future())
            if ahead:
                self._waiters.appendleft(w)
            else:
                self._waiters.append(w)
        try:
            async with asyncio.timeout(self.wait_s):
                await w.fut
        except BaseException as e:
            with self._lock:
                if w.granted:  # granted as the wait ended: give it back
                    self.used -= n
                else:
                    self._waiters.remove(w)
                wake = self._grant()
            self._wake(wake)
            if isinstance(e, TimeoutError):
                raise self.overloaded() from None
            raise

    def overloaded(self) -> Overloaded:
        """503 `overloaded` with Retry-After: no room came within the wait."""
        return Overloaded(f"media payloads in flight on this replica are at their limit of {self.capacity} "
                          "bytes (media.max_media_bytes_in_flight); retry shortly")

    def release(self, n: int) -> None:
        """Give back `n` reserved bytes (from any thread) and let waiters in."""
        if n <= 0:
            return
        with self._lock:
            self.used -= n
            wake = self._grant()
        self._wake(wake)

    def _grant(self) -> list[_Waiter]:
        """Under the lock: reserve for the waiters at the head of the line that now fit."""
        granted = []
        while self._waiters and self.used + self._waiters[0].n <= self.capacity:
            w = self._waiters.popleft()
            w.granted = True
            self.used += w.n
            granted.append(w)
        return granted

    def _wake(self, waiters: list[_Waiter]) -> None:
        """Tell the granted waiters; a grant whose loop has closed (nobody waits there any more, and nobody
        would give its bytes back) is given back at once."""
        for w in waiters:
            try:
                w.loop.call_soon_threadsafe(_set, w.fut)
            except RuntimeError:
                self.release(w.n)


def _set(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class Reservation:
    """One item's bytes in a ByteBudget: grows as they arrive, released once (idempotent). Used from its
    event loop only. `waiting`: a wait for room began and did not end with the room; a fetch deadline
    that cut such a wait short is this replica's overload, not a slow source."""

    def __init__(self, budget: ByteBudget, param: str | None = None):
        self.budget, self.param = budget, param
        self.held, self.waiting, self._released = 0, False, False

    async def grow_to(self, n: int) -> None:
        """Hold at least `n` bytes in all."""
        if n <= self.held:
            return
        if self._released:
            raise RuntimeError("a released reservation cannot grow")
        self.waiting = True  # stays True when the wait ends in an exception: see the class docstring
        await self.budget.acquire(n - self.held, self.param, ahead=self.held > 0)
        self.waiting = False
        self.held = n

    async def read_capped(self, cap: int, read: Callable[[], bytes]) -> bytes:
        """`read()` in a thread, `cap` bytes held meanwhile (a file's size is known only inside the read),
        then only what it returned."""
        await self.grow_to(cap)
        data = await asyncio.to_thread(read)
        self.trim_to(len(data))
        return data

    def trim_to(self, n: int) -> None:
        """Hold no more than `n` bytes (a payload smaller than what was reserved for it)."""
        if n < self.held and not self._released:
            extra, self.held = self.held - n, n
            self.budget.release(extra)

    def release(self) -> None:
        if not self._released:
            self._released = True
            held, self.held = self.held, 0
            self.budget.release(held)


_budgets: dict[tuple[int, float], ByteBudget] = {}
_budgets_lock = threading.Lock()


def budget_for(cfg) -> ByteBudget:
    """The process's budget for a MediaConfig's `max_media_bytes_in_flight` and `media_bytes_wait_s`."""
    key = (cfg.max_media_bytes_in_flight, cfg.media_bytes_wait_s)
    with _budgets_lock:
        b = _budgets.get(key)
        if b is None:
            b = _budgets[key] = ByteBudget(*key)
        return b
