"""Router-side media preparation per item: decode, resize, patchify, cache key (`prepare_bytes`).

The Router runs this on its CPU thread pool for every image and video before anything reaches the
GPU, so its cost adds to each request's time to first token and bounds a Router replica's rate.
Prints a markdown table of the median and p99 over `--runs` runs.

    python benchmarks/preprocess.py [--runs 40]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from app.api.schemas import MediaRef  # noqa: E402
from app.config import MediaConfig  # noqa: E402
from app.media.pipeline import prepare_bytes  # noqa: E402
from app.media.preprocess import PatchSpec  # noqa: E402
from app.media.synthetic import image_bytes, mp4_bytes  # noqa: E402
from benchmarks.stats import p99, wall_times_ms  # noqa: E402

CASES = {
    "image 448x448 JPEG": ("image", lambda: image_bytes(448, 448, fmt="JPEG")),
    "image 1024x768 JPEG": ("image", lambda: image_bytes(768, 1024, fmt="JPEG")),
    # random pixels: a 10.7 MB file, slower to decode than a real photo of that size
    "image 4000x3000 JPEG": ("image", lambda: image_bytes(3000, 4000, fmt="JPEG")),
    "video 224x224, 16 frames at 4 fps (MP4)": ("video", lambda: mp4_bytes(16, 224, 224, fps=4)),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=40)
    args = ap.parse_args()
    cfg, spec = MediaConfig(), PatchSpec()
    print("| item | tokens | median ms | p99 ms |\n|---|---|---|---|")
    for name, (kind, make) in CASES.items():
        data, ref = make(), MediaRef(kind, "bench", "bench")
        item = prepare_bytes(data, ref, cfg, spec)
        times = wall_times_ms(partial(prepare_bytes, data, ref, cfg, spec), args.runs)
        print(f"| {name} | {item.patches.num_tokens} | {statistics.median(times):.2f} | {p99(times):.2f} |")


if __name__ == "__main__":
    main()
