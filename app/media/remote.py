"""Media preparation in MediaPreprocessor replicas, asked for by the ingress.

Fetching, decoding, resizing, patchifying and hashing an item costs 3-200 ms of CPU (benchmarks/RESULTS.md,
"Router media preparation"), much of it under the GIL; in the ingress it capped the whole service at what one process can do. Here each item is one
call to the MediaPreprocessor deployment, which autoscales on its own cores.

Who serialises what:
- The item (metadata and uint8 rows) is the call's return value. Ray keeps it in the object store and
  it belongs to the caller, this ingress replica, so it outlives a preprocessor replica that
  autoscaling removes meanwhile (an object the preprocessor `ray.put` itself would die with it; Ray
  2.56 removed `ray.put(_owner=...)`).
- The ingress reads the item to build the prompt: numpy arrays come out of the object store as views
  of shared memory, so the rows are mapped, not copied or unpickled.
- The encoder gets the object reference (`PreparedItem.encoder_ref`), nested in its argument list so
  that Ray does not resolve it on the way, and reads the item from the object store itself. The rows
  are never serialised again after the preprocessor.
"""

from __future__ import annotations

import asyncio

from .pipeline import PreparedItem
from .preprocess import PatchSpec
from .ref import MediaRef


class RemoteMedia:
    """Same interface as MediaPipeline (`spec`, `prepare_all`), backed by a DeploymentHandle."""

    def __init__(self, preprocessor, spec: PatchSpec):
        self.preprocessor, self.spec = preprocessor, spec

    async def prepare(self, ref: MediaRef) -> PreparedItem:
        obj = await self.preprocessor.prepare.remote(ref)._to_object_ref()
        item: PreparedItem = await obj  # raises the preprocessor's ClientError, wrapped by Ray
        item.encoder_ref = obj
        return item

    async def prepare_all(self, refs: list[MediaRef]) -> list[PreparedItem]:
        return list(await asyncio.gather(*(self.prepare(r) for r in refs)))
