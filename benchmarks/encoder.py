"""Vision encoder benchmark: reference eager vs our eager tower vs our CUDA graphs, per model family.

Real config shapes, random weights, bf16:
- Qwen3-VL 2B/8B (`qwen3-vl-2b`, `qwen3-vl-8b`): reference = transformers' `Qwen3VLVisionModel`;
- Qwen2.5-VL 3B/7B (`qwen2.5-vl-3b`, `qwen2.5-vl-7b`): reference = transformers'
  `Qwen2_5_VisionTransformerPretrainedModel` (window attention, one SDPA call per window);
- MiniCPM-V 4.5 (`minicpm-v-4.5`): reference = the published forward's batching (padded slices,
  SigLIP with a padding mask, the resampler's MultiheadAttention with a key padding mask:
  benchmarks/minicpmv_reference.py), on our modules' weights.
Every workload is timed side by side in one process with CUDA events (median and p99 over --runs after
warm-up), checked for correctness against the reference in bf16 and in float32 (the truth), and
compared with its FLOP floor at the matmul rate measured in the same run. Rows go in as the service
sends them: raw uint8, normalised inside the tower. The auto-tune drops every graph that is not faster
than eager, so "ours" is never the slower path; the last column checks that on every workload.

    python benchmarks/encoder.py --presets qwen3-vl-8b qwen2.5-vl-7b minicpm-v-4.5 \
        --out benchmarks/encoder_results.json --scoreboard benchmarks/scoreboard.json
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import logging
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.media.preprocess import PatchSpec  # noqa: E402
from app.model_builder import CLIP_MEAN, CLIP_STD, load_preset  # noqa: E402
from app.vision.graphs import GraphManager, GraphSettings, VisionItem  # noqa: E402
from app.vision.loading import vision_model_from_config  # noqa: E402
from app.vision.timing import cuda_times_ms  # noqa: E402
from benchmarks.stats import p99  # noqa: E402

# name -> grids (t, h, w) in 16-px patches; a 224^2 8-frame video is 4 temporal groups of 14x14.
WORKLOADS = {
    "1x448^2": [(1, 28, 28)],
    "4x448^2": [(1, 28, 28)] * 4,
    "8x224^2": [(1, 14, 14)] * 8,
    "video 224^2 x8f": [(4, 14, 14)],
    "4 videos 224^2 x8f": [(4, 14, 14)] * 4,
    "1x1024^2": [(1, 64, 64)],
    "mixed 2x448^2+video+2x224^2": [(1, 28, 28), (4, 14, 14), (1, 28, 28), (1, 14, 14), (1, 14, 14)],
}
# Qwen2.5-VL: 14-px patches, sides multiples of 28 (448 -> 32 x 32 patches, 224 -> 16, 1008 -> 72).
WORKLOADS_QWEN25 = {
    "1x448^2": [(1, 32, 32)],
    "4x448^2": [(1, 32, 32)] * 4,
    "8x224^2": [(1, 16, 16)] * 8,
    "video 224^2 x8f": [(4, 16, 16)],
    "4 videos 224^2 x8f": [(4, 16, 16)] * 4,
    "1x1008^2": [(1, 72, 72)],
    "mixed 2x448^2+video+2x224^2": [(1, 32, 32), (4, 16, 16), (1, 32, 32), (1, 16, 16), (1, 16, 16)],
}
# MiniCPM-V: one item per slice, 14-px patches. A 448^2 image is one 32 x 32 slice; a 1344 x 896 image
# is a 546 x 364 thumbnail (26 x 39 patches) and 3 x 2 slices of 448^2 (app/media/slicing.py).
WORKLOADS_MINICPMV = {
    "1x448^2": [(1, 32, 32)],
    "4x448^2": [(1, 32, 32)] * 4,
    "8x224^2": [(1, 16, 16)] * 8,
    "1344x896 (thumbnail + 6 slices)": [(1, 26, 39)] + [(1, 32, 32)] * 6,
    "mixed 448^2+1344x896+224^2": [(1, 32, 32), (1, 26, 39)] + [(1, 32, 32)] * 6 + [(1, 16, 16)],
}


@dataclass
class Family:
    """One tower under test: ours, the reference in bf16 and the truth in float32 (both take normalised
    float rows and grids, return [main, *extras] in item order), FLOPs of a batch, workloads."""

    tower: object
    reference: object
    truth: object
    flops: object
    workloads: dict


def tower_flops(cfg, grids) -> float:
    """Qwen3-VL: matmul FLOPs of one forward (linear layers + attention), the dominant work."""
    d, i, L = cfg.hidden_size, cfg.intermediate_size, cfg.depth
    m2 = cfg.spatial_merge_size**2
    n = sum(t * h * w for t, h, w in grids)
    patch = 2 * n * d * cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    per_layer = 2 * n * (3 * d * d + d * d + 2 * d * i)
    attn = sum(t * 4 * (h * w) ** 2 * d for t, h, w in grids)
    mergers = (1 + len(cfg.deepstack_visual_indexes)) * 2 * (n // m2) * (d * m2 * d * m2 + d * m2 * cfg.out_hidden_size)
    return patch + L * (per_layer + attn) + mergers


def qwen25_flops(cfg, grids) -> float:
    """Qwen2.5-VL: SwiGLU MLP (three matrices); attention over windows (at most 64 patches) except
    at the full-attention layers."""
    d, i, L = cfg.hidden_size, cfg.intermediate_size, cfg.depth
    m2 = cfg.spatial_merge_size**2
    n = sum(t * h * w for t, h, w in grids)
    patch = 2 * n * d * cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    per_layer = 2 * n * (4 * d * d + 3 * d * i)
    full = sum(t * 4 * (h * w) ** 2 * d for t, h, w in grids)
    window = 4 * n * 64 * d
    nf = len(cfg.fullatt_block_indexes)
    merger = 2 * (n // m2) * (d * m2 * d * m2 + d * m2 * cfg.out_hidden_size)
    return patch + L * per_layer + nf * full + (L - nf) * window + merger


def qwen_family(preset: str, spec_mean, spec_std, tower_cls, flops, workloads) -> Family:
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(**load_preset(preset)).vision_config
    torch.manual_seed(0)
    visual = vision_model_from_config(cfg, torch.bfloat16, "cuda")
    visual32 = copy.deepcopy(visual).float()  # the truth both bf16 paths are judged against
    spec = PatchSpec(patch=cfg.patch_size, temporal=cfg.temporal_patch_size, merge=cfg.spatial_merge_size,
                     mean=spec_mean, std=spec_std)

    def run(model):
        def f(px, grids):
            out = model(px, grid_thw=torch.tensor(grids, device="cuda"))
            return [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]
        return f

    return Family(tower_cls(visual, pixel_norm=spec.column_norm()), run(visual), run(visual32),
                  lambda grids: flops(cfg, grids), workloads)


def minicpmv_family(preset: str) -> Family:
    from app.minicpmv_builder import _random_vision
    from app.vision.minicpmv_tower import MiniCPMVTower
    from benchmarks.minicpmv_reference import PublishedStyleMiniCPMV, minicpmv_flops

    model = _random_vision(load_preset(preset), seed=0).cuda()
    ref32 = PublishedStyleMiniCPMV(copy.deepcopy(model).float())
    model = model.to(torch.bfloat16)
    ref16 = PublishedStyleMiniCPMV(model)
    spec = PatchSpec(patch=14, temporal=1, merge=1)
    return Family(MiniCPMVTower(model, pixel_norm=spec.column_norm()), ref16, ref32,
                  lambda grids: minicpmv_flops(model, grids), WORKLOADS_MINICPMV)


def family_for(preset: str) -> Family:
    model_type = load_preset(preset).get("model_type", "qwen3_vl")
    if model_type == "qwen2_5_vl":
        from app.vision.qwen25_tower import Qwen25Tower

        return qwen_family(preset, tuple(CLIP_MEAN), tuple(CLIP_STD), Qwen25Tower, qwen25_flops, WORKLOADS_QWEN25)
    if model_type == "minicpmv":
        return minicpmv_family(preset)
    from app.vision.tower import VisionTower

    return qwen_family(preset, (0.5,) * 3, (0.5,) * 3, VisionTower, tower_flops, WORKLOADS)


def measure_matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    times = time_fn(lambda: a @ b, runs=20, warmup=5)
    return 2 * 8192**3 / (statistics.median(times) * 1e-3) / 1e12


def time_fn(fn, runs: int, warmup: int = 10) -> list[float]:
    return cuda_times_ms(fn, runs, warmup)


def rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).abs().max() / b.abs().max()).item()


def norm_err(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def all_outputs(main, deepstack) -> list:
    return [main, *deepstack]


def bench_preset(preset: str, runs: int, budgets: list[int], matmul_tflops: float, profile: bool) -> dict:
    fam = family_for(preset)
    tower = fam.tower
    # As the service runs it: uint8 patch rows in, the processor's normalisation inside the graph.
    mgr = GraphManager(tower, GraphSettings(budgets=budgets, max_items_per_batch=16, max_frames_per_batch=32,
                                            uniform_capture_after=2, uint8_pixels=True))
    mgr.capture()
    result = {"preset": preset, "capture_s": mgr.capture_seconds, "graph_mem_mib": mgr.capture_bytes / 2**20,
              "budgets_kept": sorted(mgr.graphs), "autotune": mgr.autotune_table, "workloads": []}
    for name, grids in fam.workloads.items():
        g = torch.Generator(device="cuda").manual_seed(1)
        items = [VisionItem(torch.randint(0, 256, (t * h * w, tower.patch_dim), device="cuda", generator=g,
                                          dtype=torch.uint8), (t, h, w)) for t, h, w in grids]
        # The reference takes the processor's normalised rows (its normalisation runs on the CPU).
        pixels32 = torch.cat([it.pixels for it in items]).float() * tower.pixel_scale + tower.pixel_offset
        pixels = pixels32.to(torch.bfloat16)
        with torch.inference_mode():
            ours = mgr.encode(items)
            ours_all = all_outputs(torch.cat([o.main for o in ours]),
                                   [torch.cat([o.deepstack[j] for o in ours]) for j in range(len(ours[0].deepstack))])
            ref_all = fam.reference(pixels, grids)
            r32_all = fam.truth(pixels32, grids)
            err = max(rel_err(a, b) for a, b in zip(ours_all, ref_all))
            errs = {"ours_vs_ref_max": err,
                    "ours_vs_ref_norm": max(norm_err(a, b) for a, b in zip(ours_all, ref_all)),
                    "ours_vs_fp32_max": max(rel_err(a, b) for a, b in zip(ours_all, r32_all)),
                    "ref_vs_fp32_max": max(rel_err(a, b) for a, b in zip(ref_all, r32_all)),
                    "ours_vs_fp32_norm": max(norm_err(a, b) for a, b in zip(ours_all, r32_all)),
                    "ref_vs_fp32_norm": max(norm_err(a, b) for a, b in zip(ref_all, r32_all))}
            t_ref = time_fn(lambda px=pixels, g=grids: fam.reference(px, g), runs)
            t_eager = time_fn(lambda it=items: mgr.encode(it, force_eager=True), runs)
            # First sight of a shape: a budget graph (or eager where auto-tune says so). Its repeats
            # queue an equal-length shape for an exact-shape graph, captured when the replica idles.
            lay = mgr.tower.layout(grids)
            budget, _ = mgr.choose_budget(lay)
            before = mgr.stats.graph_hits
            t_first = time_fn(lambda it=items: mgr.encode(it), runs)
            first_graph = mgr.stats.graph_hits > before
            t_budget_replay = time_fn(mgr.graphs[budget].replay, runs) if first_graph else [float("nan")]
            mgr.capture_pending()
            before, uniform_before = mgr.stats.graph_hits, mgr.stats.uniform_hits
            t_graph = time_fn(lambda it=items: mgr.encode(it), runs)
            used_graph = mgr.stats.graph_hits > before
            uniform = mgr.stats.uniform_hits > uniform_before
            if uniform:
                t_replay = time_fn(mgr.uniform_graphs[lay.uniform].replay, runs)
            else:
                t_replay = t_budget_replay
            # Rows of our output vs the reference, on the path the timing measured.
            ours = mgr.encode(items)
            ours_all = all_outputs(torch.cat([o.main for o in ours]),
                                   [torch.cat([o.deepstack[j] for o in ours]) for j in range(len(ours[0].deepstack))])
            errs["ours_vs_fp32_max"] = max(errs["ours_vs_fp32_max"],
                                           max(rel_err(a, b) for a, b in zip(ours_all, r32_all)))
        flops = fam.flops(grids)
        row = {
            "workload": name, "tokens": sum(t * h * w for t, h, w in grids), "graph": used_graph,
            "uniform": uniform, "first_ms": statistics.median(t_first), "first_p99": p99(t_first),
            "first_graph": first_graph,
            "ref_ms": statistics.median(t_ref), "ref_p99": p99(t_ref),
            "eager_ms": statistics.median(t_eager), "eager_p99": p99(t_eager),
            "graph_ms": statistics.median(t_graph), "graph_p99": p99(t_graph),
            "floor_ms": flops / (matmul_tflops * 1e12) * 1e3, "gflop": flops / 1e9,
            "replay_ms": statistics.median(t_replay), "budget": budget, **errs,
        }
        row["speedup"] = row["ref_ms"] / row["graph_ms"]
        result["workloads"].append(row)
        print(f"{preset:12s} {name:30s} ref {row['ref_ms']:7.2f}  eager {row['eager_ms']:7.2f}  first "
              f"{row['first_ms']:7.2f}  {'uniform graph' if uniform else 'budget graph' if used_graph else 'eager'} "
              f"{row['graph_ms']:7.2f} (p99 {row['graph_p99']:6.2f})  floor {row['floor_ms']:6.2f}  "
              f"x{row['speedup']:5.1f}  replay {row['replay_ms']:.2f}  err {err:.1e} "
              f"(vs fp32: ours {errs['ours_vs_fp32_max']:.1e} ref {errs['ref_vs_fp32_max']:.1e}; norm ours "
              f"{errs['ours_vs_fp32_norm']:.1e} ref {errs['ref_vs_fp32_norm']:.1e})", flush=True)
        if profile and name in ("1x448^2", "1x1024^2"):
            result.setdefault("profiles", {})[name] = profile_graph(mgr, items)
    return result


def profile_graph(mgr, items) -> str:
    """Kernel-time table of one graph replay: where the time goes besides the GEMMs."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            mgr.encode(items, force_eager=True)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=18)


