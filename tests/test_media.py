import asyncio
import base64
import io

import numpy as np
import pytest

from app.errors import ClientError
from app.media.decode import decode_image, decode_video, open_rgb_image, sample_indices, sniff
from app.media.fetch import fetch
from app.media.preprocess import PatchSpec, frame_timestamps, patchify, preprocess_image, smart_resize
from helpers import mp4_bytes, png_bytes

BIG = 10**9


def test_image_decoding_applies_exif_orientation_and_rgb():
    from PIL import Image

    arr = np.zeros((20, 40, 3), np.uint8)
    arr[:, :20] = 255  # left half white
    img = Image.fromarray(arr).convert("RGBA")
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    buf = io.BytesIO()
    img.convert("RGB").save(buf, format="JPEG", exif=exif, quality=95)
    out = decode_image(buf.getvalue(), param="p", max_pixels=BIG)
    assert out.shape == (40, 20, 3) and out.dtype == np.uint8
    assert out[:10].mean() > 200 and out[-10:].mean() < 50  # white half is now on top
    rgba = io.BytesIO()
    img.save(rgba, format="PNG")
    assert decode_image(rgba.getvalue(), param="p", max_pixels=BIG).shape == (20, 40, 3)


def test_undecodable_and_mismatched_media_are_client_errors():
    with pytest.raises(ClientError) as e:
        decode_image(b"not an image at all", param="x", max_pixels=BIG)
    assert e.value.status == 400 and e.value.code == "invalid_image" and e.value.param == "x"
    assert "BytesIO" not in e.value.message and "0x" not in e.value.message  # no server object in the text
    with pytest.raises(ClientError) as e:
        decode_image(mp4_bytes(4), param="x", max_pixels=BIG)
    assert e.value.code == "media_type_mismatch"
    with pytest.raises(ClientError) as e:
        decode_image(png_bytes(64, 64), param="x", max_pixels=100)
    assert e.value.code == "image_too_large"
    with pytest.raises(ClientError) as e:
        decode_video(b"\0" * 100, param="v", fps=2, min_frames=4, max_frames=8, max_duration_s=60, max_pixels=BIG)
    assert e.value.code == "invalid_video" and "Errno" not in e.value.message and "<none>" not in e.value.message


