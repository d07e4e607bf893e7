"""The Router's media source: its own threads while it is nearly idle, MediaPreprocessor replicas under load.

A request's first token waits for its media. Sending a small inline image to a MediaPreprocessor replica
and reading the item back costs two Ray hops: on an H200 host the Router's trace put about 8 ms between
its handler and the replica's call and 11 ms in the call, for an image that takes 2-3 ms to decode,
patchify and hash (benchmarks/RESULTS.md). At concurrency 1 those hops are most of what a request spends
outside the GPU. Under load the replicas are what keeps decoding off the Router's GIL (issue 12).

So a request whose media are all inline (`data:`) images within `router_local_bytes` is prepared in this
process when fewer than `router_local_below` requests are preparing media here (0: never); any other
request, and every request while the Router is busy, goes to the replicas. Items prepared here carry
their rows to the encoder in the call's arguments (Ray puts them in the object store once); the rest
are object-store references as before (app/media/remote.py). Both give the same items.
"""

from __future__ import annotations

from collections.abc import Callable

from .decode import IMAGE
from .pipeline import MediaPipeline, PreparedItem
from .ref import MediaRef
from .remote import RemoteMedia


class AdaptiveMedia:
    """Same interface as MediaPipeline and RemoteMedia (`spec`, `prepare_all`)."""

    def __init__(self, remote: RemoteMedia, local: MediaPipeline, below: int, max_bytes: int,
                 on_choice: Callable[[str], None] | None = None):
        """`on_choice(where)`: "local" or "remote" once per request (the Router's metrics)."""
        self.remote, self.local, self.below, self.max_bytes = remote, local, below, max_bytes
        self.spec, self.on_choice = remote.spec, on_choice
        self.preparing = 0  # requests preparing media in this Router, here or in the replicas
        self.counts = {"local": 0, "remote": 0}

    def is_local(self, refs: list[MediaRef]) -> bool:
        """Inline images only (no network from the Router, no video decodes on its threads), small."""
        if self.preparing >= self.below or not refs:
            return False
        size = 0
        for r in refs:
            if r.kind != IMAGE or not r.url.startswith("data:"):
                return False
            size += len(r.url)
        return size <= self.max_bytes

    async def prepare_all(self, refs: list[MediaRef]) -> list[PreparedItem]:
        where = "local" if self.is_local(refs) else "remote"
        self.counts[where] += 1
        if self.on_choice is not None:
            self.on_choice(where)
        self.preparing += 1
        try:
            return await (self.local if where == "local" else self.remote).prepare_all(refs)
        finally:
            self.preparing -= 1
