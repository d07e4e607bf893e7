"""Checks that refuse pathological media from its headers, before the decoder allocates for it.

A few hundred bytes can declare a 50,000 x 50,000 image (7.5 GB of RGB), 10,000 animation frames,
10^9 video frames, a 10^6-second duration or hundreds of streams. The decoders believe headers and
allocate accordingly, so the claims are checked first:
- images: the declared size against `max_input_pixels` right after `Image.open` (which reads only the
  header); Pillow's own bomb guard (`Image.MAX_IMAGE_PIXELS`, an error above ~179 MP) stays in place
  as a second line. JPEG scans are counted in the bytes: a progressive JPEG with thousands of scans
  makes libjpeg redo the whole image per scan (minutes of CPU from a small file);
- videos: streams, declared frames and durations, and the coded frame size, read from the container
  before any packet is demuxed; packet counting stops at a bound; every loop checks a deadline.
"""

from __future__ import annotations

import time

from ..errors import ClientError

MAX_JPEG_SCANS = 100  # ordinary progressive JPEGs have about 10
MAX_SOURCE_FPS = 240  # frames per second of declared duration; bounds the frames a video may hold
# Pillow decoders the server accepts (sniffed formats only): Pillow can open dozens more, several
# of them rarely exercised; MPO is how Pillow opens many phone JPEGs.
IMAGE_FORMATS = ("PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP", "TIFF", "AVIF")


class Deadline:
    """A per-item time limit, checked in decode loops (the decoders themselves cannot be stopped)."""

    def __init__(self, seconds: float, param: str):
        self.seconds, self.param = seconds, param
        self.end = time.monotonic() + seconds

    def check(self) -> None:
        if time.monotonic() > self.end:
            raise ClientError(f"media item took longer than {self.seconds:g} s to decode", param=self.param,
                              code="media_decode_timeout")


def jpeg_scans(data: bytes) -> int:
    """Start-of-scan markers. Entropy-coded data stuffs every 0xFF with 0x00, so FF DA is a marker."""
    return data.count(b"\xff\xda")


def check_image_header(img, data: bytes, *, max_pixels: int, param: str) -> None:
    """Before `load()`: the declared size, and the scan count of a JPEG."""
    w, h = img.size
    if w <= 0 or h <= 0:
        raise ClientError(f"image declares an empty size {w}x{h}", param=param, code="invalid_image")
    if w * h > max_pixels:
        raise ClientError(f"image of {w}x{h} exceeds the limit of {max_pixels} pixels", param=param,
                          code="image_too_large")
    if img.format in ("JPEG", "MPO") and jpeg_scans(data) > MAX_JPEG_SCANS:
        raise ClientError(f"JPEG with more than {MAX_JPEG_SCANS} scans refused", param=param, code="invalid_image")


def max_source_frames(max_duration_s: float) -> int:
    return int(max_duration_s * MAX_SOURCE_FPS)


def check_video_header(container, stream, *, max_streams: int, max_duration_s: float, max_pixels: int,
                       param: str) -> None:
    """Claims the container makes before a packet is read: streams, frames, durations, frame size."""
    if len(container.streams) > max_streams:
        raise ClientError(f"video container holds {len(container.streams)} streams; the limit is {max_streams}",
                          param=param, code="invalid_video")
    declared = stream.frames or 0
    if declared > max_source_frames(max_duration_s):
        raise ClientError(f"video declares {declared} frames; the limit is {max_source_frames(max_duration_s)}",
                          param=param, code="video_too_long")
    durations = [container.duration / 1e6 if container.duration else 0.0]
    if stream.duration and stream.time_base:
        durations.append(float(stream.duration * stream.time_base))
    if max(durations) > max_duration_s:
        raise ClientError(f"video declares {max(durations):.1f} s; the limit is {max_duration_s:g} s", param=param,
                          code="video_too_long")
    cc = stream.codec_context
    if (cc.width or 0) * (cc.height or 0) > max_pixels:
        raise ClientError(f"video frames of {cc.width}x{cc.height} exceed the limit of {max_pixels} pixels",
                          param=param, code="video_too_large")
