"""The Router's media source: its own threads while it is nearly idle, MediaPreprocessor replicas under load.

A request's first token waits for its media. Sending a small inline image to a MediaPreprocessor
replica and reading the item back costs two Ray hops, several times the image's own decode, patchify
and hash; at concurrency 1 those hops are most of what a request spends outside the GPU
(benchmarks/results/2026-11-25-router-prepares-small-images.md). Under load the replicas are what
keeps decoding off the Router's GIL (issue 12). So a request whose media are all small inline images
is prepared in this process while few others are preparing media here (`AdaptiveMedia`), and
any other request goes to the replicas; at saturation they take nearly every request, and nothing is
lost there. Both give the same items.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from .decode import IMAGE
from .fetch import is_inline
from .pipeline import MediaPipeline, PreparedItem
from .ref import MediaRef
from .remote import RemoteMedia
from .workers import pool_size


class CountingPool(ThreadPoolExecutor):
    """A thread pool that knows how many jobs it holds, queued or running (`jobs`)."""

    def __init__(self, max_workers: int, thread_name_prefix: str = ""):
        super().__init__(max_workers=max_workers, thread_name_prefix=thread_name_prefix)
        self.jobs, self._lock = 0, threading.Lock()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        with self._lock:
            self.jobs += 1
        try:
            fut = super().submit(fn, *args, **kwargs)
        except BaseException:
            self._done(None)
            raise
        fut.add_done_callback(self._done)
        return fut

    def _done(self, _fut) -> None:
        with self._lock:
            self.jobs -= 1

    def has_free_worker(self) -> bool:
        return self.jobs < pool_size(self)


class AdaptiveMedia:
    """Same interface as MediaPipeline and RemoteMedia (`spec`, `prepare_all`).

    A request whose media are all inline (`data:`) images within `router_local_bytes` is prepared here
    when fewer than `router_local_below` requests are preparing media in this Router (0: never) and a
    worker of its pool is free. The second condition matters because a request's jobs can outlive it
    (a failed sibling item, a client gone, a deadline: the job already handed to a thread runs to its
    end); without it, requests that fail at once could pile decoding work onto the Router's threads
    while it looks idle. "Nearly idle" is about media only: a Router streaming many answers still
    prepares the next image itself when none other is preparing media.

    Items prepared here carry their rows to the encoder in the call's arguments (Ray puts them in the
    object store on each call, so a retry after a replica failure sends them again); the rest are
    object-store references as before (app/media/remote.py)."""

    def __init__(self, remote: RemoteMedia, local: MediaPipeline, below: int, max_bytes: int,
                 on_choice: Callable[[str], None] | None = None):
        """`local` runs on a CountingPool (its executor); `on_choice(where)`: "local" or "remote" once per
        request with media (the Router's metrics)."""
        if not isinstance(local.executor, CountingPool):
            raise TypeError("the Router's own media pipeline needs a CountingPool: it must see leftover jobs")
        self.remote, self.local, self.below, self.max_bytes = remote, local, below, max_bytes
        self.spec, self.on_choice = remote.spec, on_choice
        self.preparing = 0  # requests preparing media in this Router, here or in the replicas

    def is_local(self, refs: list[MediaRef]) -> bool:
        """Inline images only (no network from the Router, no video decodes on its threads), small."""
        if self.preparing >= self.below or not refs or not self.local.executor.has_free_worker():
            return False
        size = 0
        for r in refs:
            if r.kind != IMAGE or not is_inline(r.url):
                return False
            size += len(r.url)
        return size <= self.max_bytes

    async def prepare_all(self, refs: list[MediaRef]) -> list[PreparedItem]:
        if not refs:  # text only: nothing to prepare, nothing to count
            return []
        where = "local" if self.is_local(refs) else "remote"
        if self.on_choice is not None:
            self.on_choice(where)
        self.preparing += 1
        try:
            return await (self.local if where == "local" else self.remote).prepare_all(refs)
        finally:
            self.preparing -= 1
