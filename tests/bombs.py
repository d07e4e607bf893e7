"""Hostile media made in the test (never downloaded): headers that claim huge sizes, frame counts,
durations or stream counts, and valid files in every format the server reads, to truncate and corrupt.
Each builder is cached: the 10,000-frame animations take about a second to encode."""

from __future__ import annotations

import functools
import io
import struct
import zlib

import numpy as np

from app.media.synthetic import image_bytes, mp4_bytes


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_declaring(w: int, h: int) -> bytes:
    """A valid PNG header declaring w x h RGB pixels, with a few bytes of pixel data."""
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + _png_chunk(b"IDAT", zlib.compress(b"\0" * 64)) + _png_chunk(b"IEND", b""))


def jpeg_declaring(w: int, h: int) -> bytes:
    """A real 16x16 JPEG whose start-of-frame claims w x h."""
    data = bytearray(image_bytes(16, 16, 0, "JPEG"))
    for marker in (b"\xff\xc0", b"\xff\xc2"):
        i = data.find(marker)
        if i >= 0:
            struct.pack_into(">HH", data, i + 5, h, w)
            return bytes(data)
    raise AssertionError("no SOF marker")


def jpeg_with_scans(n: int) -> bytes:
    """A progressive JPEG with its first scan repeated to n scans (a 'scan bomb')."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((64, 64, 3), 128, np.uint8)).save(buf, format="JPEG", progressive=True)
    data = buf.getvalue()
    start = data.find(b"\xff\xda")
    end = data.find(b"\xff\xda", start + 2)
    return data[:start] + data[start:end] * n + data[end:]


@functools.cache
def gif_frames(n: int) -> bytes:
    from PIL import Image

    frames = [Image.new("RGB", (2, 2), ((i * 37) % 256, (i * 11) % 256, i % 256)) for i in range(n)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=10, optimize=False)
    return buf.getvalue()


@functools.cache
def webp_frames(n: int) -> bytes:
    from PIL import Image

    frames = [Image.new("RGB", (1, 1), (i % 256, (i // 256) % 256, 0)) for i in range(n)]
    buf = io.BytesIO()
    frames[0].save(buf, format="WEBP", save_all=True, append_images=frames[1:], duration=10, lossless=True)
    return buf.getvalue()


def _mp4_box(data: bytes | bytearray, path: list[bytes]) -> tuple[int, int]:
    start, end, found = 0, len(data), None
    for name in path:
        i = start
        while i + 8 <= end:
            size, kind = struct.unpack(">I4s", data[i:i + 8])
            if kind == name:
                found, start, end = (i, size), i + 8, i + size
                break
            i += max(size, 8)
        else:
            raise AssertionError(f"no {name} box")
    return found


def mp4_declaring_frames(n: int) -> bytes:
    """An MP4 whose sample tables claim n samples of a constant size and duration (no per-sample
    table), in a file of a few kilobytes."""
    data = bytearray(mp4_bytes(8))
    i, _ = _mp4_box(data, [b"moov", b"trak", b"mdia", b"minf", b"stbl", b"stsz"])
    struct.pack_into(">II", data, i + 12, 4038, n)
    j, _ = _mp4_box(data, [b"moov", b"trak", b"mdia", b"minf", b"stbl", b"stts"])
    struct.pack_into(">I", data, j + 16, n)
    return bytes(data)


def mp4_declaring_seconds_per_frame(seconds: int) -> bytes:
    """An MP4 whose time-to-sample table gives each of its 8 frames `seconds` of duration."""
    data = bytearray(mp4_bytes(8))
    i, _ = _mp4_box(data, [b"moov", b"trak", b"mdia", b"mdhd"])
    timescale = struct.unpack(">I", data[i + 20:i + 24])[0]
    j, _ = _mp4_box(data, [b"moov", b"trak", b"mdia", b"minf", b"stbl", b"stts"])
    struct.pack_into(">II", data, j + 16, 8, min(timescale * seconds, 2**32 - 1))
    return bytes(data)


@functools.cache
def webm_bytes(frames: int = 8, size: int = 64, seed: int = 0) -> bytes:
    import av

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="webm") as out:
        s = out.add_stream("libvpx", rate=4)
        s.width = s.height = size
        s.pix_fmt = "yuv420p"
        for _ in range(frames):
            img = (rng.random((size, size, 3)) * 255).astype(np.uint8)
            out.mux(s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")))
        out.mux(s.encode())
    return buf.getvalue()


@functools.cache
def mjpeg_with_one_big_frame(size: int = 64, big: int = 2000, frames: int = 6, at: int = 3) -> bytes:
    """A Matroska MJPEG stream whose header says `size` x `size` and whose frame `at` is a `big` x `big`
    JPEG: every MJPEG frame carries its own size, so the header's does not bound the frames."""
    from fractions import Fraction

    import av
    from PIL import Image

    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="matroska") as out:
        s = out.add_stream("mjpeg", rate=10)
        s.width = s.height = size
        s.pix_fmt = "yuvj420p"
        s.time_base = Fraction(1, 10)
        for i in range(frames):
            side = big if i == at else size
            jpeg = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)).save(jpeg, "JPEG", quality=50)
            packet = av.Packet(jpeg.getvalue())
            packet.stream, packet.pts, packet.dts, packet.time_base = s, i, i, Fraction(1, 10)
            out.mux(packet)
    return buf.getvalue()


def webm_declaring_seconds(seconds: float) -> bytes:
    """A WebM whose segment header claims `seconds` (Matroska's Duration element, in milliseconds)."""
    data = bytearray(webm_bytes())
    i = data.find(b"\x44\x89")
    size = data[i + 2] & 0x7F
    struct.pack_into(">d" if size == 8 else ">f", data, i + 3, seconds * 1000)
    return bytes(data)


@functools.cache
def mkv_with_streams(n: int) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="matroska") as out:
        streams = []
        for _ in range(n):
            s = out.add_stream("mpeg4", rate=4)
            s.width = s.height = 16
            s.pix_fmt = "yuv420p"
            streams.append(s)
        frame = av.VideoFrame.from_ndarray(np.zeros((16, 16, 3), np.uint8), format="rgb24")
        for s in streams:
            out.mux(s.encode(frame))
        for s in streams:
            out.mux(s.encode())
    return buf.getvalue()


@functools.cache
def valid_media() -> dict[str, bytes]:
    """One small valid file per format the server reads: the base of the truncation corpus."""
    from PIL import Image

    out = {fmt.lower(): image_bytes(40, 56, 3, fmt) for fmt in ("PNG", "JPEG", "WEBP", "BMP", "TIFF", "GIF")}
    prog = io.BytesIO()
    Image.fromarray((np.random.default_rng(4).random((40, 56, 3)) * 255).astype(np.uint8)).save(
        prog, format="JPEG", progressive=True)
    out["jpeg-progressive"] = prog.getvalue()
    out["gif-animated"] = gif_frames(6)
    out["webp-animated"] = webp_frames(6)
    out["mp4"] = mp4_bytes(8, seed=5)
    out["webm"] = webm_bytes()
    return out


def long_mp4(frames: int = 600, size: int = 256) -> bytes:
    """A valid video that takes a noticeable time to decode on a small CPU."""
    return mp4_bytes(frames, size, size, fps=30, seed=9)
