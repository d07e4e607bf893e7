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
import warnings
from dataclasses import dataclass

import numpy as np

from ..errors import ClientError
from .limits import IMAGE_FORMATS, Deadline, check_image_header, check_video_header, max_source_frames

IMAGE = "image"
VIDEO = "video"

# Pillow warns about every odd file it is sent (corrupt EXIF, truncated TIFF tags) and about sizes
# above its bomb threshold, which the server checks against its own limit: clients' files, not the
# server's problems, and one log line each would let a client fill the logs.
warnings.filterwarnings("ignore", category=UserWarning, module=r"PIL\.")
warnings.filterwarnings("ignore", message="Image size .* could be decompression bomb", category=RuntimeWarning)


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


def _accepted_formats() -> tuple[str, ...]:
    from PIL import Image

    Image.init()
    return tuple(f for f in IMAGE_FORMATS if f in Image.OPEN)


def _decode_failure(kind: str, e: BaseException, param: str) -> ClientError:
    """Any exception a decoder raises on a client's bytes is that client's error (400), never a 500:
    Pillow and PyAV raise OSError, ValueError, EOFError, SyntaxError, struct.error, IndexError,
    KeyError, TypeError, ZeroDivisionError, MemoryError and their own classes depending on where the
    file breaks. The text carries no server object (BytesIO addresses, '<none>' file names)."""
    reason = getattr(e, "strerror", None) or str(e) or type(e).__name__
    if "BytesIO" in reason or " at 0x" in reason:
        reason = "not a format the server reads (PNG, JPEG, WebP, GIF, BMP, TIFF)" if kind == "image" else type(e).__name__
    code = "invalid_image" if kind == "image" else "invalid_video"
    return ClientError(f"could not decode {kind}: {reason[:300]}", param=param, code=code)


def _open_image(data: bytes, param: str, max_pixels: int):
    """Open (header only), check the declared size and JPEG scans, refuse animation, then decode."""
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(data), formats=_accepted_formats())
    except Image.DecompressionBombError as e:  # Pillow's guard, above ~179 MP: never allocated
        raise ClientError(f"image too large: {e}", param=param, code="image_too_large") from None
    except ClientError:
        raise
    except Exception as e:
        raise _decode_failure("image", e, param) from None
    check_image_header(img, data, max_pixels=max_pixels, param=param)
    try:
        # MPO (phone JPEGs with a second picture) is one photo, not an animation
        animated = img.format != "MPO" and getattr(img, "is_animated", False)
    except Exception as e:
        raise _decode_failure("image", e, param) from None
    if animated:
        raise ClientError("animated images (GIF, WebP, PNG) are not accepted; send the animation as an MP4 or "
                          "WebM video_url", param=param, code="media_type_mismatch")
    try:
        img.load()
    except Exception as e:
        raise _decode_failure("image", e, param) from None
    return img


def open_rgb_image(data: bytes, *, param: str, max_pixels: int):
    """The decoded RGB PIL image, EXIF orientation applied. Kept as a PIL image so that the resize
    reads it directly: a full-size array copy of a 12-megapixel photo costs more than its decode."""
    from PIL import ImageOps

    kind = sniff(data)
    if kind == VIDEO:
        raise ClientError("image_url holds a video; send it as video_url", param=param, code="media_type_mismatch")
    img = _open_image(data, param, max_pixels)
    try:
        ImageOps.exif_transpose(img, in_place=True)
        return _rgb(img)
    except Exception as e:  # a corrupt EXIF block or palette
        raise _decode_failure("image", e, param) from None


def _rgb(img):
    """RGB as transformers' processors make it: transparency (an alpha band, or a palette's or greyscale
    image's transparent colour) laid over white. A plain convert would keep the hidden colour of
    transparent pixels, often black: black text on a transparent logo became a black square."""
    from PIL import Image

    if img.mode == "RGB":
        return img
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return img.convert("RGB")


def decode_image(data: bytes, *, param: str, max_pixels: int) -> np.ndarray:
    """RGB uint8 array [H, W, 3], EXIF orientation applied."""
    return np.asarray(open_rgb_image(data, param=param, max_pixels=max_pixels))


def sample_indices(total: int, src_fps: float, fps: float, min_frames: int, max_frames: int) -> list[int]:
    """Uniform indices at `fps` frames per second (Qwen3-VL's rule), a multiple of 2 frames."""
    n = int(total / src_fps * fps) if src_fps else total
    n = min(max(n, min_frames), max_frames, total)
    n = max(2, n - n % 2) if total >= 2 else 2
    return np.linspace(0, total - 1, n).round().astype(int).tolist()


def video_demuxer(data: bytes) -> str | None:
    """FFmpeg's demuxer for the container in `data`, from its magic number. The demuxer is named, never
    probed: probing would also select FFmpeg's playlist and script demuxers (HLS, concat), which open
    further files or URLs named in the bytes (an ffconcat script reads videos relative to the server's
    working directory)."""
    head = data[:16]
    if head[4:8] == b"ftyp" or head[4:8] in (b"moov", b"mdat", b"free", b"wide"):
        return "mov"
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "matroska"
    if head[:4] == b"RIFF" and head[8:11] == b"AVI":
        return "avi"
    if head[:4] == b"OggS":
        return "ogg"
    if head[:3] == b"FLV":
        return "flv"
    if head[:4] == b"\x00\x00\x01\xba":
        return "mpeg"
    if head[:1] == b"\x47" and len(data) > 188 and data[188:189] == b"\x47":
        return "mpegts"
    return None


# Nested opens (external references, playlists) get no protocol at all: media comes from the bytes only.
_AV_OPTIONS = {"protocol_whitelist": "none", "enable_drefs": "0"}