def test_animated_gif_is_refused_as_an_image():
    from PIL import Image

    frames = [Image.fromarray(np.full((8, 8, 3), i * 40, np.uint8)) for i in range(3)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    with pytest.raises(ClientError) as e:
        decode_image(buf.getvalue(), param="x", max_pixels=BIG)
    assert e.value.code == "media_type_mismatch"


def test_sniff_uses_bytes_not_names():
    assert sniff(png_bytes()) == "image"
    assert sniff(png_bytes(fmt="JPEG")) == "image"
    assert sniff(mp4_bytes(2)) == "video"
    assert sniff(b"hello") is None


def test_video_sampling_at_fps_with_bounds():
    v = decode_video(mp4_bytes(frames=40, fps=10), param="v", fps=2, min_frames=4, max_frames=64,
                     max_duration_s=60, max_pixels=BIG)
    assert v.total_frames == 40 and abs(v.fps - 10) < 1e-6
    assert len(v.indices) == 8 and v.frames.shape == (8, 64, 64, 3)  # 4 s at 2 fps
    assert v.indices == np.linspace(0, 39, 8).round().astype(int).tolist()
    short = decode_video(mp4_bytes(frames=5, fps=10), param="v", fps=2, min_frames=4, max_frames=64,
                         max_duration_s=60, max_pixels=BIG)
    assert len(short.indices) == 4  # min_frames, kept even
    with pytest.raises(ClientError) as e:
        decode_video(mp4_bytes(frames=40, fps=10), param="v", fps=2, min_frames=4, max_frames=64,
                     max_duration_s=1, max_pixels=BIG)
    assert e.value.code == "video_too_long"


def test_a_still_image_sent_as_video_becomes_a_two_frame_video():
    v = decode_video(png_bytes(32, 48), param="v", fps=2, min_frames=4, max_frames=8, max_duration_s=60, max_pixels=BIG)
    assert v.frames.shape == (2, 32, 48, 3) and np.array_equal(v.frames[0], v.frames[1])


def test_sample_indices_are_even_and_bounded():
    for total in range(1, 200, 7):
        idx = sample_indices(total, 30.0, 2.0, 4, 16)
        assert len(idx) % 2 == 0 and 2 <= len(idx) <= 16 and idx == sorted(idx)
        assert all(0 <= i < max(total, 2) for i in idx)


def test_timestamps_average_each_temporal_pair():
    assert frame_timestamps([0, 10, 20, 30], 10.0, 2) == [0.5, 2.5]
    assert frame_timestamps([0, 10, 20], 10.0, 2) == [0.5, 2.0]


def test_fetch_data_urls_and_errors():
    from app.config import MediaConfig

    payload = png_bytes()
    url = "data:image/png;base64," + base64.b64encode(payload).decode()
    assert asyncio.run(fetch(url, MediaConfig(), param="p")) == payload
    for bad, code, cfg in [("ftp://x/y.png", "invalid_media_url", MediaConfig()),
                           ("data:image/png;base64", "invalid_media_url", MediaConfig()),
                           ("http://127.0.0.1:9/x.png", "media_url_forbidden", MediaConfig()),
                           ("http://127.0.0.1:9/x.png", "media_fetch_failed", MediaConfig(allow_private_networks=True))]:
        with pytest.raises(ClientError) as e:
            asyncio.run(fetch(bad, cfg, param="p"))
        assert e.value.code == code
    with pytest.raises(ClientError) as e:
        asyncio.run(fetch(url, MediaConfig(max_media_bytes=10), param="p"))
    assert e.value.status == 413


@pytest.mark.parametrize("hw", [(100, 150), (448, 448), (37, 900), (1200, 800), (33, 33)])
def test_image_preprocessing_equals_transformers(hw):
    pytest.importorskip("transformers")
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    lo, hi = 64 * 32 * 32, 1024 * 1024
    proc = Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                                    image_std=[0.5] * 3, size={"shortest_edge": lo, "longest_edge": hi})
    img = (np.random.default_rng(hw[0]).random((*hw, 3)) * 255).astype(np.uint8)
    ours = preprocess_image(img, PatchSpec(), lo, hi)
    ref = proc(images=[img], return_tensors="np")
    assert list(ours.grid) == ref["image_grid_thw"][0].tolist()
    assert np.abs(ours.pixel_values - ref["pixel_values"]).max() < 1e-5


def test_a_video_whose_resolution_changes_part_way_is_decoded_at_its_first_size():
    """Two MPEG-TS pieces, 320x240 then 160x120, one after the other (a spliced or adaptive stream):
    the sampled frames come at the first size, from both pieces (a ValueError, so a 500, before)."""
    import av

    def piece(w, h, shade):
        buf = io.BytesIO()
        with av.open(buf, "w", format="mpegts") as c:
            s = c.add_stream("mpeg2video", rate=10)
            s.width, s.height, s.pix_fmt = w, h, "yuv420p"
            for _ in range(20):
                for pkt in s.encode(av.VideoFrame.from_ndarray(np.full((h, w, 3), shade, np.uint8), format="rgb24")):
                    c.mux(pkt)
            for pkt in s.encode():
                c.mux(pkt)
        return buf.getvalue()

    v = decode_video(piece(320, 240, 40) + piece(160, 120, 200), param="v", fps=2, min_frames=4, max_frames=64,
                     max_duration_s=600, max_pixels=10**8)
    assert v.frames.shape[1:] == (240, 320, 3) and len(v.frames) >= 4
    shades = v.frames.reshape(len(v.frames), -1).mean(1)
    assert shades.min() < 80 and shades.max() > 160  # frames from both pieces


