"""Request media -> tower-ready items: fetch (async), then decode and preprocess in a worker pool.

Decoding and resizing are CPU-bound; they never run on the asyncio loop.
"""

from __future__ import annotations

import asyncio
import hashlib
from concurrent.futures import Executor
from dataclasses import dataclass, field

import numpy as np

from .config import MediaConfig
from .media import IMAGE, VIDEO, decode_image, decode_video, fetch
from .preprocess import Patches, PatchSpec, frame_timestamps, preprocess_image, preprocess_video
from .prompt import MediaSlot
from .schemas import MediaRef


@dataclass
class PreparedItem:
    kind: str
    patches: Patches
    timestamps: list[float] = field(default_factory=list)
    key: str | None = None  # embedding-cache key

    def slot(self, merge: int) -> MediaSlot:
        return MediaSlot(self.kind, self.patches.grid, self.timestamps, merge)


def cache_key(kind: str, pixels: np.ndarray, *params) -> str:
    """Hash of the decoded pixels plus every parameter that shapes the tower's input."""
    h = hashlib.blake2b(digest_size=20)
    h.update(repr((kind, pixels.shape, str(pixels.dtype), params)).encode())
    h.update(np.ascontiguousarray(pixels).data)
    return h.hexdigest()


def prepare_bytes(data: bytes, ref: MediaRef, cfg: MediaConfig, spec: PatchSpec) -> PreparedItem:
    if ref.kind == IMAGE:
        img = decode_image(data, param=ref.param, max_pixels=cfg.max_input_pixels)
        bounds = (cfg.image_min_pixels, cfg.image_max_pixels)
        return PreparedItem(IMAGE, preprocess_image(img, spec, *bounds), key=cache_key(IMAGE, img, spec, bounds))
    video = decode_video(data, param=ref.param, fps=cfg.video_fps, min_frames=cfg.video_min_frames,
                         max_frames=cfg.video_max_frames, max_duration_s=cfg.max_video_duration_s,
                         max_pixels=cfg.max_input_pixels)
    bounds = (cfg.video_min_pixels, cfg.video_max_pixels)
    patches = preprocess_video(video.frames, spec, *bounds)
    return PreparedItem(VIDEO, patches, frame_timestamps(video.indices, video.fps, spec.temporal),
                        key=cache_key(VIDEO, video.frames, spec, bounds, video.indices, video.fps))


class MediaPipeline:
    def __init__(self, cfg: MediaConfig, spec: PatchSpec, executor: Executor | None = None):
        self.cfg, self.spec, self.executor = cfg, spec, executor

    async def prepare(self, ref: MediaRef) -> PreparedItem:
        data = await fetch(ref.url, timeout_s=self.cfg.fetch_timeout_s, max_bytes=self.cfg.max_media_bytes,
                           param=ref.param)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, prepare_bytes, data, ref, self.cfg, self.spec)

    async def prepare_all(self, refs: list[MediaRef]) -> list[PreparedItem]:
        return list(await asyncio.gather(*(self.prepare(r) for r in refs)))


def to_encoder_payload(items: list[PreparedItem]) -> list[tuple[np.ndarray, tuple[int, int, int], str | None]]:
    return [(it.patches.pixel_values, it.patches.grid, it.key) for it in items]
