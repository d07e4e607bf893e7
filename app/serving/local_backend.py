"""An in-process backend for ChatService: no Ray, no cross-request batching, no cache.

It encodes each request's items as one batch and generates on the calling thread's engine. Tests use it
as the reference that the Ray deployment's batched and cached answers must equal; it also runs the
whole pipeline in one process for debugging.
"""

from __future__ import annotations

import asyncio

from ..llm.engine import Engine
from ..llm.sequence import GenerationRequest
from ..vision.service import EncoderService


class LocalBackend:
    def __init__(self, encoder: EncoderService, engine: Engine):
        self.encoder, self.engine = encoder, engine

    async def stream(self, gen: dict, payload: list):
        encoded = self.encoder.encode([(px, grid) for px, grid, _ in payload]) if payload else []
        it = self.engine.generate(GenerationRequest.from_router(gen, encoded))
        while (chunk := await asyncio.to_thread(next, it, None)) is not None:
            yield chunk.as_dict()
