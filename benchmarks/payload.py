"""Router -> encoder payload through Ray: a request's items as normalised float32 rows (what the
router sent before) or raw uint8 rows (what it sends now; the encoder normalises on its device).

A stand-in actor receives the items and returns their row count, so only serialisation and the
transfer are timed, per call, median and p99 over `--runs` calls after a warm-up call.

    python benchmarks/payload.py [--runs 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from app.media.preprocess import PatchSpec, image_frames, patchify  # noqa: E402
from benchmarks.stats import p99, wall_times_ms  # noqa: E402


def main() -> None:
    import numpy as np
    import ray

    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=30)
    args = ap.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(include_dashboard=False, logging_level="ERROR")

    @ray.remote(num_cpus=0)
    class Encoder:
        def encode(self, items) -> int:
            return sum(int(px.shape[0]) for px, _ in items)

    enc = Encoder.remote()
    spec, rng = PatchSpec(), np.random.default_rng(0)
    print("| items | float32 rows: MB, median ms (p99) | uint8 rows: MB, median ms (p99) | ratio |\n|---|---|---|---|")
    for side, count in [(448, 1), (448, 8), (1024, 1)]:
        frames = image_frames((rng.random((side, side, 3)) * 255).astype(np.uint8), spec, 0, 1 << 30)
        row = []
        for normalize in (True, False):
            p = patchify(frames, spec, normalize=normalize)
            items = [(p.pixel_values.copy(), p.grid) for _ in range(count)]
            times = wall_times_ms(lambda items=items: ray.get(enc.encode.remote(items)), args.runs)
            mb = sum(px.nbytes for px, _ in items) / 1e6
            row.append((mb, statistics.median(times), p99(times)))
        (fm, ft, fp), (um, ut, up) = row
        print(f"| {count} x {side}x{side} image | {fm:.1f} MB, {ft:.2f} ({fp:.2f}) | {um:.1f} MB, {ut:.2f} ({up:.2f}) "
              f"| {ft / ut:.1f}x |")
    ray.shutdown()


if __name__ == "__main__":
    main()
