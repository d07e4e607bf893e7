"""Pathological media is refused from its headers, corrupt media is a 4xx at any byte, decoding is
bounded in time, and one request's slow items do not hold another request's item in the pool."""

from __future__ import annotations

import asyncio
import base64
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import bombs
from app.api.schemas import MediaRef
from app.config import MediaConfig
from app.errors import ClientError
from app.media.decode import decode_video, open_rgb_image
from app.media.limits import Deadline
from app.media.pipeline import MediaPipeline, prepare_bytes
from app.media.preprocess import PatchSpec
from app.media.workers import run_item

CFG = MediaConfig()
VIDEO = {"fps": 2, "min_frames": 4, "max_frames": 64, "max_duration_s": 3600, "max_pixels": 64_000_000}


def _minicpmv_spec() -> PatchSpec:
    from dataclasses import replace

    from app.media.slicing import SliceSpec

    slicing = SliceSpec(scale_resolution=112, queries=16)
    return replace(slicing.patch_spec, slicing=slicing)


def refusal(fn) -> ClientError:
    with pytest.raises(ClientError) as e:
        fn()
    assert 400 <= e.value.status < 500
    return e.value


def as_image(data: bytes, max_pixels: int = 64_000_000) -> ClientError:
    return refusal(lambda: open_rgb_image(data, param="p", max_pixels=max_pixels))


def as_video(data: bytes, **kw) -> ClientError:
    return refusal(lambda: decode_video(data, param="p", **(VIDEO | kw)))


@pytest.mark.parametrize("builder", [bombs.png_declaring, bombs.jpeg_declaring])
def test_an_image_declaring_fifty_thousand_squared_pixels_is_refused_from_its_header(builder):
    data = builder(50_000, 50_000)  # 7.5 GB of RGB if believed
    assert len(data) < 2000
    assert as_image(data).code == "image_too_large"
    assert as_video(data).code == "image_too_large"  # the still-image path of video_url too
    # under Pillow's own guard (~179 MP) our limit applies, before the pixel data is read: the pixel
    # data here is a few bytes, so decoding it would fail with invalid_image instead
    assert as_image(builder(5000, 5000), max_pixels=1_000_000).code == "image_too_large"


def test_a_jpeg_with_hundreds_of_scans_is_refused_before_decoding():
    err = as_image(bombs.jpeg_with_scans(500))
    assert err.code == "invalid_image" and "scans" in err.message
    open_rgb_image(bombs.valid_media()["jpeg-progressive"], param="p", max_pixels=10**8)  # ~10 scans: fine


@pytest.mark.parametrize("builder", [bombs.gif_frames, bombs.webp_frames])
def test_animations_of_ten_thousand_frames_are_refused_at_the_second_frame(builder):
    data = builder(10_000)
    t0 = time.perf_counter()
    assert as_image(data).code == "media_type_mismatch"
    assert as_video(data).code == "media_type_mismatch"
    assert time.perf_counter() - t0 < 30  # not a timing test: a generous bound against counting 10,000 frames


def test_a_video_declaring_a_billion_frames_is_refused_from_its_header():
    data = bombs.mp4_declaring_frames(10**9)
    err = as_video(data)
    assert err.code == "video_too_long" and "1000000000 frames" in err.message


def test_videos_declaring_a_million_seconds_are_refused():
    err = as_video(bombs.webm_declaring_seconds(1e6))  # Matroska's Duration element
    assert err.code == "video_too_long" and "declares" in err.message
    assert as_video(bombs.mp4_declaring_seconds_per_frame(125_000)).code == "video_too_long"  # MP4 sample table


def test_a_container_with_hundreds_of_streams_is_refused():
    err = as_video(bombs.mkv_with_streams(300))
    assert err.code == "invalid_video" and "300 streams" in err.message
    decode_video(bombs.mkv_with_streams(3), param="p", **VIDEO)  # a few streams are fine


def test_video_frame_size_and_decoded_bytes_are_checked_before_decoding_them():
    err = as_video(bombs.webm_bytes(), max_pixels=1000)  # 64x64 frames, read from the stream header
    assert err.code == "video_too_large"
    err = refusal(lambda: decode_video(bombs.webm_bytes(), param="p", max_decoded_bytes=3 * 64 * 64 * 2, **VIDEO))
    assert err.code == "video_too_large" and "decoded-video limit" in err.message


