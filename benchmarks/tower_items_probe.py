"""Why did 8 × 448² take 75 ms in benchmarks/tower_tp.py on an H200 when 4 × 448² takes 8 in encoder.py?

One GPU, the 8B tower, the graph manager set up as tower_tp.py sets it up (uint8 rows, pinned staging
from 2048 rows, uniform graphs captured on demand). Times `encode` for 1, 2, 4 and 8 images of 448²
and one 1024² image, with the rows on the host (as the service and tower_tp.py pass them) and on the
device (as encoder.py passes them), eager and through the manager; then a CPU+CUDA profile of the
slowest case. A probe for one question, kept with its answer in
benchmarks/results/2026-11-27-models-beyond-one-gpu.md.

    python3 benchmarks/tower_items_probe.py --out $OUT/tower_items_probe.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.stats import p99  # noqa: E402

CASES = {"1x448^2": [(1, 28, 28)], "2x448^2": [(1, 28, 28)] * 2, "4x448^2": [(1, 28, 28)] * 4,
         "8x448^2": [(1, 28, 28)] * 8, "1x1024^2": [(1, 64, 64)]}


def build(preset: str, device: torch.device):
    from transformers import AutoConfig

    from app.checkpoints.model_builder import load_preset
    from app.media.preprocess import PatchSpec
    from app.vision.graphs import GraphManager, GraphSettings
    from app.vision.loading import vision_params
    from app.vision.tower import VisionTower

    cfg = AutoConfig.for_model(**load_preset(preset)).vision_config
    torch.manual_seed(0)
    visual = vision_params(cfg, torch.bfloat16, device)
    norm = PatchSpec(patch=cfg.patch_size, temporal=cfg.temporal_patch_size, merge=cfg.spatial_merge_size,
                     mean=(0.5,) * 3, std=(0.5,) * 3).column_norm()
    tower = VisionTower(visual, pixel_norm=norm)
    mgr = GraphManager(tower, GraphSettings(
        budgets=GraphSettings.power_of_two_budgets(256, 8192, 4), max_items_per_batch=16, max_frames_per_batch=32,
        uniform_capture_after=2, uint8_pixels=True, observe_dispatch=False, pinned_staging=True,
        pinned_min_rows=2048))
    mgr.capture()
    return mgr


def timed(fn, runs: int) -> dict:
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": round(statistics.median(times), 3), "p99_ms": round(p99(times), 3)}


def main() -> None:
    from app.vision.graphs import VisionItem

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-vl-8b")
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    dev = torch.device("cuda", 0)
    mgr = build(a.preset, dev)
    g = torch.Generator().manual_seed(1)
    result = {"device": torch.cuda.get_device_name(dev), "preset": a.preset, "runs": a.runs, "cases": {}}
    slowest = (0.0, None)
    with torch.inference_mode():
        for name, grids in CASES.items():
            host = [VisionItem(torch.randint(0, 256, (t * h * w, mgr.tower.patch_dim), generator=g,
                                             dtype=torch.uint8), (t, h, w)) for t, h, w in grids]
            on_dev = [VisionItem(it.pixels.to(dev), it.grid) for it in host]
            row = {}
            for where, items in (("host", host), ("device", on_dev)):
                for label, eager in (("manager", False), ("eager", True)):
                    def fn(items=items, eager=eager):
                        return mgr.encode(items, force_eager=eager)
                    for _ in range(3):
                        fn()
                    mgr.capture_pending()
                    row[f"{where} {label}"] = r = timed(fn, a.runs)
                    if r["median_ms"] > slowest[0]:
                        slowest = (r["median_ms"], (name, fn))
            result["cases"][name] = row
            print(name, {k: v["median_ms"] for k, v in row.items()}, flush=True)
            Path(a.out).write_text(json.dumps(result, indent=1))
        from torch.profiler import ProfilerActivity, profile

        name, fn = slowest[1]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        result["profiled"] = name
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        table += "\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
        Path(a.out).with_suffix(".profile.txt").write_text(table)
        print(table[:6000])
    Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