@pytest.mark.parametrize("rotation", [90, -90, 180])
def test_a_video_with_a_display_rotation_is_decoded_upright(rotation):
    """A phone's portrait video: landscape frames plus a display rotation. The decoded frames are turned
    as PyAV defines frame.rotation (counterclockwise degrees), so a marked corner lands where a player
    shows it; they were given to the model sideways."""
    import av

    coded = np.zeros((240, 320, 3), np.uint8)
    coded[:60, :80] = 255  # the top-left corner as coded
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("mpeg4", rate=10)
        s.width, s.height, s.pix_fmt = 320, 240, "yuv420p"
        s.set_display_rotation(rotation)
        for _ in range(20):
            for pkt in s.encode(av.VideoFrame.from_ndarray(coded, format="rgb24")):
                c.mux(pkt)
        for pkt in s.encode():
            c.mux(pkt)
    v = decode_video(buf.getvalue(), param="v", fps=2, min_frames=4, max_frames=64, max_duration_s=600,
                     max_pixels=10**8)
    want = np.rot90(coded, rotation // 90)
    assert v.frames.shape[1:] == want.shape
    assert np.abs(v.frames[0].astype(int) - want).mean() < 8  # up to the codec's loss


def test_smart_resize_bounds():
    for h, w in [(10, 10), (4000, 3000), (500, 20)]:
        hh, ww = smart_resize(h, w, 32, 1024, 1 << 20)
        assert hh % 32 == 0 and ww % 32 == 0 and 1024 <= hh * ww <= 1 << 20
    with pytest.raises(ClientError):
        smart_resize(1, 500, 32, 1024, 1 << 20)


def test_smart_resize_equals_transformers_including_sides_below_half_a_factor():
    """Our resize grid equals transformers' smart_resize over thin and ordinary sizes, with Qwen3-VL's
    bounds (factor 32) and Qwen2.5-VL's (factor 28, min 3136). Sides of at most factor / 2 used to be
    lifted to a factor before the bounds, skipping the upscale: 15 x 3000 came out (32, 2720 + ...)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as reference

    rng = np.random.default_rng(3)
    sizes = [(15, 3000), (16, 2705), (10, 817), (14, 14), (1, 150), (3, 500), (400, 7), (448, 448), (1080, 1920)]
    sizes += [(int(h), int(w)) for h, w in rng.integers(1, 4000, (400, 2)) if max(h, w) / min(h, w) <= 200]
    for factor, lo, hi in ((32, 1024, 1 << 20), (28, 3136, 12845056), (32, 65536, 16777216)):
        for h, w in sizes:
            assert smart_resize(h, w, factor, lo, hi) == reference(h, w, factor, lo, hi), (h, w, factor)


def test_transparent_pixels_are_laid_over_white_as_transformers_does():
    """RGBA, LA and palette images with a transparent colour: the decoded RGB equals transformers'
    convert_to_rgb (transparency over white). Black text on transparent pixels stays readable."""
    from PIL import Image
    from transformers.image_transforms import convert_to_rgb

    rgba = np.zeros((16, 24, 4), np.uint8)
    rgba[4:8, 4:20] = (0, 0, 0, 255)  # black text, the rest transparent black
    rgba[10:12, :, :] = (200, 30, 30, 128)  # a half-transparent red stripe
    images = [Image.fromarray(rgba, "RGBA"), Image.fromarray(rgba, "RGBA").convert("LA")]
    rgb = np.zeros((16, 24, 3), np.uint8)
    rgb[:] = (0, 255, 0)  # a green background, its palette entry marked transparent
    rgb[4:8, 4:20] = 0
    pal = Image.fromarray(rgb, "RGB").convert("P")
    pal.info["transparency"] = pal.getpixel((0, 0))
    images.append(pal)
    for img in images:
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        got = decode_image(buf.getvalue(), param="p", max_pixels=BIG)
        want = convert_to_rgb(Image.open(io.BytesIO(buf.getvalue())), return_numpy=True)
        assert np.array_equal(got, want), img.mode
        assert got[0, 0].tolist() == [255, 255, 255] and got[5, 10].tolist() == [0, 0, 0]


def test_patchify_layout_matches_a_conv3d_view():
    """Row r of pixel_values is exactly the (C, T, P, P) block the Conv3d patch embed reads."""
    rng = np.random.default_rng(0)
    frames = (rng.random((4, 64, 96, 3)) * 255).astype(np.uint8)
    p = patchify(frames, PatchSpec())
    assert p.grid == (2, 4, 6) and p.pixel_values.shape == (48, 3 * 2 * 16 * 16)
    x = (frames.astype(np.float32) / 255 - 0.5) / 0.5
    # token order: temporal group, merge-block row, merge-block col, row in block, col in block
    t, br, bc, ir, ic = 1, 1, 2, 0, 1
    row = ((t * 2 + br) * 3 + bc) * 4 + ir * 2 + ic
    r, c = (br * 2 + ir) * 16, (bc * 2 + ic) * 16
    block = x[t * 2:t * 2 + 2, r:r + 16, c:c + 16].transpose(3, 0, 1, 2)  # C, T, P, P
    assert np.allclose(p.pixel_values[row], block.reshape(-1), atol=1e-6)


def test_patchify_equals_a_row_by_row_reference_with_padding_and_any_mean_and_std():
    """Every row against a plain loop over patches, in float64 as the processor's formula reads:
    3 frames (the last temporal group padded with the last frame) and CLIP's mean and std."""
    spec = PatchSpec(mean=(0.48145466, 0.4578275, 0.40821073), std=(0.26862954, 0.26130258, 0.27577711))
    frames = (np.random.default_rng(3).random((3, 64, 32, 3)) * 255).astype(np.uint8)
    got = patchify(frames, spec)
    x = (frames.astype(np.float64) / 255 - np.asarray(spec.mean)) / np.asarray(spec.std)
    x = np.concatenate([x, x[-1:]])  # temporal padding
    rows = []
    for t in range(2):
        for br in range(2):  # merge-block rows: 64 / 32
            for bc in range(1):
                for ir in range(2):
                    for ic in range(2):
                        r, c = (br * 2 + ir) * 16, (bc * 2 + ic) * 16
                        rows.append(x[t * 2:t * 2 + 2, r:r + 16, c:c + 16].transpose(3, 0, 1, 2).reshape(-1))
    assert got.grid == (2, 4, 2) and got.pixel_values.dtype == np.float32
    assert np.abs(got.pixel_values - np.stack(rows)).max() <= 2e-6


@pytest.mark.parametrize("hw", [(100, 150), (448, 448), (1200, 800)])
def test_a_pil_image_is_preprocessed_exactly_as_its_array(hw):
    """The router hands the decoded PIL image to the resize (no full-size array): same rows, bit for bit."""
    data = png_bytes(*hw, seed=hw[0])
    lo, hi = 64 * 32 * 32, 512 * 32 * 32
    from_pil = preprocess_image(open_rgb_image(data, param="p", max_pixels=BIG), PatchSpec(), lo, hi)
    from_array = preprocess_image(decode_image(data, param="p", max_pixels=BIG), PatchSpec(), lo, hi)
    assert from_pil.grid == from_array.grid and np.array_equal(from_pil.pixel_values, from_array.pixel_values)


def test_the_cache_key_follows_the_towers_input_not_the_file():
    from app.api.schemas import MediaRef
    from app.config import MediaConfig
    from app.media.pipeline import prepare_bytes

    cfg, spec, ref = MediaConfig(), PatchSpec(), MediaRef("image", "u", "p")
    key = prepare_bytes(png_bytes(300, 200, seed=1), ref, cfg, spec).key
    assert prepare_bytes(png_bytes(300, 200, seed=1, fmt="BMP"), ref, cfg, spec).key == key  # same pixels
    assert prepare_bytes(png_bytes(300, 200, seed=2), ref, cfg, spec).key != key
    same_grid = cfg.model_copy(update={"image_max_pixels": 128 * 32 * 32})  # does not bind: same input, same key
    assert prepare_bytes(png_bytes(300, 200, seed=1), ref, same_grid, spec).key == key
    smaller = cfg.model_copy(update={"image_min_pixels": 16 * 32 * 32, "image_max_pixels": 32 * 32 * 32})
    assert prepare_bytes(png_bytes(300, 200, seed=1), ref, smaller, spec).key != key  # resized to another grid
    assert prepare_bytes(png_bytes(300, 200, seed=1), ref, cfg, PatchSpec(mean=(0.4, 0.5, 0.5))).key != key


def test_fetch_over_http_from_a_local_server():
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    payload = png_bytes(20, 30)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body, code = (payload, 200) if self.path == "/img.png" else (b"missing", 404)
            self.send_response(code)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        from app.config import MediaConfig

        base, cfg = f"http://127.0.0.1:{srv.server_address[1]}", MediaConfig(allow_private_networks=True)
        assert asyncio.run(fetch(f"{base}/img.png", cfg, param="p")) == payload
        with pytest.raises(ClientError) as e:
            asyncio.run(fetch(f"{base}/nope.png", cfg, param="p"))
        assert e.value.code == "media_fetch_failed" and "404" in e.value.message
    finally:
        srv.shutdown()
