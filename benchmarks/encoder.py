"""Vision encoder benchmark: reference eager vs our eager tower vs our graphs, per model family.

Families, presets and references are in benchmarks/encoder_families.py (Qwen3-VL, Qwen2.5-VL, MiniCPM-V
4.5; real config shapes, random weights, bf16 on a GPU). Every workload is timed side by side in one
process, with CUDA events (median and p99 over --runs after warm-up):

- reference: the family's reference forward on the processor's normalised rows;
- our eager: our tower without graphs (`encode(force_eager=True)`);
- first sight: what the graph manager does the first times it sees the batch's shape (the smallest
  budget graph it kept, padded, or eager where the auto-tune says eager wins);
- ours: what it does once the shape has an exact-shape graph (equal-length batches) or else its budget
  graph or eager, as dispatch decides.

Rows go in as the service sends them: raw uint8, normalised inside the tower. Outputs are checked
against the reference and the float32 truth. The auto-tune drops graphs that are not faster than eager;
`ours / eager` and `slower_than_eager` per workload check that "ours" is never the slower path.

    python benchmarks/encoder.py --presets qwen2.5-vl-7b minicpm-v-4.5 --out $OUT/encoder_towers.json

`--smoke` runs the tiny presets on the CPU in float32 with a few runs (wall-clock timing; "graph"
means the padded static-shape path there, nothing is captured): a check that the script works, not a
measurement.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.gpu.kernel_timing import cuda_times_ms  # noqa: E402
from app.vision.graphs import GraphManager, GraphSettings, VisionItem  # noqa: E402
from benchmarks.encoder_families import family_for  # noqa: E402
from benchmarks.stats import p99  # noqa: E402

SMOKE_PRESETS = ["tiny", "tiny-qwen2.5-vl", "tiny-minicpm-v-4.5"]
SCOREBOARD_KEYS = {"qwen2_5_vl": "encoder_qwen25vl_448_speedup", "minicpmv": "encoder_minicpmv_448_speedup"}
SLOWER_SLACK = 0.05  # "ours" above eager by more than this fraction counts as slower (run-to-run noise)


def time_fn(fn, runs: int, warmup: int, cuda: bool) -> list[float]:
    """ms per call: CUDA events on a GPU, wall clock on the CPU."""
    if cuda:
        return cuda_times_ms(fn, runs, warmup)
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def measure_matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    times = cuda_times_ms(lambda: a @ b, 20, 5)
    return 2 * 8192**3 / (statistics.median(times) * 1e-3) / 1e12


def rel_err(a, b) -> float:
    """max |a - b| / max |b| (inf when a is not finite)."""
    a, b = a.float(), b.float()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).abs().max() / b.abs().max()).item()


def norm_err(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def concat(out) -> list[torch.Tensor]:
    """Our per-item embeddings as the reference returns them: [main, *extras], rows in item order."""
    return [torch.cat([o.main for o in out])] + [torch.cat([o.deepstack[j] for o in out])
                                                 for j in range(len(out[0].deepstack))]


def errors(ours, ref, truth) -> dict:
    pairs = {"ours_vs_ref": (ours, ref), "ours_vs_fp32": (ours, truth), "ref_vs_fp32": (ref, truth)}
    out = {}
    for name, (a, b) in pairs.items():
        out[f"{name}_max"] = max(rel_err(x, y) for x, y in zip(a, b, strict=True))
        out[f"{name}_norm"] = max(norm_err(x, y) for x, y in zip(a, b, strict=True))
    return out


def path_taken(mgr: GraphManager, fn) -> str:
    """Run `fn` once and say which path the manager took: uniform graph, budget graph or eager (reason)."""
    st = mgr.stats
    uniform, hits, reasons = st.uniform_hits, st.graph_hits, dict(st.eager_reasons)
    fn()
    if st.uniform_hits > uniform:
        return "uniform graph"
    if st.graph_hits > hits:
        return "budget graph"
    new = [r for r, n in st.eager_reasons.items() if n > reasons.get(r, 0)]
    return f"eager ({new[0]})" if new else "eager"


def bench_workload(fam, mgr: GraphManager, name: str, grids, runs: int, warmup: int, tflops: float | None) -> dict:
    tower, dev = fam.tower, mgr.device
    cuda = dev.type == "cuda"
    g = torch.Generator(device=dev).manual_seed(1)
    items = [VisionItem(torch.randint(0, 256, (t * h * w, tower.patch_dim), device=dev, generator=g,
                                      dtype=torch.uint8), (t, h, w)) for t, h, w in grids]
    # The reference takes the processor's normalised rows (its normalisation runs on the CPU).
    pixels32 = torch.cat([it.pixels for it in items]).float() * tower.pixel_scale + tower.pixel_offset
    pixels = pixels32.to(tower.dtype)
    with torch.inference_mode():
        ref, truth = fam.reference(pixels, grids), fam.truth(pixels32, grids)
        lay = tower.layout(grids)
        budget, _ = mgr.choose_budget(lay)
        first_path = path_taken(mgr, lambda: mgr.encode(items))
        errs = errors(concat(mgr.encode(items)), ref, truth)
        t_ref = time_fn(lambda: fam.reference(pixels, grids), runs, warmup, cuda)
        extra_refs = {}
        for label, other in fam.extra_references.items():
            t_other = time_fn(lambda other=other: other(pixels, grids), runs, warmup, cuda)
            extra_refs[label] = {"ms": statistics.median(t_other), "p99": p99(t_other),
                                 "vs_fp32_max": errors(other(pixels, grids), ref, truth)["ours_vs_fp32_max"]}
        t_eager = time_fn(lambda: mgr.encode(items, force_eager=True), runs, warmup, cuda)
        eager_errs = errors(concat(mgr.encode(items, force_eager=True)), ref, truth)
        t_first = time_fn(lambda: mgr.encode(items), runs, warmup, cuda)
        # Its repeats queued an equal-length shape for an exact-shape graph: capture it (when the
        # replica idles, in serving), then time what serving would do from now on.
        mgr.capture_pending()
        path = path_taken(mgr, lambda: mgr.encode(items))
        t_ours = time_fn(lambda: mgr.encode(items), runs, warmup, cuda)
        errs_after = errors(concat(mgr.encode(items)), ref, truth)  # rows of the path just timed
        replay = None
        if mgr.capture_enabled and path == "uniform graph":
            replay = statistics.median(time_fn(mgr.uniform_graphs[lay.uniform].replay, runs, warmup, cuda))
        elif mgr.capture_enabled and path == "budget graph":
            replay = statistics.median(time_fn(mgr.graphs[budget].replay, runs, warmup, cuda))
    for k in ("ours_vs_ref_max", "ours_vs_ref_norm", "ours_vs_fp32_max", "ours_vs_fp32_norm"):
        errs[k] = max(errs[k], errs_after[k])
    errs["eager_vs_ref_max"], errs["eager_vs_fp32_max"] = eager_errs["ours_vs_ref_max"], eager_errs["ours_vs_fp32_max"]
    flops = fam.flops(grids)
    row = {"workload": name, "grids": [list(x) for x in grids], "tokens": lay.num_tokens, "budget": budget,
           "first_path": first_path, "path": path,
           "ref_ms": statistics.median(t_ref), "ref_p99": p99(t_ref),
           "eager_ms": statistics.median(t_eager), "eager_p99": p99(t_eager),
           "first_ms": statistics.median(t_first), "first_p99": p99(t_first),
           "ours_ms": statistics.median(t_ours), "ours_p99": p99(t_ours), "replay_ms": replay,
           "gflop": flops / 1e9, "floor_ms": flops / (tflops * 1e12) * 1e3 if tflops else None, **errs}
    row["ref_over_ours"] = row["ref_ms"] / row["ours_ms"]
    for other in extra_refs.values():
        other["over_ours"] = other["ms"] / row["ours_ms"]
    row["extra_refs"] = extra_refs
    row["ref_over_eager"] = row["ref_ms"] / row["eager_ms"]
    row["ours_over_eager"] = row["ours_ms"] / row["eager_ms"]
    row["first_over_eager"] = row["first_ms"] / row["eager_ms"]
    row["slower_than_eager"] = max(row["ours_over_eager"], row["first_over_eager"]) > 1 + SLOWER_SLACK
    return row


def bench_preset(preset: str, runs: int, warmup: int, budgets: list[int], device: str, tflops: float | None,
                 profile: bool, patterns: list[str] | None = None, dense_attention: str = "sdpa",
                 observe_dispatch: bool = True) -> dict:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    fam = family_for(preset, dtype, device)
    fam.tower.use_dense_attention(dense_attention)  # as the service does (encoder.dense_attention)
    # As the service runs it: uint8 patch rows in, the processor's normalisation inside the graph.
    mgr = GraphManager(fam.tower, GraphSettings(budgets=budgets, max_items_per_batch=16, max_frames_per_batch=32,
                                                uniform_capture_after=2, uint8_pixels=True,
                                                observe_dispatch=observe_dispatch))
    mgr.capture()
    result = {"preset": preset, "family": fam.name, "observe_dispatch": observe_dispatch, "dtype": str(dtype).removeprefix("torch."),
              "dense_attention": "flash4" if fam.tower.flash4 else "sdpa",
              "capture_s": mgr.capture_seconds, "graph_mem_mib": mgr.capture_bytes / 2**20,
              "budgets_kept": sorted(mgr.graphs), "budgets_dropped": sorted(set(mgr.budgets) - set(mgr.graphs))
              if mgr.capture_enabled else [], "workloads": []}
    for name, grids in fam.workloads.items():
        if patterns and not any(fnmatch.fnmatchcase(name, pat) for pat in patterns):
            continue
        row = bench_workload(fam, mgr, name, grids, runs, warmup, tflops)
        result["workloads"].append(row)
        print(f"{preset:18s} {name:32s} ref {row['ref_ms']:8.2f}  eager {row['eager_ms']:8.2f}  first "
              f"{row['first_ms']:8.2f}  ours {row['ours_ms']:8.2f} (p99 {row['ours_p99']:7.2f}, {row['path']})  "
              f"ref/ours x{row['ref_over_ours']:5.2f}  ours/eager {row['ours_over_eager']:4.2f}  "
              f"err vs ref {row['ours_vs_ref_max']:.1e}", flush=True)
        if profile and device == "cuda":  # every selected workload (--workloads narrows it)
            profiles = result.setdefault("profiles", {})
            profiles[f"{name} eager"] = profile_kernels(mgr, grids, force_eager=True)
            profiles[f"{name} ours ({row['path']})"] = profile_kernels(mgr, grids, force_eager=False)
    result["autotune"] = mgr.autotune_table  # budgets at capture, then the uniform shapes captured above
    if mgr.observed is not None:  # what dispatch learned from the batches above (app/vision/observed.py)
        result["dispatch_observed"] = mgr.observed.summary()
        result["explored_batches"] = mgr.observed.explored
    if fam.tower.down is not None:  # the MLP down projection's way per token count, and the timings (µs)
        result["down_projection"] = {"choice": fam.tower.down.choice, "us": fam.tower.down.timings}
    del mgr, fam
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def profile_kernels(mgr, grids, force_eager: bool) -> str:
    """Kernel-time table of our eager forward, or of the path the manager takes now (a graph's kernels
    are listed one by one too): where the time goes besides the GEMMs."""
    from torch.profiler import ProfilerActivity, profile

    items = [VisionItem(torch.randint(0, 256, (t * h * w, mgr.tower.patch_dim), dtype=torch.uint8,
                                      device=mgr.device), (t, h, w)) for t, h, w in grids]
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            mgr.encode(items, force_eager=force_eager)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)


def _ms(v, p=None) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if p is None else f"{v:.2f} ({p:.2f})"


def markdown(results: list[dict], device: str, tflops: float | None) -> str:
    rate = f"bf16 matmul rate measured in this run: {tflops:.0f} TFLOP/s" if tflops else "no GPU: smoke run"
    lines = [f"Device: {device}; {rate}.", ""]
    for r in results:
        lines += [f"### {r['preset']} ({r['family']}, {r['dtype']}) — capture {r['capture_s']:.2f} s, graph memory "
                  f"{r['graph_mem_mib']:.0f} MiB, budgets kept {r['budgets_kept']}, dropped {r['budgets_dropped']}"
                  f"{'' if r.get('observe_dispatch', True) else ', observed dispatch off'}", "",
                  "| workload | tokens | reference ms (p99) | our eager ms (p99) | first sight ms (p99) | ours ms (p99) "
                  "| path | replay only ms | FLOP floor ms | ref / ours | ours / eager | err vs ref (max, norm) "
                  "| err vs fp32: ours / ref (max) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for w in r["workloads"]:
            flag = " **slower**" if w["slower_than_eager"] else ""
            lines.append(f"| {w['workload']} | {w['tokens']} | {_ms(w['ref_ms'], w['ref_p99'])} | "
                         f"{_ms(w['eager_ms'], w['eager_p99'])} | {_ms(w['first_ms'], w['first_p99'])} "
                         f"{w['first_path']} | **{_ms(w['ours_ms'])}** ({w['ours_p99']:.2f}) | {w['path']} | "
                         f"{_ms(w['replay_ms'])} | {_ms(w['floor_ms'])} | {w['ref_over_ours']:.2f}x | "
                         f"{w['ours_over_eager']:.2f}{flag} | {w['ours_vs_ref_max']:.1e}, {w['ours_vs_ref_norm']:.1e} | "
                         f"{w['ours_vs_fp32_max']:.1e} / {w['ref_vs_fp32_max']:.1e} |")
        others = [(w["workload"], label, o) for w in r["workloads"] for label, o in w.get("extra_refs", {}).items()]
        if others:
            lines += ["", "Other reference paths (the ratio above uses the reference column):", ""]
            lines += [f"- {name}, {label}: {_ms(o['ms'], o['p99'])} ms, ref / ours {o['over_ours']:.2f}x, "
                      f"err vs fp32 (max) {o['vs_fp32_max']:.1e}" for name, label, o in others]
        if r["autotune"]:
            lines += ["", "Auto-tune (budget or uniform shape: eager ms / graph ms, kept):", ""]
            lines += [f"- {a.get('budget', a.get('uniform'))}: {a['eager_ms']} / {a['graph_ms']} "
                      f"{'kept' if a['kept'] else 'dropped'}" for a in r["autotune"]]
        lines.append("")
    return "\n".join(lines)


def update_scoreboard(path: Path, results: list[dict]) -> dict:
    """The issue's figures: reference / ours at one 448^2 image, per new family, merged into `path`."""
    board = json.loads(path.read_text()) if path.is_file() else {}
    for r in results:
        key = SCOREBOARD_KEYS.get(r["family"])
        row = next((w for w in r["workloads"] if w["workload"] == "1x448^2"), None)
        if key and row:
            board[key] = round(row["ref_over_ours"], 2)
    path.write_text(json.dumps(board, indent=1, sort_keys=True) + "\n")
    return board


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=None,
                   help="default: qwen3-vl-8b qwen3-vl-2b (with --smoke: the tiny preset of each family)")
    p.add_argument("--runs", type=int, default=None, help="timed runs per column (default 100; smoke 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs first (default 10; smoke 1)")
    p.add_argument("--budgets", type=int, nargs="+", default=GraphSettings.power_of_two_budgets(256, 8192, 4))
    p.add_argument("--out", default="benchmarks/encoder_results.json",
                   help="JSON written here, the table beside it (.md)")
    p.add_argument("--scoreboard", type=Path, default=None, help="merge the 448^2 speedups into this JSON")
    p.add_argument("--workloads", nargs="+", default=None, help="only workloads matching these glob patterns")
    p.add_argument("--smoke", action="store_true", help="CPU, float32, tiny presets, few runs")
    p.add_argument("--profile", action="store_true", help="a CUDA kernel table per selected workload, eager and ours")
    p.add_argument("--dense-attention", default="sdpa", choices=["sdpa", "flash4"],
                   help="encoder.dense_attention: the kernel of equal-length attention (app/vision/flash4.py)")
    p.add_argument("--no-observe-dispatch", action="store_true",
                   help="encoder.observe_dispatch off: dispatch by the auto-tune table and eager_margin alone")
    a = p.parse_args(argv)
    if a.smoke:
        device, presets, runs, warmup = "cpu", a.presets or SMOKE_PRESETS, a.runs or 3, 1 if a.warmup is None else a.warmup
        tflops, name = None, f"CPU (torch {torch.__version__})"
    else:
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA device (or --smoke)")
        device, presets, runs = "cuda", a.presets or ["qwen3-vl-8b", "qwen3-vl-2b"], a.runs or 100
        warmup = 10 if a.warmup is None else a.warmup
        tflops, name = measure_matmul_tflops(), f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    t0 = time.time()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    for pr in presets:  # files rewritten after each preset: a run cut short keeps what it measured
        results.append(bench_preset(pr, runs, warmup, a.budgets, device, tflops, a.profile, a.workloads,
                                    a.dense_attention, not a.no_observe_dispatch))
        out.write_text(json.dumps({"device": name, "matmul_tflops": tflops, "runs": runs, "results": results},
                                  indent=1))
        md = markdown(results, name, tflops)
        out.with_suffix(".md").write_text(md)
    if a.scoreboard and device == "cuda":
        print("scoreboard:", update_scoreboard(a.scoreboard, results))
    for r in results:
        for wl, table in r.get("profiles", {}).items():
            print(f"\n--- {r['preset']} {wl} kernel profile ---\n{table}")
    print(md)
    slower = [f"{r['preset']} {w['workload']}" for r in results for w in r["workloads"] if w["slower_than_eager"]]
    print(f"slower than our eager (> {SLOWER_SLACK:.0%}): {', '.join(slower) or 'none'}")
    print(f"total {time.time() - t0:.0f} s")
    return results


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the graph manager's capture and auto-tune logs
    main()
