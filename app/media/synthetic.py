"""Seeded random images and videos, encoded in real formats (tests and the load generator)."""

from __future__ import annotations

import io

import numpy as np


def image_bytes(h: int = 64, w: int = 96, seed: int = 0, fmt: str = "PNG", quality: int = 90,
                subsampling: int | None = None) -> bytes:
    """Noise in `fmt`; a JPEG at `quality`, with Pillow's chroma `subsampling` (None: its default, 4:2:0;
    0: none, as AIPerf encodes its images)."""
    from PIL import Image

    arr = (np.random.default_rng(seed).random((h, w, 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    jpeg = {"quality": quality, **({} if subsampling is None else {"subsampling": subsampling})}
    Image.fromarray(arr).save(buf, format=fmt, **(jpeg if fmt == "JPEG" else {}))
    return buf.getvalue()


def mp4_bytes(frames: int = 8, h: int = 64, w: int = 64, fps: int = 4, seed: int = 0) -> bytes:
    import av

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for _ in range(frames):
            img = (rng.random((h, w, 3)) * 255).astype(np.uint8)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")))
        out.mux(stream.encode())
    return buf.getvalue()
