"""Qwen-style preprocessing without torchvision: smart resize, normalise, patchify.

Produces exactly the tower's input layout: `pixel_values` rows of C*T*P*P values, ordered by
temporal group, then merge block, then patch inside the block, and `grid_thw` in patches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ClientError


@dataclass(frozen=True)
class PatchSpec:
    """The checkpoint's processor settings that fix the tower's input layout."""

    patch: int = 16
    temporal: int = 2
    merge: int = 2
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    # MiniCPM-V: its slicing settings (app.media.slicing.SliceSpec); images are sliced, not smart-resized
    slicing: Any = None

    @property
    def factor(self) -> int:
        return self.patch * self.merge

    def column_norm(self) -> tuple[np.ndarray, np.ndarray]:
        """(scale, offset), float32, one per column of a tower row (C, T, P, P): the processor's
        rescale and normalise as one multiply-add, x * scale + offset, on uint8 rows."""
        std = np.asarray(self.std, np.float32)
        per_channel = self.temporal * self.patch * self.patch
        scale = np.repeat((1 / (255 * std)).astype(np.float32), per_channel)
        offset = np.repeat(-np.asarray(self.mean, np.float32) / std, per_channel)
        return scale, offset


@dataclass
class Patches:
    pixel_values: np.ndarray  # [t*h*w, C*T*P*P]: float32 normalised, or uint8 (patchify(normalize=False))
    grid: tuple[int, int, int]

    @property
    def num_tokens(self) -> int:
        """Tokens the LLM sees (after the spatial merge)."""
        t, h, w = self.grid
        return t * h * w // 4


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Dimensions divisible by `factor`, pixel count within bounds, aspect ratio kept (Qwen's rule)."""
    if min(height, width) <= 0:
        raise ClientError("image has a zero dimension", code="invalid_image")
    if max(height, width) / min(height, width) > 200:
        raise ClientError(f"aspect ratio {max(height, width) / min(height, width):.0f} exceeds 200",
                          code="invalid_image")
    # As transformers rounds: a side of at most factor / 2 rounds to 0 here, so the product falls below
    # min_pixels and the image is scaled up as a whole (lifting that side to `factor` first, as before,
    # could skip the upscale and gave another grid: 15 x 3000 at factor 32 encoded 40 fewer columns).
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return max(factor, h_bar), max(factor, w_bar)  # a side still 0 (min_pixels 0): one patch row


def _resize(frames: np.ndarray, h: int, w: int) -> np.ndarray:
    from PIL import Image

    if frames.shape[1:3] == (h, w):
        return frames
    return np.stack([np.asarray(Image.fromarray(f).resize((w, h), Image.Resampling.BICUBIC)) for f in frames])


def patchify(frames: np.ndarray, spec: PatchSpec, normalize: bool = True) -> Patches:
    """[n, H, W, 3] uint8 frames (H, W already multiples of patch*merge) -> tower rows.

    The patch layout is gathered on the uint8 frames (a quarter of the bytes of float32). With
    `normalize` (the reference processor's float32 rows), rescale and normalise then run as one
    multiply-add into the output, x * (1 / (255 std)) - mean / std: several times faster than the
    processor's convert-then-transpose (benchmarks/results/2026-11-21-router-media-preparation.md).
    Without it the rows stay uint8 and the encoder normalises them on its device (`column_norm`):
    the router sends a quarter of the bytes.
    """
    n, hh, ww, c = frames.shape
    p, m, tp = spec.patch, spec.merge, spec.temporal
    if n % tp:  # pad the last temporal group with copies of the last frame
        frames = np.concatenate([frames, np.repeat(frames[-1:], tp - n % tp, axis=0)])
        n = frames.shape[0]
    gt, gh, gw = n // tp, hh // p, ww // p
    # (group, frame in group, block row, row in block, patch row, block col, col in block, patch col, C)
    # -> rows ordered (group, block row, block col, row in block, col in block), each row (C, T, P, P)
    x = frames.reshape(gt, tp, gh // m, m, p, gw // m, m, p, c).transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)
    rows = np.ascontiguousarray(x).reshape(gt * gh * gw, c * tp * p * p)
    if not normalize:
        return Patches(rows, (gt, gh, gw))
    scale, offset = spec.column_norm()
    out = np.empty(rows.shape, np.float32)
    np.multiply(rows, scale, out=out)
    out += offset
    return Patches(out, (gt, gh, gw))


def image_frames(image, spec: PatchSpec, min_pixels: int, max_pixels: int) -> np.ndarray:
    """[1, h, w, 3] uint8: the image resized to the tower's grid (Qwen's smart resize, bicubic).

    `image` is an [H, W, 3] uint8 array or an RGB PIL image. A PIL image is resized as it is, with no
    full-size array made first (the pixels, and so the result, are the same).
    """
    from PIL import Image

    if isinstance(image, Image.Image):
        h0, w0 = image.height, image.width
        h, w = smart_resize(h0, w0, spec.factor, min_pixels, max_pixels)
        if (h, w) != (h0, w0):
            image = image.resize((w, h), Image.Resampling.BICUBIC)
        return np.asarray(image)[None]
    h, w = smart_resize(image.shape[0], image.shape[1], spec.factor, min_pixels, max_pixels)
    return _resize(image[None], h, w)


def video_frames(frames: np.ndarray, spec: PatchSpec, min_pixels: int, max_pixels: int) -> np.ndarray:
    """[n, h, w, 3] uint8: every frame resized to the same grid (per-frame pixel bounds)."""
    h, w = smart_resize(frames.shape[1], frames.shape[2], spec.factor, min_pixels, max_pixels)
    return _resize(frames, h, w)


def preprocess_image(image, spec: PatchSpec, min_pixels: int, max_pixels: int) -> Patches:
    """One image -> tower rows (its one frame fills both temporal slots, as the reference does)."""
    return patchify(image_frames(image, spec, min_pixels, max_pixels), spec)


def preprocess_video(frames: np.ndarray, spec: PatchSpec, min_pixels: int, max_pixels: int) -> Patches:
    return patchify(video_frames(frames, spec, min_pixels, max_pixels), spec)


def frame_timestamps(indices: list[int], fps: float, temporal: int) -> list[float]:
    """Seconds of each temporal group: mean of its first and last source frame (Qwen3-VL's rule)."""
    idx = list(indices)
    if len(idx) % temporal:
        idx += [idx[-1]] * (temporal - len(idx) % temporal)
    ts = [i / fps for i in idx]
    return [(ts[i] + ts[i + temporal - 1]) / 2 for i in range(0, len(ts), temporal)]


def seconds_per_group(num_sampled: int, total_frames: int, fps: float, temporal: int) -> float:
    """Seconds one temporal group of a sampled video spans, as transformers' Qwen2.5-VL processor gives
    `second_per_grid_ts`: temporal / sampled fps, the sampled fps being num_sampled / total_frames x fps
    (transformers' `VideoMetadata.sampled_fps`, whose fallback without timing is the fps, else 24).
    Qwen2.5-VL's M-RoPE spaces a video's temporal positions by this x `tokens_per_second`."""
    if num_sampled > 0 and total_frames > 0 and fps > 0:
        sampled = num_sampled / total_frames * fps
    else:
        sampled = fps or 24.0
    return temporal / sampled
