"""Decoding media: images with Pillow, videos with PyAV.

The modality is decided from the bytes themselves (container/format probing), never from a file
extension or a claimed MIME type. Rules for mismatches, documented in the README:
- an `image_url` holding a video container, or an animated image with more than one frame, is
  refused (400, code `media_type_mismatch`): send it as `video_url`;
- a `video_url` holding a still image is accepted as a two-frame still video (the minimum the
  tower's temporal patch takes), so clients that put every media item in `video_url` still work.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np

from ..errors import ClientError

IMAGE = "image"
VIDEO = "video"


@dataclass
class VideoFrames:
    frames: np.ndarray  # [n, H, W, 3] uint8
    fps: float  # of the source
    total_frames: int
    indices: list[int]  # sampled source frame indices

    @property
    def duration(self) -> float:
        return self.total_frames / self.fps if self.fps else 0.0


def sniff(data: bytes) -> str | None:
    """'image', 'video' or None, from magic numbers. Animated GIF/WebP/APNG count as images here."""
    head = data[:32]
    if head.startswith((b"\x89PNG", b"\xff\xd8\xff", b"GIF8", b"BM")) or head[:4] in (b"II*\x00", b"MM\x00*"):
        return IMAGE
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return IMAGE
    if head[4:8] == b"ftyp":
        brand = head[8:12]
        return IMAGE if brand in (b"avif", b"avis", b"heic", b"heix", b"mif1") else VIDEO
    if head[:4] in (b"\x1a\x45\xdf\xa3",) or head[:4] == b"RIFF" and head[8:11] == b"AVI":
        return VIDEO
    if head[:4] == b"OggS" or head[:3] == b"FLV" or head[:1] == b"\x47" and len(data) > 188 and data[188:189] == b"\x47":
        return VIDEO
    return None


def _open_image(data: bytes, param: str):
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except UnidentifiedImageError as e:  # its text names a BytesIO object's address: say what a client can use
        raise ClientError("could not decode image: not a format the server reads (PNG, JPEG, WebP, GIF, BMP, ...)",
                          param=param, code="invalid_image") from e
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise ClientError(f"could not decode image: {e}", param=param, code="invalid_image") from e
    return img


def open_rgb_image(data: bytes, *, param: str, max_pixels: int):
    """The decoded RGB PIL image, EXIF orientation applied. Kept as a PIL image so that the resize
    reads it directly: a full-size array copy of a 12-megapixel photo costs more than its decode."""
    from PIL import ImageOps

    kind = sniff(data)
    if kind == VIDEO:
        raise ClientError("image_url holds a video; send it as video_url", param=param, code="media_type_mismatch")
    img = _open_image(data, param)
    if getattr(img, "n_frames", 1) > 1:
        raise ClientError("image_url holds an animated image; send it as video_url", param=param,
                          code="media_type_mismatch")
    if img.width * img.height > max_pixels:
        raise ClientError(f"image of {img.width}x{img.height} exceeds the limit of {max_pixels} pixels", param=param,
                          code="image_too_large")
    ImageOps.exif_transpose(img, in_place=True)
    return img if img.mode == "RGB" else img.convert("RGB")


def decode_image(data: bytes, *, param: str, max_pixels: int) -> np.ndarray:
    """RGB uint8 array [H, W, 3], EXIF orientation applied."""
    return np.asarray(open_rgb_image(data, param=param, max_pixels=max_pixels))


def sample_indices(total: int, src_fps: float, fps: float, min_frames: int, max_frames: int) -> list[int]:
    """Uniform indices at `fps` frames per second (Qwen3-VL's rule), a multiple of 2 frames."""
    n = int(total / src_fps * fps) if src_fps else total
    n = min(max(n, min_frames), max_frames, total)
    n = max(2, n - n % 2) if total >= 2 else 2
    return np.linspace(0, total - 1, n).round().astype(int).tolist()


def decode_video(data: bytes, *, param: str, fps: float, min_frames: int, max_frames: int,
                 max_duration_s: float, max_pixels: int) -> VideoFrames:
    """Decode with PyAV and sample frames; a still image becomes a 2-frame still video."""
    kind = sniff(data)
    if kind == IMAGE:
        frame = decode_image(data, param=param, max_pixels=max_pixels)
        return VideoFrames(np.stack([frame, frame]), fps=1.0, total_frames=2, indices=[0, 1])
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise ClientError("video_url holds no video stream", param=param, code="invalid_video")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            src_fps = float(rate) if rate else 24.0
            # Count frames from packets (no decoding), so only the sampled frames are ever decoded.
            total = sum(1 for p in container.demux(stream) if p.size)
        if not math.isfinite(src_fps) or src_fps <= 0:
            src_fps = 24.0
        if total == 0:
            raise ClientError("video has no frames", param=param, code="invalid_video")
        if total / src_fps > max_duration_s:
            raise ClientError(f"video of {total / src_fps:.1f} s exceeds the limit of {max_duration_s} s",
                              param=param, code="video_too_long")
        idx = sample_indices(max(total, 2), src_fps, fps, min_frames, max_frames)
        wanted = {i: [] for i in idx}
        with av.open(io.BytesIO(data), mode="r") as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            for n, frame in enumerate(container.decode(stream)):
                if n == 0 and frame.width * frame.height > max_pixels:
                    raise ClientError(f"video frames of {frame.width}x{frame.height} exceed the limit of "
                                      f"{max_pixels} pixels", param=param, code="video_too_large")
                if n in wanted:
                    wanted[n] = frame.to_ndarray(format="rgb24")
                if n >= idx[-1]:
                    break
    except ClientError:
        raise
    except (av.error.FFmpegError, ValueError, IndexError, MemoryError) as e:
        # FFmpeg's text carries an errno and the in-memory file's name ('<none>'); its reason is enough
        reason = getattr(e, "strerror", None) or str(e) or type(e).__name__
        raise ClientError(f"could not decode video: {reason}", param=param, code="invalid_video") from e
    decoded = [wanted[i] for i in idx if len(wanted[i])]
    if not decoded:
        raise ClientError("video has no decodable frames", param=param, code="invalid_video")
    frames = [wanted[i] if len(wanted[i]) else decoded[-1] for i in idx]  # a short count repeats the last frame
    return VideoFrames(np.stack(frames), fps=src_fps, total_frames=total, indices=idx)