def _open_container(data: bytes, demuxer: str):
    import av

    return av.open(io.BytesIO(data), mode="r", format=demuxer, options=_AV_OPTIONS)


def decode_video(data: bytes, *, param: str, fps: float, min_frames: int, max_frames: int,
                 max_duration_s: float, max_pixels: int, max_streams: int = 16,
                 max_decoded_bytes: int = 2 << 30, deadline: Deadline | None = None) -> VideoFrames:
    """Decode with PyAV and sample frames; a still image becomes a 2-frame still video.

    The container's claims are checked before any packet is read (app/media/limits.py); packets are
    counted without decoding, up to a bound, and only the sampled frames are converted. `deadline` is
    checked for every packet and frame, so no item holds a worker beyond it."""
    kind = sniff(data)
    if kind == IMAGE:
        frame = decode_image(data, param=param, max_pixels=max_pixels)
        return VideoFrames(np.stack([frame, frame]), fps=1.0, total_frames=2, indices=[0, 1])
    demuxer = video_demuxer(data)
    if demuxer is None:
        raise ClientError("could not decode video: not a container the server reads (MP4/MOV, WebM/MKV, AVI, Ogg, "
                          "FLV, MPEG-PS/TS)", param=param, code="invalid_video")
    tick = deadline.check if deadline is not None else (lambda: None)
    frame_cap = max_source_frames(max_duration_s)
    try:
        with _open_container(data, demuxer) as container:
            if not container.streams.video:
                raise ClientError("video_url holds no video stream", param=param, code="invalid_video")
            stream = container.streams.video[0]
            check_video_header(container, stream, max_streams=max_streams, max_duration_s=max_duration_s,
                               max_pixels=max_pixels, param=param)
            rate = stream.average_rate or stream.guessed_rate
            src_fps = float(rate) if rate else 24.0
            # Count frames from packets (no decoding), so only the sampled frames are ever decoded.
            total = 0
            for p in container.demux(stream):
                tick()
                total += 1 if p.size else 0
                if total > frame_cap:
                    raise ClientError(f"video holds more than {frame_cap} frames", param=param,
                                      code="video_too_long")
        if not math.isfinite(src_fps) or src_fps <= 0:
            src_fps = 24.0
        if total == 0:
            raise ClientError("video has no frames", param=param, code="invalid_video")
        if total / src_fps > max_duration_s:
            raise ClientError(f"video of {total / src_fps:.1f} s exceeds the limit of {max_duration_s} s",
                              param=param, code="video_too_long")
        idx = sample_indices(max(total, 2), src_fps, fps, min_frames, max_frames)
        wanted = {i: [] for i in idx}
        kept = 0  # bytes of the RGB frames kept until the resize
        with _open_container(data, demuxer) as container:
            stream = container.streams.video[0]
            # FFmpeg itself refuses a frame far over the limit before allocating it (the check below runs on
            # a decoded frame: one 12000 x 12000 frame in a 64 x 64 stream took 230 MB first), and a few frame
            # threads at most hold frames at once. Its bound is twice ours and then some: it counts the
            # codec's padded size, which for a frame exactly at our limit can be well over it (thin frames)
            stream.codec_context.options = {"max_pixels": str(2 * max_pixels + (1 << 20))}
            stream.thread_type = "AUTO"
            stream.thread_count = min(stream.thread_count or 4, 4)
            for n, frame in enumerate(container.decode(stream)):
                tick()
                if frame.width * frame.height > max_pixels:  # also a size change mid-stream
                    raise ClientError(f"video frames of {frame.width}x{frame.height} exceed the limit of "
                                      f"{max_pixels} pixels", param=param, code="video_too_large")
                if n in wanted:
                    kept += 3 * frame.width * frame.height
                    if kept > max_decoded_bytes:
                        raise ClientError(f"{len(idx)} sampled frames of {frame.width}x{frame.height} exceed the "
                                          f"decoded-video limit of {max_decoded_bytes} bytes", param=param,
                                          code="video_too_large")
                    wanted[n] = _upright(frame.to_ndarray(format="rgb24"), frame.rotation)
                if n >= idx[-1]:
                    break
    except ClientError:
        raise
    except Exception as e:  # FFmpegError, ValueError, IndexError, MemoryError, ...: see _decode_failure
        raise _decode_failure("video", e, param) from None
    decoded = [wanted[i] for i in idx if len(wanted[i])]
    if not decoded:
        raise ClientError("video has no decodable frames", param=param, code="invalid_video")
    frames = [wanted[i] if len(wanted[i]) else decoded[-1] for i in idx]  # a short count repeats the last frame
    return VideoFrames(np.stack(_one_size(frames)), fps=src_fps, total_frames=total, indices=idx)


def _upright(rgb: np.ndarray, rotation: float) -> np.ndarray:
    """The frame as it is meant to be shown: phones store portrait video as landscape frames plus a
    display rotation (PyAV's `frame.rotation`: degrees the display turns the frame counterclockwise).
    Images get their EXIF orientation; videos were shown to the model sideways."""
    turns = round((rotation or 0) / 90) % 4
    return np.ascontiguousarray(np.rot90(rgb, turns)) if turns else rgb


def _one_size(frames: list[np.ndarray]) -> list[np.ndarray]:
    """Frames at the first one's size. A stream may change resolution part-way (spliced or adaptive
    streams); stacking them raised a ValueError outside the decode guard, a 500."""
    from PIL import Image

    h, w = frames[0].shape[:2]
    return [f if f.shape[:2] == (h, w) else np.asarray(Image.fromarray(f).resize((w, h), Image.Resampling.BICUBIC))
            for f in frames]
