"""Request media -> tower-ready items: fetch (async), then decode and preprocess in a worker pool.

Decoding and resizing are CPU-bound; they never run on the asyncio loop. Items leave as raw uint8
patch rows: the encoder normalises them on its device, so a quarter of float32's bytes crosses Ray
and each call is faster (benchmarks/results/2026-11-21-router-media-preparation.md).

`MediaPipeline` runs in one process (the MediaPreprocessor replicas, and the in-process path without
Ray); `app/media/remote.py` asks MediaPreprocessor replicas for the same items from the ingress.
"""

from __future__ import annotations

import asyncio
import hashlib
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..api.prompt import MediaSlot
from ..config import MediaConfig
from .budget import ByteBudget, budget_for
from .decode import IMAGE, VIDEO, decode_video, open_rgb_image
from .fetch import fetch, inline_bytes, inline_size, is_inline
from .limits import Deadline
from .preprocess import (
    Patches,
    PatchSpec,
    frame_timestamps,
    image_frames,
    patchify,
    seconds_per_group,
    video_frames,
)
from .ref import MediaOptions, MediaRef
from .workers import all_or_first_failure, request_slots, run_item


@dataclass
class PreparedItem:
    kind: str
    patches: Patches
    timestamps: list[float] = field(default_factory=list)
    key: str | None = None  # embedding-cache key
    seconds_per_group: float | None = None  # video: Qwen2.5-VL's second_per_grid_ts (temporal positions)
    # Where the encoder gets this item when it was prepared in another process: the object-store
    # reference of the whole item (app/media/remote.py). None: the rows are here, send them.
    encoder_ref: Any = None
    # MiniCPM-V: the tower items of this media item (thumbnail then slices, or one per video frame),
    # each with its own cache key, and the slice grid (cols, rows) of a sliced image. `patches` is
    # then the first part.
    parts: list[Patches] | None = None
    part_keys: list[str] | None = None
    slice_grid: tuple[int, int] | None = None

    def slot(self, merge: int) -> MediaSlot:
        if self.parts is not None:
            return MediaSlot(self.kind, self.patches.grid, self.timestamps, merge, len(self.parts), self.slice_grid)
        return MediaSlot(self.kind, self.patches.grid, self.timestamps, merge)

    def frames(self, temporal: int) -> int:
        """Sampled video frames (0 for an image)."""
        if self.kind != VIDEO:
            return 0
        return len(self.parts) if self.parts is not None else self.patches.grid[0] * temporal

    def tower_inputs(self) -> list[tuple[np.ndarray, tuple[int, int, int], str | None]]:
        """(uint8 rows, grid, cache key) per tower item: one, or MiniCPM-V's parts."""
        if self.parts is None:
            return [(self.patches.pixel_values, self.patches.grid, self.key)]
        return [(p.pixel_values, p.grid, k) for p, k in zip(self.parts, self.part_keys, strict=True)]

    def tower_seconds(self) -> list[float | None]:
        """Per tower item, Qwen2.5-VL's second_per_grid_ts (None but for its videos)."""
        return [self.seconds_per_group] * (1 if self.parts is None else len(self.parts))


_SERVER_SETTINGS = MediaOptions()


def cache_key(kind: str, frames: np.ndarray, spec: PatchSpec) -> str:
    """Hash of the tower's input: the resized uint8 frames and the settings that turn them into rows.
    Equal keys mean equal embeddings; hashing after the resize also reads far fewer bytes than the
    decoded original. SHA-256, not BLAKE2: OpenSSL's SHA-256 uses the CPU's SHA instructions,
    CPython's BLAKE2 is portable C (benchmarks/results/2026-11-23-one-h200-gpu-ceiling-host-path.md).
    A collision-resistant hash, since one client's key must not be able to name another's embeddings."""
    h = hashlib.sha256()
    h.update(repr((kind, frames.shape, str(frames.dtype), spec)).encode())
    h.update(np.ascontiguousarray(frames).data)
    return h.hexdigest()


def _sliced_item(kind: str, images: list[np.ndarray], grid, spec: PatchSpec) -> PreparedItem:
    parts = [patchify(im[None], spec, normalize=False) for im in images]
    keys = [cache_key(IMAGE, im[None], spec) for im in images]
    return PreparedItem(kind, parts[0], key=keys[0], parts=parts, part_keys=keys, slice_grid=grid)


def _decode_video(data: bytes, ref: MediaRef, cfg: MediaConfig, deadline: Deadline | None):
    """Both families' video decode under the same limits (streams, decoded bytes, the item's deadline),
    at the request's fps (`mm_processor_kwargs`) or the server's."""
    fps = ref.options.fps if ref.options is not None and ref.options.fps is not None else cfg.video_fps
    return decode_video(data, param=ref.param, fps=fps, min_frames=cfg.video_min_frames,
                        max_frames=cfg.video_max_frames, max_duration_s=cfg.max_video_duration_s,
                        max_pixels=cfg.max_input_pixels, max_streams=cfg.max_video_streams,
                        max_decoded_bytes=cfg.max_decoded_video_bytes,
                        deadline=deadline or Deadline(cfg.decode_timeout_s, ref.param))