def test_minicpm_v_refuses_the_aspect_ratios_qwen_refuses():
    """A few-KB PNG of 1 x 8,000,000 pixels became 362,040 patch rows on the MiniCPM-V path (the short
    side is scaled up to a patch); like Qwen's smart_resize, slicing refuses sides more than 200 apart."""
    import io

    from PIL import Image

    def png(w: int, h: int) -> bytes:
        buf = io.BytesIO()
        Image.new("RGB", (w, h), (9, 99, 199)).save(buf, "PNG")
        return buf.getvalue()

    spec, cfg = _minicpmv_spec(), MediaConfig()
    for w, h in ((1, 4000), (5000, 2)):
        err = refusal(lambda w=w, h=h: prepare_bytes(png(w, h), MediaRef("image", "u", "p"), cfg, spec))
        assert err.code == "invalid_image" and "aspect ratio" in err.message
    assert prepare_bytes(png(20, 3000), MediaRef("image", "u", "p"), cfg, spec).patches  # 150: still served


def test_a_frame_larger_than_its_streams_header_is_refused():
    """MJPEG frames carry their own sizes: a 2000 x 2000 frame in a stream that says 64 x 64 passes the
    header's check. FFmpeg is told a bound (twice the limit and a margin) so that it refuses such a frame
    before allocating it; the exact limit is checked on every decoded frame."""
    data = bombs.mjpeg_with_one_big_frame()
    assert as_video(data, max_pixels=64 * 64 * 4).code in ("invalid_video", "video_too_large")  # FFmpeg's bound
    assert as_video(data, max_pixels=3_000_000).code == "video_too_large"  # FFmpeg's bound passes, ours not
    assert decode_video(data, param="p", **(VIDEO | {"max_pixels": 2000 * 2000})).frames.shape[0] >= 2


def test_playlists_and_scripts_never_make_ffmpeg_open_other_files(tmp_path, monkeypatch):
    """Probing would pick FFmpeg's concat demuxer for this script and read clip.mp4 from the working
    directory; the server names the demuxer from the magic number instead, so it is refused."""
    from app.media.synthetic import mp4_bytes

    monkeypatch.chdir(tmp_path)
    (tmp_path / "clip.mp4").write_bytes(mp4_bytes(8))
    for script in [b"ffconcat version 1.0\nfile 'clip.mp4'\n",
                   b"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\nclip.mp4\n#EXT-X-ENDLIST\n",
                   b"#EXTM3U\n#EXTINF:10,\nhttp://169.254.169.254/latest/meta-data/\n"]:
        assert as_video(script).code == "invalid_video"


def _variants(data: bytes, rng: np.random.Generator, n: int) -> list[tuple[str, bytes]]:
    """Truncations at spread and random offsets, and single-byte corruptions."""
    cuts = sorted({0, 1, 2, 3, 4, 7, 8, 11, 12, 16, 24, 32, 33, 64, len(data) - 1, len(data) // 2,
                   *rng.integers(0, len(data), n).tolist()})
    out = [(f"cut@{c}", data[:c]) for c in cuts if c < len(data)]
    for pos in rng.integers(0, len(data), n).tolist():
        b = bytearray(data)
        b[pos] = (b[pos] + int(rng.integers(1, 256))) % 256
        out.append((f"flip@{pos}", bytes(b)))
    return out


def test_truncated_or_corrupt_media_at_any_offset_is_a_client_error_never_an_exception():
    rng = np.random.default_rng(1234)
    spec, cases, ok, refused = PatchSpec(), 0, 0, {}
    cfg = MediaConfig(decode_timeout_s=30)
    for fmt, data in bombs.valid_media().items():
        for label, variant in _variants(data, rng, 30):
            for kind in ("image", "video"):
                cases += 1
                try:
                    prepare_bytes(variant, MediaRef(kind, "u", "p"), cfg, spec)
                    ok += 1
                except ClientError as e:
                    assert 400 <= e.status < 500, (fmt, label, kind, e.message)
                    refused[e.code] = refused.get(e.code, 0) + 1
                except Exception as e:  # noqa: BLE001 - the point of the test
                    pytest.fail(f"{fmt} {label} as {kind}: {type(e).__name__}: {e}")
    print(f"\ncorrupt-media corpus: {cases} decodes, {ok} decoded, refused by code {refused}")
    assert cases > 1000 and sum(refused.values()) > cases // 2


