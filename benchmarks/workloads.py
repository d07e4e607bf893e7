"""Traffic for the goodput benchmark (benchmarks/goodput.py): when requests arrive, and a realistic mix
of what they carry. Everything is seeded: the same arguments give the same arrivals and the same bodies.

Arrivals (`arrival_times`)
    Open loop: request k is sent at its scheduled time whatever the server is doing. Inter-arrival gaps
    are independent gamma draws with mean 1/rate and coefficient of variation `cv` (shape 1/cv^2,
    scale cv^2/rate), from numpy's `default_rng(seed)`:
    - `poisson`: cv = 1 (exponential gaps), the arrivals of many independent users;
    - `gamma`, cv > 1: bursty traffic, gaps that are mostly short with rare long silences (cv = 2:
      shape 0.25). The counts in a long window have variance about cv^2 times their mean (Poisson: 1).
    The schedule covers [0, duration) and is dealt round-robin to the load processes, so several
    processes send one process of the declared kind (splitting the rate instead would turn gamma
    streams into their superposition, which is closer to Poisson).

The realistic mix (`MixWorkload`, seed S, default 0)
    Request i is drawn from numpy's `default_rng([S, i])` alone (its pixels from `default_rng([S, i, 1])`),
    so any request can be regenerated without the others, and a run's requests never repeat media
    (the server's embedding cache is keyed on decoded pixels; repeats would flatter it).
    - kind: a video with probability 0.2; else two or three images (equally likely) with probability
      0.1 of all requests; else one image (0.7).
    - image: long side uniform in [256, 1600] px; orientation portrait or landscape with equal odds;
      aspect ratio (long/short) one of 1, 4/3, 3/2, 16/9 equally likely; both sides rounded to even.
      Content: a smooth random field (bilinear upsampling of 1/32-scale noise) with a little grain,
      JPEG quality 85, about 0.18 bytes per pixel like a photograph (pure noise, as in serve.py's
      fixed workloads, is ten times larger and slower to decode than photographs).
    - video: 4-32 frames (uniform) at 2 fps, so the server's 2 fps sampling keeps every frame (2-16 s
      clips); long side uniform in [224, 448] px, landscape, aspect 4/3 or 16/9; the same kind of
      content drifting across the frame, MPEG-4 Part 2 in MP4 (PyAV).
    - prompt: 16-512 words, log-uniform (median about 90), words drawn uniformly from `WORDS`; media
      parts come first, then the text.
    - output: max_tokens lognormal with median 64 and sigma 0.8, rounded, clipped to [4, 512] (about
      0.5% reach the 512 cap); `ignore_eos` so every request generates exactly that many tokens;
      temperature 0 (`sampling="defaults"`: none, the checkpoint's own); streamed with usage.
    `python benchmarks/workloads.py --describe 10000` prints the drawn proportions and ranges.
"""

from __future__ import annotations

import argparse
import base64
import io
import math
from dataclasses import dataclass

import numpy as np

ARRIVALS = ("poisson", "gamma")


def arrival_times(rate: float, duration_s: float, process: str = "poisson", cv: float = 1.0,
                  seed: int = 0) -> np.ndarray:
    """Send times in [0, duration_s) of an open-loop stream at `rate` requests/s (see the module doc)."""
    if process not in ARRIVALS:
        raise ValueError(f"arrival process {process!r}: one of {ARRIVALS}")
    if process == "poisson":
        cv = 1.0
    if not cv > 0:
        raise ValueError(f"cv must be positive, not {cv}")
    if rate <= 0 or duration_s <= 0:
        return np.zeros(0)
    shape = 1.0 / cv ** 2
    rng = np.random.default_rng(seed)
    expected = rate * duration_s
    n = int(expected + 6 * cv * math.sqrt(expected) + 16)
    t = np.cumsum(rng.gamma(shape, 1.0 / (rate * shape), size=n))
    while t[-1] < duration_s:  # a rare long draw: extend with more gaps from the same stream
        t = np.concatenate([t, t[-1] + np.cumsum(rng.gamma(shape, 1.0 / (rate * shape), size=n))])
    return t[t < duration_s]