def markdown(results: list[dict], device: str, matmul_tflops: float) -> str:
    lines = [f"Device: {device}; bf16 matmul rate measured in this run: {matmul_tflops:.0f} TFLOP/s.", ""]
    for r in results:
        lines += [f"### {r['preset']} — capture {r['capture_s']:.2f} s, graph memory {r['graph_mem_mib']:.0f} MiB, "
                  f"budgets kept {r['budgets_kept']}", "",
                  "| workload | tokens | reference ms (p99) | our eager ms (p99) | first sight: budget graph ms (p99) "
                  "| ours ms (p99) | path | replay only ms | FLOP floor ms | ref / ours | err vs ref (max, norm) "
                  "| err vs fp32: ours / ref (max) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for w in r["workloads"]:
            path = "uniform graph" if w["uniform"] else (f"budget {w['budget']}" if w["graph"] else "eager")
            first = f"{w['first_ms']:.2f} ({w['first_p99']:.2f})" + ("" if w["first_graph"] else " eager")
            lines.append(f"| {w['workload']} | {w['tokens']} | {w['ref_ms']:.2f} ({w['ref_p99']:.2f}) | "
                         f"{w['eager_ms']:.2f} ({w['eager_p99']:.2f}) | {first} | "
                         f"**{w['graph_ms']:.2f}** ({w['graph_p99']:.2f}) | {path} | {w['replay_ms']:.2f} | "
                         f"{w['floor_ms']:.2f} | {w['speedup']:.1f}x | {w['ours_vs_ref_max']:.1e}, "
                         f"{w['ours_vs_ref_norm']:.1e} | {w['ours_vs_fp32_max']:.1e} / {w['ref_vs_fp32_max']:.1e} |")
        lines += ["", "Auto-tune (budget or uniform shape: eager ms / graph ms, kept):", ""]
        lines += [f"- {a.get('budget', a.get('uniform'))}: {a['eager_ms']} / {a['graph_ms']} "
                  f"{'kept' if a['kept'] else 'dropped'}" for a in r["autotune"]]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--presets", nargs="+", default=["qwen3-vl-8b", "qwen3-vl-2b"])
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--budgets", type=int, nargs="+", default=GraphSettings.power_of_two_budgets(256, 8192, 4))
    p.add_argument("--out", default="benchmarks/encoder_results.json")
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    tflops = measure_matmul_tflops()
    device = f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    t0 = time.time()
    results = [bench_preset(pr, a.runs, a.budgets, tflops, a.profile) for pr in a.presets]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"device": device, "matmul_tflops": tflops, "results": results}, indent=1))
    md = markdown(results, device, tflops)
    Path(a.out).with_suffix(".md").write_text(md)
    for r in results:
        for name, table in r.get("profiles", {}).items():
            print(f"\n--- {r['preset']} {name} eager kernel profile ---\n{table}")
    print(md)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
