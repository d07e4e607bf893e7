"""A request's encoder payload as the replica that encodes it receives it (VisionEncoder, or the LLM
under the `fused` placement): object-store references of PreparedItems, from MediaPreprocessor
replicas, are read here (zero-copy on the same node) and expanded to tower inputs."""

from __future__ import annotations

import asyncio

import ray

from app.media.pipeline import expand_payload


async def resolve_payload(items: list) -> list:
    """Tower inputs (uint8 rows, grid, cache key) in order; a MiniCPM-V item becomes several."""
    refs = [i for i, it in enumerate(items) if isinstance(it, ray.ObjectRef)]
    if not refs:
        return items
    items = list(items)
    for i, prepared in zip(refs, await asyncio.gather(*(items[i] for i in refs))):
        items[i] = prepared
    return expand_payload(items)