# ---------------------------------------------------------------------------- the realistic mix
WORDS = ("the a of and to in is that it for on with as was at by an be this from or which what where how "
         "describe explain compare list count find read tell show summarise identify estimate image picture photo "
         "video frame scene person people car street building sky tree water table chart text sign colour "
         "red green blue left right top bottom middle background foreground small large many few first last "
         "before after during moving standing holding looking near far inside outside detail object animal "
         "dog cat bird food plate window door road light shadow number letter word line page document "
         "question answer reason because whether each every other same different important visible hidden").split()

ASPECTS = (1.0, 4 / 3, 3 / 2, 16 / 9)
VIDEO_ASPECTS = (4 / 3, 16 / 9)


def _even(x: float) -> int:
    return max(2, 2 * round(x / 2))


_GRAIN = np.random.default_rng(20261128).integers(-6, 7, size=(256, 256, 1), dtype=np.int16)


def photo_like(w: int, h: int, rng: np.random.Generator) -> np.ndarray:
    """An RGB (h, w, 3) uint8 image with a photograph's smoothness: bilinear upsampling of 1/32-scale
    noise (which makes every image distinct), plus a fixed tile of grain (cheaper than drawing it)."""
    from PIL import Image

    small = (rng.random((max(2, h // 32), max(2, w // 32), 3)) * 255).astype(np.uint8)
    x = np.asarray(Image.fromarray(small).resize((w, h), Image.Resampling.BILINEAR)).astype(np.int16)
    x += np.tile(_GRAIN, (-(-h // 256), -(-w // 256), 1))[:h, :w]
    np.clip(x, 0, 255, out=x)
    return x.astype(np.uint8)


def jpeg_bytes(w: int, h: int, rng: np.random.Generator, quality: int = 85) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(photo_like(w, h, rng)).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def video_bytes(frames: int, w: int, h: int, rng: np.random.Generator, fps: int = 2) -> bytes:
    """An MP4 (MPEG-4 Part 2) of `frames` frames: photo-like content drifting across the frame."""
    import av

    pad = 64
    base = photo_like(w + pad, h + pad, rng)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for f in range(frames):
            dx, dy = (3 * f) % pad, (2 * f) % pad
            frame = np.ascontiguousarray(base[dy:dy + h, dx:dx + w])
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(stream.encode())
    return buf.getvalue()


SAMPLINGS = ("greedy", "defaults")


def sampling_fields(sampling: str) -> dict:
    """A body's sampling fields: temperature 0, or none (the server's defaults)."""
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling {sampling!r}: one of {', '.join(SAMPLINGS)}")
    return {"temperature": 0} if sampling == "greedy" else {}


def sampling_suffix(sampling: str) -> str:
    """What a workload's label says of its sampling: nothing for greedy (every earlier result's label)."""
    return "" if sampling == "greedy" else f", {sampling} sampling"


@dataclass(frozen=True)
class MixWorkload:
    """The realistic mix (module doc). Duck-types serve.Workload (`kind`, `label`, `body(i)`), so
    serve.run_load and serve.build_bodies take it too."""

    seed: int = 0
    video_share: float = 0.2
    multi_image_share: float = 0.1  # of all requests: two or three images
    image_long: tuple[int, int] = (256, 1600)
    video_frames: tuple[int, int] = (4, 32)
    video_long: tuple[int, int] = (224, 448)
    video_fps: int = 2
    prompt_words: tuple[int, int] = (16, 512)
    output_median: float = 64.0
    output_sigma: float = 0.8
    output_tokens: tuple[int, int] = (4, 512)
    sampling: str = "greedy"  # as serve.Workload's

    kind = "mix"

    @property
    def label(self) -> str:
        return ("mix" if self.seed == 0 else f"mix{self.seed}") + sampling_suffix(self.sampling)

    def draw(self, i: int) -> dict:
        """Request i's shape, without its media: {"kind": image|images|video, "images": [(w, h), ...],
        "video": (frames, w, h) or None, "prompt_words", "max_tokens"}."""
        rng = np.random.default_rng([self.seed, i])
        u = rng.random()
        images, video = [], None
        if u < self.video_share:
            kind = "video"
            frames = int(rng.integers(self.video_frames[0], self.video_frames[1] + 1))
            long = int(rng.integers(self.video_long[0], self.video_long[1] + 1))
            aspect = VIDEO_ASPECTS[int(rng.integers(len(VIDEO_ASPECTS)))]
            video = (frames, _even(long), _even(long / aspect))
        else:
            kind = "images" if u < self.video_share + self.multi_image_share else "image"
            count = int(rng.integers(2, 4)) if kind == "images" else 1
            for _ in range(count):
                long = int(rng.integers(self.image_long[0], self.image_long[1] + 1))
                aspect = ASPECTS[int(rng.integers(len(ASPECTS)))]
                w, h = _even(long), _even(long / aspect)
                images.append((w, h) if rng.random() < 0.5 else (h, w))  # landscape or portrait
        lo, hi = self.prompt_words
        words = int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
        out = int(round(math.exp(math.log(self.output_median) + self.output_sigma * rng.standard_normal())))
        return {"kind": kind, "images": images, "video": video, "prompt_words": min(hi, max(lo, words)),
                "max_tokens": min(self.output_tokens[1], max(self.output_tokens[0], out))}

    def body(self, i: int, image_url: str | None = None) -> dict:
        """Request i's chat-completions body (streamed, with usage, `ignore_eos`)."""
        shape = self.draw(i)
        rng = np.random.default_rng([self.seed, i, 1])
        parts = []
        for w, h in shape["images"]:
            url = image_url or "data:image/jpeg;base64," + base64.b64encode(jpeg_bytes(w, h, rng)).decode()
            parts.append({"type": "image_url", "image_url": {"url": url}})
        if shape["video"] is not None:
            frames, w, h = shape["video"]
            data = video_bytes(frames, w, h, rng, self.video_fps)
            parts.append({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,"
                                                             + base64.b64encode(data).decode()}})
        text = " ".join(WORDS[k] for k in rng.integers(len(WORDS), size=shape["prompt_words"]))
        parts.append({"type": "text", "text": text})
        return {"model": "bench", "messages": [{"role": "user", "content": parts}],
                "max_tokens": shape["max_tokens"], **sampling_fields(self.sampling), "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}


def describe(mix: MixWorkload, n: int) -> dict:
    """Proportions and ranges of n drawn requests (no media built)."""
    shapes = [mix.draw(i) for i in range(n)]
    kinds = {k: sum(s["kind"] == k for s in shapes) / n for k in ("image", "images", "video")}
    longs = [max(w, h) for s in shapes for w, h in s["images"]]
    portrait = sum(h > w for s in shapes for w, h in s["images"]) / max(1, len(longs))
    videos = [s["video"] for s in shapes if s["video"]]
    out = [s["max_tokens"] for s in shapes]
    words = [s["prompt_words"] for s in shapes]
    return {"requests": n, "kinds": kinds, "image_long_side": [min(longs), float(np.median(longs)), max(longs)],
            "portrait_share": portrait,
            "video_frames": [min(v[0] for v in videos), max(v[0] for v in videos)],
            "video_long_side": [min(max(v[1:]) for v in videos), max(max(v[1:]) for v in videos)],
            "prompt_words": [min(words), float(np.median(words)), max(words)],
            "max_tokens": [min(out), float(np.median(out)), float(np.percentile(out, 99)), max(out)]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--describe", type=int, default=10000, metavar="N", help="draw N requests and print their stats")
    p.add_argument("--write", type=int, default=0, metavar="N", help="write the first N bodies as JSON lines")
    p.add_argument("--out", default="mix.jsonl")
    a = p.parse_args()
    import json

    mix = MixWorkload(a.seed)
    print(json.dumps(describe(mix, a.describe), indent=1))
    if a.write:
        with open(a.out, "w") as f:
            for i in range(a.write):
                f.write(json.dumps(mix.body(i)) + "\n")
        print(f"wrote {a.write} bodies to {a.out}")


if __name__ == "__main__":
    main()
