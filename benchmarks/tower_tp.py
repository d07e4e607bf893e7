"""The vision tower in a tensor-parallel group of N ranks (issue 41): three ways, per case, the best kept.

- (a) one rank: rank 0 encodes every item, then broadcasts the embeddings and deepstack features;
- (b) data-parallel: items split over the ranks by patch tokens (app/vision/tensor_parallel.py's
  `balanced_shares`), rank 0 ships each rank its rows, each encodes its share, one all_gather (shares
  padded to the largest) and every rank cuts out every item in order;
- (c) TP-sharded: rank 0 broadcasts all rows, every rank runs its 1/N of each block's heads and MLP
  units (`ShardedVisionTower`: two all-reduces per block), every rank ends with the whole output.

Cases: one 448^2 image, one 1024^2 image, one 8-frame video of 224^2 frames (4 temporal groups of
14 x 14 patches), 8 x 448^2 images. The preset's real tower shape, random weights (the same on every
rank: broadcast from rank 0), bf16, one process per GPU over NCCL. Rows start as the media stage
sends them: raw uint8 on rank 0's host, normalised inside the tower. A run is timed from there to
"every rank holds every embedding on its device": a barrier, then per rank perf_counter around the
mode and a device synchronise; the run's time is the slowest rank's. Median and p99 over --runs after
--warmup. (a) and (b) run through the graph manager as serving does (CUDA graphs per budget and
exact-shape graphs, pinned staging from 2048 rows, dispatch by the auto-tune table) and eagerly; (c)
runs eagerly only (a graph per rank would need every rank's capture and dispatch in step). "one GPU"
is rank 0's encode alone, without the broadcast. Outputs are checked against (a)'s: max abs and max
relative difference (bf16: the sharded all-reduces sum rounded partial products).

    python benchmarks/tower_tp.py --preset qwen3-vl-8b --tp 2 --out $OUT/tower_tp2.json
    python benchmarks/tower_tp.py --preset qwen3-vl-2b --tp 4 --out $OUT/tower_tp4_2b.json

qwen3-vl-235b-a22b's tower has qwen3-vl-8b's shape. `--smoke` runs the tiny preset on the CPU in float32
over gloo with a few runs (wall clock; "graph" is the padded static path, nothing is captured): a check
that the script works, not a measurement.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.stats import p99  # noqa: E402

CASES = {
    "1x448^2": [(1, 28, 28)],
    "1x1024^2": [(1, 64, 64)],
    "video 224^2 x8f": [(4, 14, 14)],
    "8x448^2": [(1, 28, 28)] * 8,
}
GRAPH_BUDGETS = (256, 8192, 4)  # power_of_two_budgets(min, max, steps): the serving defaults
PINNED_MIN_ROWS = 2048  # encoder.pinned_copy_min_rows's default
TOLERANCE = {"cpu": 1e-4, "cuda": 3e-2}  # max relative difference against (a) that passes


def build_visual(preset: str, dtype: torch.dtype, device: torch.device):
    """The vision module a replica's tower runs on (our tree for Qwen3-VL), the preset's shape with random
    weights, identical on every rank."""
    import torch.distributed as dist
    from transformers import AutoConfig

    from app.checkpoints.model_builder import load_preset
    from app.vision.loading import vision_params

    cfg = AutoConfig.for_model(**load_preset(preset)).vision_config
    torch.manual_seed(0)
    visual = vision_params(cfg, dtype, device)
    with torch.no_grad():
        for t in [*visual.parameters(), *visual.buffers()]:
            dist.broadcast(t.data, src=0)
    return visual, cfg


class Rank:
    """One rank's towers, managers and the ways (a), (b), (c)."""

    def __init__(self, a, rank: int, size: int, device: torch.device, dtype: torch.dtype):
        from app.llm.parallel import TensorParallel
        from app.media.preprocess import PatchSpec
        from app.vision.graphs import GraphManager, GraphSettings
        from app.vision.staging import PinnedStaging
        from app.vision.tensor_parallel import OutputSpec, shard_tower
        from app.vision.tower import VisionTower

        self.rank, self.size, self.device = rank, size, device
        self.cuda = device.type == "cuda"
        self.tp = TensorParallel(rank, size)
        visual, cfg = build_visual(a.preset, dtype, device)
        norm = PatchSpec(patch=cfg.patch_size, temporal=cfg.temporal_patch_size, merge=cfg.spatial_merge_size,
                         mean=(0.5,) * 3, std=(0.5,) * 3).column_norm()
        shard_copy = copy.deepcopy(visual)  # before VisionTower re-lays the MLP weights out
        self.tower = VisionTower(visual, pixel_norm=norm)
        self.sharded = shard_tower(VisionTower(shard_copy, pixel_norm=norm), self.tp)
        self.spec = OutputSpec.of(self.tower)
        budgets = GraphSettings.power_of_two_budgets(*GRAPH_BUDGETS)
        self.mgr = GraphManager(self.tower, GraphSettings(
            budgets=budgets, max_items_per_batch=16, max_frames_per_batch=32, use_cuda_graphs=not a.no_graphs,
            uniform_capture_after=2, uint8_pixels=True, observe_dispatch=False, pinned_staging=self.cuda,
            pinned_min_rows=PINNED_MIN_ROWS))
        t0 = time.perf_counter()
        self.mgr.capture()  # per rank, no collectives inside: (b)'s ranks may dispatch differently
        self.capture_s = time.perf_counter() - t0
        self.sharded.tune_gemms(budgets)  # its MLP down projection's way per row count, as capture() does
        self.sharded_mgr = GraphManager(self.sharded, GraphSettings(
            budgets=[budgets[-1]], max_items_per_batch=16, max_frames_per_batch=32, use_cuda_graphs=False,
            autotune=False, uint8_pixels=True, observe_dispatch=False))
        patch_dim = self.tower.patch_dim
        self.staging = PinnedStaging(budgets[-1], patch_dim, torch.uint8, device, pin=self.cuda,
                                     min_rows=PINNED_MIN_ROWS) if self.cuda else None

    # ------------------------------------------------------------------ helpers
    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        """Every rank's device idle and every rank past one collective."""
        import torch.distributed as dist

        self.sync()
        dist.all_reduce(torch.zeros(1, device=self.device))
        self.sync()

    def to_device(self, parts: list[torch.Tensor]) -> torch.Tensor:
        if self.staging is not None:
            return self.staging.to_device(parts)
        return torch.cat(parts).to(self.device)

    def empty_rows(self, grids) -> torch.Tensor:
        """A receiving rank's buffer for the uint8 rows of items of these grids."""
        return torch.empty(sum(t * h * w for t, h, w in grids), self.tower.patch_dim, dtype=torch.uint8,
                           device=self.device)

    def items_from(self, rows: torch.Tensor, grids) -> list:
        from app.vision.graphs import VisionItem

        out, off = [], 0
        for t, h, w in grids:
            out.append(VisionItem(rows[off:off + t * h * w], (t, h, w)))
            off += t * h * w
        return out

    # ------------------------------------------------------------------ the ways
    def one_gpu(self, items, grids, eager: bool):
        """Rank 0's encode alone (what one GPU without a TP group pays)."""
        return self.mgr.encode(items, force_eager=eager) if self.rank == 0 else []

    def mode_a(self, items, grids, eager: bool):
        from app.vision.tensor_parallel import broadcast_outputs

        out = self.mgr.encode(items, force_eager=eager) if self.rank == 0 else None
        return broadcast_outputs(out, self.tower.layout(grids).out_rows, self.spec, self.tp)

    def mode_b(self, items, grids, eager: bool, shares):
        import torch.distributed as dist

        from app.vision.tensor_parallel import data_parallel_encode

        if self.rank == 0:
            for r in range(1, self.size):
                if shares[r]:
                    dist.send(self.to_device([items[i].pixels for i in shares[r]]), dst=r)
            mine = [items[i] for i in shares[0]]
        elif shares[self.rank]:
            mine_grids = [grids[i] for i in shares[self.rank]]
            rows = self.empty_rows(mine_grids)
            dist.recv(rows, src=0)
            mine = self.items_from(rows, mine_grids)
        else:
            mine = []
        return data_parallel_encode(lambda its: self.mgr.encode(its, force_eager=eager), mine, shares,
                                    self.tower.layout(grids).out_rows, self.spec, self.tp)

    def mode_c(self, items, grids):
        import torch.distributed as dist

        rows = self.to_device([it.pixels for it in items]) if self.rank == 0 else self.empty_rows(grids)
        dist.broadcast(rows, src=0)
        return self.sharded_mgr.encode(self.items_from(rows, grids), force_eager=True)

    def timed(self, fn, runs: int, warmup: int) -> list[float]:
        """ms per run: the slowest rank's, each run after a barrier."""
        import torch.distributed as dist

        for _ in range(warmup):
            fn()
        times = []
        for _ in range(runs):
            self.barrier()
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append((time.perf_counter() - t0) * 1e3)
        t = torch.tensor(times, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def differences(self, got, want) -> tuple[float, float]:
        """(max abs, max abs / max |want|) over every item's outputs, the largest over the ranks."""
        import torch.distributed as dist

        if self.rank == 0 or got:
            pairs = [(g, w) for ge, we in zip(got, want, strict=True)
                     for g, w in zip([ge.main, *ge.deepstack], [we.main, *we.deepstack], strict=True)]
            diff = max((g.float() - w.float()).abs().max().item() for g, w in pairs)
            scale = max(w.float().abs().max().item() for _, w in pairs)
        else:
            diff, scale = 0.0, 1.0
        t = torch.tensor([diff, diff / scale], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t[0].item(), t[1].item()


def bench_case(rk: Rank, name: str, grids, runs: int, warmup: int, graphs: bool) -> dict:
    from app.vision.graphs import VisionItem
    from app.vision.tensor_parallel import balanced_shares

    g = torch.Generator().manual_seed(1)
    # The rows on rank 0's host; the other ranks know only the grids (the lockstep tick carries them).
    items = [VisionItem(torch.randint(0, 256, (t * h * w, rk.tower.patch_dim), generator=g, dtype=torch.uint8),
                        (t, h, w)) for t, h, w in grids] if rk.rank == 0 else []
    shares = balanced_shares([t * h * w for t, h, w in grids], rk.size)
    labels = ("graph", False), ("eager", True)
    labels = labels if graphs else labels[1:]
    paths = {}
    for label, eager in labels:
        paths[f"a (one rank) {label}"] = lambda eager=eager: rk.mode_a(items, grids, eager)
    for label, eager in labels:
        paths[f"b (data-parallel) {label}"] = lambda eager=eager: rk.mode_b(items, grids, eager, shares)
    paths["c (tp-sharded) eager"] = lambda: rk.mode_c(items, grids)
    for label, eager in labels:
        paths[f"one GPU {label}"] = lambda eager=eager: rk.one_gpu(items, grids, eager)
    with torch.inference_mode():
        for fn in paths.values():  # warm-up; a repeated equal-length batch queues its exact-shape graph
            for _ in range(max(warmup, 2)):
                fn()
        rk.mgr.capture_pending()  # per rank, as an idle replica would
        ref_label = "a (one rank) graph" if graphs else "a (one rank) eager"
        ref = paths[ref_label]()
        rows = {}
        for label, fn in paths.items():
            times = rk.timed(fn, runs, warmup)
            row = {"median_ms": statistics.median(times), "p99_ms": p99(times)}
            if not label.startswith("one GPU"):
                row["max_abs_diff"], row["max_rel_diff"] = rk.differences(fn(), ref)
            rows[label] = row
    modes = {k: v for k, v in rows.items() if not k.startswith("one GPU")}
    best = min(modes, key=lambda k: modes[k]["median_ms"])
    tol = TOLERANCE[rk.device.type]
    return {"case": name, "grids": [list(x) for x in grids], "tokens": sum(t * h * w for t, h, w in grids),
            "shares_b": shares, "reference": ref_label, "paths": rows, "winner": best,
            "winner_ms": modes[best]["median_ms"],
            "outputs_match": all(v["max_rel_diff"] <= tol for v in modes.values()), "tolerance_rel": tol}


def worker(rank: int, a, address: str) -> None:
    import torch.distributed as dist

    cuda = not a.smoke
    if cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=f"tcp://{address}", rank=rank, world_size=a.tp,
                                device_id=device)
    else:
        torch.set_num_threads(max(1, a.threads))
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=a.tp)
    try:
        dtype = torch.bfloat16 if cuda else torch.float32
        rk = Rank(a, rank, a.tp, device, dtype)
        graphs = not a.no_graphs
        name = torch.cuda.get_device_name(device) if cuda else "CPU"
        result = {"device": f"{a.tp} x {name} (torch {torch.__version__})", "preset": a.preset, "tp": a.tp,
                  "dtype": str(dtype).removeprefix("torch."), "backend": "nccl" if cuda else "gloo",
                  "runs": a.runs, "warmup": a.warmup, "graphs_for_a_b": graphs and cuda,
                  "capture_s_rank0": rk.capture_s, "fused_body": rk.tower.fused,
                  "timing": "from uint8 rows on rank 0's host to every embedding on every rank's device; per "
                            "run the slowest rank's wall clock after a barrier",
                  "notes": ["(c) runs eagerly only; (a) and (b) also through the graph manager as served "
                            "(on the CPU its padded static path, nothing captured)",
                            "video: 8 frames of 224^2 = 4 temporal groups of 14 x 14 patches",
                            "differences are against the reference path's (a) outputs"],
                  "cases": []}
        out = Path(a.out)
        for case, grids in CASES.items():
            if a.cases and case not in a.cases:
                continue
            row = bench_case(rk, case, grids, a.runs, a.warmup, graphs)
            if rank == 0:
                print(f"{case:18s} " + "  ".join(f"{k} {v['median_ms']:.2f}" for k, v in row["paths"].items())
                      + f"  -> {row['winner']}", flush=True)
                # written after every case: a run cut short by its time limit keeps the cases it finished
                result["cases"].append(row)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(result, indent=1))
                out.with_suffix(".md").write_text(markdown(result))
        if rank == 0:
            print(markdown(result))
    finally:
        dist.destroy_process_group()