def prepare_sliced(data: bytes, ref: MediaRef, cfg: MediaConfig, spec: PatchSpec,
                   deadline: Deadline | None = None) -> PreparedItem:
    """MiniCPM-V: an image becomes its thumbnail and slices (app/media/slicing.py); a video its sampled
    frames, each resized as an unsliced image (about scale_resolution^2 pixels, patch multiples)."""
    from dataclasses import replace

    from .slicing import slice_image

    if ref.kind == IMAGE:
        sliced = slice_image(open_rgb_image(data, param=ref.param, max_pixels=cfg.max_input_pixels), spec.slicing)
        return _sliced_item(IMAGE, sliced.images, sliced.grid, spec)
    video = _decode_video(data, ref, cfg, deadline)
    whole = replace(spec.slicing, slice_mode=False)
    return _sliced_item(VIDEO, [slice_image(f, whole).thumbnail for f in video.frames], None, spec)


def prepare_bytes(data: bytes, ref: MediaRef, cfg: MediaConfig, spec: PatchSpec,
                  deadline: Deadline | None = None) -> PreparedItem:
    if spec.slicing is not None:
        return prepare_sliced(data, ref, cfg, spec, deadline)
    opts = ref.options or _SERVER_SETTINGS  # the request's resize bounds (mm_processor_kwargs), else the server's
    if ref.kind == IMAGE:
        img = open_rgb_image(data, param=ref.param, max_pixels=cfg.max_input_pixels)
        frames = image_frames(img, spec, *opts.pixels(cfg.image_min_pixels, cfg.image_max_pixels))
        return PreparedItem(IMAGE, patchify(frames, spec, normalize=False), key=cache_key(IMAGE, frames, spec))
    video = _decode_video(data, ref, cfg, deadline)
    frames = video_frames(video.frames, spec, *opts.pixels(cfg.video_min_pixels, cfg.video_max_pixels))
    return PreparedItem(VIDEO, patchify(frames, spec, normalize=False),
                        frame_timestamps(video.indices, video.fps, spec.temporal),
                        key=cache_key(VIDEO, frames, spec),
                        seconds_per_group=seconds_per_group(len(video.indices), video.total_frames, video.fps,
                                                            spec.temporal))


def prepare_inline(ref: MediaRef, cfg: MediaConfig, spec: PatchSpec) -> PreparedItem:
    return prepare_bytes(inline_bytes(ref.url, cfg, param=ref.param), ref, cfg, spec)


class MediaPipeline:
    """Fetches concurrently, then decodes in the worker pool with two guards (app/media/workers.py):
    a request never holds every worker at once, and an item is answered by its deadline. An item's
    payload bytes are reserved in the process's budget (app/media/budget.py; `budget` replaces it) from
    the first byte until its decode job ends."""

    def __init__(self, cfg: MediaConfig, spec: PatchSpec, executor: Executor | None = None,
                 budget: ByteBudget | None = None):
        self.cfg, self.spec, self.executor = cfg, spec, executor
        self.budget = budget or budget_for(cfg)

    async def prepare(self, ref: MediaRef, slots: asyncio.Semaphore | None = None) -> PreparedItem:
        hold = self.budget.hold(ref.param)
        try:
            if is_inline(ref.url):  # base64 decoding is CPU work too: in the worker, off the event loop
                await hold.grow_to(min(inline_size(ref.url), self.cfg.max_media_bytes))
                job, args = prepare_inline, (ref,)
            else:
                job, args = prepare_bytes, (await fetch(ref.url, self.cfg, param=ref.param, hold=hold), ref)
        except BaseException:
            hold.release()
            raise
        return await run_item(self.executor, slots, self.cfg.decode_timeout_s, ref.param,
                              job, *args, self.cfg, self.spec, release=hold.release)

    async def prepare_all(self, refs: list[MediaRef]) -> list[PreparedItem]:
        """All items, or the first failure; a failure (or the caller's cancellation) cancels the
        request's other items, so a refused request stops taking workers."""
        slots = request_slots(self.executor)
        return await all_or_first_failure([self.prepare(r, slots) for r in refs])


def to_encoder_payload(items: list[PreparedItem]) -> list:
    """Per item, its tower inputs ((uint8 rows, grid, cache key) each; MiniCPM-V's parts one after the
    other), or the object-store reference of an item prepared elsewhere (the encoder resolves it and
    expands it to its tower inputs: `expand_payload`; its rows are never serialised again on the way)."""
    out: list = []
    for it in items:
        if it.encoder_ref is not None:
            out.append(it.encoder_ref)
        else:
            out.extend(it.tower_inputs())
    return out


def expand_payload(resolved: list) -> list:
    """The encoder's side: PreparedItems (resolved references) become their tower inputs, in order."""
    out: list = []
    for it in resolved:
        out.extend(it.tower_inputs() if isinstance(it, PreparedItem) else [it])
    return out
