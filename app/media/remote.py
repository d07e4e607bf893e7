"""Media preparation in MediaPreprocessor replicas, asked for by the ingress.

Fetching, decoding, resizing, patchifying and hashing an item is CPU work, much of it under the GIL
(costs: benchmarks/results/2026-11-21-router-media-preparation.md); in the ingress it capped the
whole service at what one process can do. Here each item is one call to the MediaPreprocessor
deployment, which autoscales on its own cores. The item belongs to this ingress replica and its rows
are never serialised again after the preprocessor (`RemoteMedia` says how). A bad item's ClientError
cancels the request's other items; a preprocessor replica that dies is a replica failure, and the
item is asked for again (app/api/retry.py), so killing one loses nothing.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

from ..api.retry import RetryPolicy, call_with_retries
from .pipeline import PreparedItem
from .preprocess import PatchSpec
from .ref import MediaRef
from .workers import all_or_first_failure


class RemoteMedia:
    """Same interface as MediaPipeline (`spec`, `prepare_all`), backed by a DeploymentHandle.

    Who serialises what:
    - The item (metadata and uint8 rows) is the call's return value. Ray keeps it in the object store
      and it belongs to the caller, this ingress replica, so it outlives a preprocessor replica that
      autoscaling removes meanwhile (an object the preprocessor `ray.put` itself would die with it;
      Ray 2.56 removed `ray.put(_owner=...)`).
    - The ingress reads the item to build the prompt: numpy arrays come out of the object store as
      views of shared memory, so the rows are mapped, not copied or unpickled.
    - The encoder gets the object reference (`PreparedItem.encoder_ref`), nested in its argument list
      so that Ray does not resolve it on the way, and reads the item from the object store itself.

    Failures: a bad item's ClientError comes back wrapped by Ray and cancels the request's other items
    (so a refused request stops taking preprocessor workers). Because the item belongs to this
    process, an encoder or preprocessor death never loses it."""

    def __init__(self, preprocessor, spec: PatchSpec, retry: RetryPolicy | None = None,
                 on_retry: Callable[[int], None] | None = None):
        """`on_retry(n)`: n calls were sent again for one item (the Router's retry counter)."""
        self.preprocessor, self.spec, self.retry = preprocessor, spec, retry or RetryPolicy()
        self.on_retry = on_retry

    async def _once(self, ref: MediaRef, request_key: str | None) -> PreparedItem:
        resp = self.preprocessor.prepare.remote(ref, request_key)
        try:
            obj = await resp._to_object_ref()
            item: PreparedItem = await obj  # raises the preprocessor's ClientError, wrapped by Ray
        except asyncio.CancelledError:
            resp.cancel()  # a sibling item failed: stop this one in its replica too
            raise
        item.encoder_ref = obj
        return item

    async def prepare(self, ref: MediaRef, request_key: str | None = None) -> PreparedItem:
        item, retries = await call_with_retries(lambda: self._once(ref, request_key), self.retry)
        if retries and self.on_retry is not None:
            self.on_retry(retries)
        return item

    async def prepare_all(self, refs: list[MediaRef]) -> list[PreparedItem]:
        key = uuid.uuid4().hex
        return await all_or_first_failure([self.prepare(r, key) for r in refs])