def test_a_video_stops_at_its_deadline():
    err = refusal(lambda: decode_video(bombs.long_mp4(), param="p", deadline=Deadline(0.01, "p"), **VIDEO))
    assert err.code == "media_decode_timeout"


@pytest.mark.parametrize("spec", [PatchSpec(), _minicpmv_spec()], ids=["smart-resize", "minicpmv-slicing"])
def test_every_family_s_video_path_keeps_the_limits(spec):
    """MiniCPM-V's sliced path decodes videos itself: the same stream cap, decoded-byte cap and deadline."""
    ref = MediaRef("video", "u", "p")
    err = refusal(lambda: prepare_bytes(bombs.mkv_with_streams(300), ref, CFG, spec))
    assert err.code == "invalid_video" and "300 streams" in err.message
    small = MediaConfig(max_decoded_video_bytes=3 * 64 * 64 * 2)
    assert refusal(lambda: prepare_bytes(bombs.webm_bytes(), ref, small, spec)).code == "video_too_large"
    err = refusal(lambda: prepare_bytes(bombs.long_mp4(), ref, CFG, spec, Deadline(0.01, "p")))
    assert err.code == "media_decode_timeout"


def test_an_item_that_ignores_its_deadline_is_answered_anyway():
    """The pool-level guard for a decoder that cannot be interrupted (a stand-in that sleeps)."""
    pool = ThreadPoolExecutor(2)
    try:
        with pytest.raises(ClientError) as e:
            asyncio.run(run_item(pool, None, 0.1, "p", time.sleep, 3))
        assert e.value.code == "media_decode_timeout"
    finally:
        pool.shutdown(wait=False)


def test_a_request_with_many_slow_items_leaves_a_worker_for_other_requests(monkeypatch):
    """Request A brings three long videos, request B (sent just after) one small image, to a pool of two
    workers. A may hold only one worker, so B's image is done before any of A's videos; without the
    guard, A's first two videos would hold both workers and B would finish after one of them."""
    import app.media.pipeline as pipeline

    finished: dict[str, float] = {}

    def recorded(data, ref, *args):  # the real work, and when it ended
        try:
            return prepare_bytes(data, ref, *args)
        finally:
            finished[ref.param] = time.monotonic()

    monkeypatch.setattr(pipeline, "prepare_bytes", recorded)
    pool = ThreadPoolExecutor(2)
    pipe = MediaPipeline(CFG, PatchSpec(), pool)
    video = "data:video/mp4;base64," + base64.b64encode(bombs.long_mp4()).decode()
    image = "data:image/png;base64," + base64.b64encode(bombs.valid_media()["png"]).decode()

    async def main():
        a = asyncio.ensure_future(pipe.prepare_all([MediaRef("video", video, f"A{i}") for i in range(3)]))
        await asyncio.sleep(0.05)  # A's items are in the pool
        b = await pipe.prepare_all([MediaRef("image", image, "B")])
        return await a, b

    try:
        a, b = asyncio.run(main())
    finally:
        pool.shutdown()
    assert len(a) == 3 and len(b) == 1
    assert finished["B"] < min(finished[f"A{i}"] for i in range(3)), finished


def test_inline_media_is_decoded_from_base64_in_a_worker_not_on_the_event_loop(monkeypatch):
    """A 2 MB data URL takes milliseconds of base64 decoding, which on the event loop would stall every
    other request of the process (the Router prepares inline images itself at low load)."""
    import threading

    import app.media.pipeline as pipeline

    threads, real = [], pipeline.inline_bytes

    def recorded(*args, **kwargs):
        threads.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "inline_bytes", recorded)
    pool = ThreadPoolExecutor(2)
    image = "data:image/png;base64," + base64.b64encode(bombs.valid_media()["png"]).decode()
    try:
        items = asyncio.run(MediaPipeline(CFG, PatchSpec(), pool).prepare_all([MediaRef("image", image, "p")]))
    finally:
        pool.shutdown()
    assert len(items) == 1 and len(threads) == 1 and threads[0] is not threading.main_thread()
