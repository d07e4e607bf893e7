"""benchmarks/encoder.py's CPU smoke mode, so the benchmark cannot rot between GPU runs.

The tiny preset of each family (Qwen3-VL, Qwen2.5-VL, MiniCPM-V) runs its one-image and mixed-batch
workloads through every column (reference, our eager, first sight, ours) in float32. Its JSON must hold
the numbers the GPU run reports, and our outputs there must equal the references' (<= 1e-4, the towers'
CPU tolerance): the benchmark compares real outputs, it does not only time them.
"""

from __future__ import annotations

import json
import math

from benchmarks.encoder import SMOKE_PRESETS, main


def test_smoke_mode_runs_every_family_and_checks_its_outputs(tmp_path):
    out = tmp_path / "encoder.json"
    main(["--smoke", "--runs", "1", "--warmup", "0", "--workloads", "1x448^2", "mixed*", "--out", str(out)])
    data = json.loads(out.read_text())
    assert [r["preset"] for r in data["results"]] == SMOKE_PRESETS
    assert [r["family"] for r in data["results"]] == ["qwen3_vl", "qwen2_5_vl", "minicpmv"]
    for r in data["results"]:
        assert [w["workload"] for w in r["workloads"]][0] == "1x448^2" and len(r["workloads"]) == 2
        for w in r["workloads"]:
            for col in ("ref_ms", "eager_ms", "first_ms", "ours_ms", "ours_p99"):
                assert math.isfinite(w[col]) and w[col] > 0, (r["preset"], w["workload"], col)
            assert w["ref_over_ours"] == w["ref_ms"] / w["ours_ms"]
            assert w["ours_over_eager"] == w["ours_ms"] / w["eager_ms"]
            # No capture on the CPU: fitting batches take the padded static-shape path of their budget.
            assert w["path"] == w["first_path"] == "budget graph" and w["budget"] >= w["tokens"]
            for err in ("ours_vs_ref_max", "ours_vs_fp32_max", "eager_vs_ref_max"):
                assert w[err] <= 1e-4, (r["preset"], w["workload"], err, w[err])
            # MiniCPM-V's published default path (eager attention) is timed beside its reference and
            # must compute the same embeddings; the Qwen families have one reference.
            extra = w["extra_refs"]
            assert list(extra) == (["published default (eager attention)"] if r["family"] == "minicpmv" else [])
            for o in extra.values():
                assert o["vs_fp32_max"] <= 1e-4 and o["ms"] > 0 and o["over_ours"] == o["ms"] / w["ours_ms"]
    mixed = {r["family"]: r["workloads"][1] for r in data["results"]}
    assert len(mixed["minicpmv"]["grids"]) == 5  # 2 x 448^2 + a 640 x 480 cut into a thumbnail and 2 slices
    assert [g[0] for g in mixed["qwen2_5_vl"]["grids"]] == [1, 4, 1, 1, 1]  # a video among the images
    md = out.with_suffix(".md").read_text()
    assert "| 1x448^2 |" in md and "- 1x448^2, published default (eager attention): " in md
