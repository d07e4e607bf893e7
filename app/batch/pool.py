"""An autoscaled pool of Ray core actors for one stage.

Calls go to the actor with the fewest rows in flight, at most `max_in_flight` rows each (a call
carries a chunk of rows; one larger than an actor's capacity takes the whole of an idle actor); a
caller with no room waits, and callers are served in turn (a smaller call arriving later would
otherwise keep an actor from ever being idle for a larger one). While callers wait and the pool is below `max_size`, one more actor is started (one
at a time: it joins when its `ready()` returns, and until the cluster has room for it, it stays
pending, which is what makes a Ray autoscaler add a node). An actor idle for `idle_s` is removed
while the pool is above `min_size`. A dead actor (node lost, preempted) leaves the pool; the caller
retries on another (job.py) and the pool refills to `min_size`. An actor that fails to start is tried
again after a growing pause; after START_ATTEMPTS failures in a row with no actor left, callers get
PoolFailed instead of waiting for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import ray

from .config import PoolConfig

log = logging.getLogger(__name__)

START_ATTEMPTS = 5  # failed starts in a row, with no actor left, before the pool gives up
START_BACKOFF_S = 2.0  # the pause before a start after a failed one, doubling, at most 30 s


class PoolFailed(RuntimeError):
    """No actor of the stage is left and new ones keep failing to start."""


@dataclass(eq=False)
class Member:
    handle: object
    capacity: int
    in_flight: int = 0
    idle_since: float = field(default_factory=time.monotonic)


class ActorPool:
    def __init__(self, name: str, cls: type, args: Callable[[int], tuple], cfg: PoolConfig, num_gpus: float,
                 on_remove: Callable[[Member], Awaitable] | None = None):
        self.name, self.cfg, self.on_remove = name, cfg, on_remove
        self.remote_cls = ray.remote(cls).options(num_cpus=cfg.num_cpus, num_gpus=num_gpus, max_concurrency=1000,
                                                  max_restarts=0)
        self.args = args  # the constructor's arguments for the n-th actor started
        self.started = 0
        self.members: list[Member] = []
        self.starting: asyncio.Task | None = None
        self.peak = 0
        self.cond = asyncio.Condition()
        self._closed = False
        self.start_failures = 0  # failed starts in a row
        self.failed: BaseException | None = None  # set when the pool gives up (PoolFailed)
        self._tasks: set[asyncio.Task] = set()
        self._turns: deque[object] = deque()  # callers waiting to acquire, first come first served

    async def start(self) -> None:
        """`min_size` actors, all ready."""
        await asyncio.gather(*(self._add() for _ in range(self.cfg.min_size)))

    async def _add(self) -> None:
        if self.start_failures:  # the last start failed: give the cause (GPU memory, a file) time to pass
            await asyncio.sleep(min(30.0, START_BACKOFF_S * 2 ** (self.start_failures - 1)))
        handle = self.remote_cls.remote(*self.args(self.started))
        self.started += 1
        try:
            await handle.ready.remote()
            capacity = self.cfg.max_in_flight
            if hasattr(handle, "capacity"):
                capacity = max(capacity, await handle.capacity.remote())
        except BaseException:  # failed, or cancelled by close(): a pending actor must not linger
            with contextlib.suppress(Exception):
                ray.kill(handle)
            raise
        async with self.cond:
            if self._closed:
                ray.kill(handle)
                return
            self.members.append(Member(handle, capacity))
            self.peak = max(self.peak, len(self.members))
            self.start_failures = 0
            self.cond.notify_all()
        log.info("%s pool: %d actor(s)", self.name, len(self.members))

    def _grow(self) -> None:
        if self.starting is None and len(self.members) < self.cfg.max_size and not self._closed:
            self.starting = asyncio.get_running_loop().create_task(self._add())
            self.starting.add_done_callback(self._started)

    def _started(self, task: asyncio.Task) -> None:
        self.starting = None
        if task.cancelled() or task.exception() is None:
            return
        self.start_failures += 1
        log.warning("%s pool: an actor failed to start (%d in a row): %s", self.name, self.start_failures,
                    task.exception())
        if self.start_failures >= START_ATTEMPTS and not self.members:
            self.failed = task.exception()
        # the callers waiting for a slot try again (a new start) or, if the pool gave up, fail
        wake = asyncio.get_running_loop().create_task(self._wake())
        self._tasks.add(wake)
        wake.add_done_callback(self._tasks.discard)

    async def _wake(self) -> None:
        async with self.cond:
            self.cond.notify_all()

    @property
    def gave_up(self) -> bool:
        """No actor left and starts keep failing: every caller gets PoolFailed, so the driver stops
        starting rows (each would only fail)."""
        return self.failed is not None and not self.members

    async def acquire(self, rows: int = 1) -> tuple[Member, int]:
        """(an actor, the slots taken for `rows` rows: at most its capacity); give both to release()."""
        turn = object()
        async with self.cond:
            self._turns.append(turn)
            try:
                while True:
                    if self.gave_up:
                        raise PoolFailed(f"{self.name}: no actor left and {self.start_failures} starts in a row "
                                         f"failed; the last: {self.failed}")
                    free = [m for m in self.members if m.in_flight + min(rows, m.capacity) <= m.capacity]
                    if free and self._turns[0] is turn:
                        m = min(free, key=lambda m: m.in_flight)
                        taken = min(rows, m.capacity)
                        m.in_flight += taken
                        return m, taken
                    if not free:
                        self._grow()  # no room for this caller: one more actor, if the pool may grow
                    await self.cond.wait()
            finally:
                self._turns.remove(turn)
                self.cond.notify_all()  # the next caller's turn

    async def release(self, m: Member, taken: int = 1, dead: bool = False) -> None:
        async with self.cond:
            m.in_flight -= taken
            if m.in_flight == 0:
                m.idle_since = time.monotonic()
            if dead and m in self.members:
                self.members.remove(m)
                log.warning("%s pool: an actor died; %d left", self.name, len(self.members))
            self.cond.notify_all()

    async def shrink(self) -> None:
        """Remove actors idle past `idle_s`, keeping `min_size`."""
        now = time.monotonic()
        async with self.cond:
            for m in list(self.members):
                if len(self.members) <= self.cfg.min_size:
                    break
                if m.in_flight == 0 and now - m.idle_since > self.cfg.idle_s:
                    self.members.remove(m)
                    await self._remove(m)
                    log.info("%s pool: idle actor removed; %d left", self.name, len(self.members))

    async def _remove(self, m: Member) -> None:
        if self.on_remove is not None:
            with contextlib.suppress(Exception):
                await self.on_remove(m)
        ray.kill(m.handle)

    async def close(self) -> None:
        async with self.cond:
            self._closed = True
            members, self.members = self.members, []
        if self.starting is not None:
            self.starting.cancel()
        for m in members:
            await self._remove(m)