def markdown(r: dict) -> str:
    labels = list(r["cases"][0]["paths"]) if r["cases"] else []
    lines = [f"Device: {r['device']}; preset {r['preset']}, TP {r['tp']}, {r['dtype']}, {r['runs']} runs. "
             f"Median ms (p99); {r['timing']}.", "",
             "| case | tokens | " + " | ".join(labels) + " | winner | max rel diff vs (a): b / c |",
             "|---|---|" + "---|" * len(labels) + "---|---|"]
    for c in r["cases"]:
        p = c["paths"]
        b = max(v["max_rel_diff"] for k, v in p.items() if k.startswith("b "))
        cc = max(v["max_rel_diff"] for k, v in p.items() if k.startswith("c "))
        lines.append(f"| {c['case']} | {c['tokens']} | "
                     + " | ".join(f"{p[k]['median_ms']:.2f} ({p[k]['p99_ms']:.2f})" for k in labels)
                     + f" | **{c['winner']}** | {b:.1e} / {cc:.1e}{'' if c['outputs_match'] else ' **mismatch**'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default=None, help="default qwen3-vl-8b (smoke: tiny)")
    p.add_argument("--tp", type=int, default=2, help="ranks (GPUs)")
    p.add_argument("--runs", type=int, default=None, help="timed runs per path (default 50; smoke 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs first (default 5; smoke 1)")
    p.add_argument("--cases", nargs="+", default=None, choices=list(CASES), help="only these cases")
    p.add_argument("--no-graphs", action="store_true", help="(a) and (b) eagerly only")
    p.add_argument("--threads", type=int, default=1, help="smoke: CPU threads per rank")
    p.add_argument("--out", default="/tmp/tower_tp.json", help="JSON written here, the table beside it (.md)")
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, float32, tiny preset, few runs")
    a = p.parse_args(argv)
    if a.smoke:
        a.preset, a.runs, a.warmup = a.preset or "tiny", a.runs or 3, 1 if a.warmup is None else a.warmup
    else:
        if torch.cuda.device_count() < a.tp:
            sys.exit(f"needs {a.tp} CUDA devices (or --smoke)")
        a.preset, a.runs, a.warmup = a.preset or "qwen3-vl-8b", a.runs or 50, 5 if a.warmup is None else a.warmup
    from app.serving.tensor_parallel import free_address

    t0 = time.time()
    mp.spawn(worker, args=(a, free_address("127.0.0.1")), nprocs=a.tp, join=True)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    main()
