"""Fused MoE experts (app/llm/fused_moe.py) against transformers' per-expert loop, at Qwen3-VL-MoE shapes.

Both in bf16 on the same routed inputs: decode batches (1, 8, 64 tokens) and prefill (512, 2,048).
A decode step's experts are bound by memory: the floor is the weights of the experts actually hit,
read once, at `--bandwidth` (3.3 TB/s: an H100's HBM3), and "of floor" says how close the fused
call gets. Times are medians of `triton.testing.do_bench` (ms); for decode sizes also the fused
call replayed from a CUDA graph (as the engine's decode graphs run it). `--sweep` times a grid of
tile configs per token count beside `moe_config`'s pick.

Shapes: 30b (Qwen3-VL-30B-A3B: H 2048, I 768, 128 experts, top-8), 235b-tp4 (235B-A22B with I
split four ways: H 4096, I 384), 235b (unsplit, I 1536). `--smoke` runs tiny shapes on the CPU.

    python3 benchmarks/moe_kernel.py [--shape 30b] [--tokens 1 8 64 512 2048] [--sweep] [--out $OUT/moe_kernel.json]
    python3 benchmarks/moe_kernel.py --tokens 1 2 --direct-sweep --pdl    # the single-stream path, kernel by kernel
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from app.llm.fused_moe import (  # noqa: E402
    DIRECT_MAX_TOKENS,
    align_by_expert,
    fused_moe,
    moe_config,
    moe_reference,
)

SHAPES = {"30b": (2048, 768, 128, 8), "235b-tp4": (4096, 384, 128, 8), "235b": (4096, 1536, 128, 8),
          "smoke": (64, 48, 8, 2)}  # hidden, intermediate, experts, top-k


def expert_weights(hidden, inter, experts, dtype, device, seed=0):
    """Random weights in transformers' layout: w_gate_up [E, 2I, H], w_down [E, H, I]."""
    g = torch.Generator(device=device).manual_seed(seed)
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g, device=device) * hidden ** -0.5).to(dtype)
    w_down = (torch.randn(experts, hidden, inter, generator=g, device=device) * inter ** -0.5).to(dtype)
    return w_gate_up, w_down


def routed(hidden, experts, k, tokens, dtype, device, seed=0):
    """Inputs routed as Qwen3's router does: softmax, top-k, renormalised."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, device=device).to(dtype)
    probs = torch.randn(tokens, experts, generator=g, device=device).softmax(-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    return x, ids, (weights / weights.sum(-1, keepdim=True)).to(dtype)


def floor_bytes(ids, hidden, inter, experts, elem) -> int:
    """Weights of the experts hit, read once, plus x read and the output written."""
    hit = torch.unique(ids[(ids >= 0) & (ids < experts)]).numel()
    return hit * 3 * hidden * inter * elem + 2 * ids.shape[0] * hidden * elem


def time_ms(fn) -> float:
    if torch.cuda.is_available():
        import triton.testing

        return triton.testing.do_bench(fn, return_mode="median")
    fn()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graph_ms(fn) -> float:
    from app.gpu.kernel_timing import graph_us

    return graph_us(fn, inner=10) / 1e3


def sweep_configs(tokens: int):
    if tokens <= DIRECT_MAX_TOKENS:  # unsorted: each assignment alone, then the sum over k
        for vec, bn, bk in ((False, 16, 128), (True, 4, 256), (True, 8, 256), (True, 16, 256)):
            for dbn, dbk, dwarps in ((4, 256, 4), (8, 256, 4), (16, 256, 4), (4, 128, 2)):
                yield {"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 1, "num_warps": 4, "num_stages": 3,
                       "DIRECT": True, "VEC": vec, "DOWN_BLOCK_N": dbn, "DOWN_BLOCK_K": dbk, "DOWN_WARPS": dwarps}
        return
    for bm, bn, bk, warps, stages in itertools.product((16, 32, 64), (32, 64, 128), (64, 128), (4, 8), (3, 4)):
        if bm == 64 and bn == 128 and bk == 128:
            continue  # more shared memory than the stages leave room for
        yield {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 1 if bm == 16 else 8,
               "num_warps": warps, "num_stages": stages}


def direct_sweep(x, wgu, wd, ids, weights, floor: float) -> dict:
    """The few-token (DIRECT, VEC) path swept wider than `sweep_configs`, one kernel at a time, as the model
    calls it (the k rows left unsummed: `sum_k=False`): first the gate/up kernel's tile, warps and stages
    with the down kernel at `moe_config`'s, then the down kernel's with the best gate/up. Then the best and
    `moe_config`'s pick timed again in alternation (A B A B), so that the gain is read in one process."""
    t, hidden = x.shape
    base = moe_config(t, ids.shape[1], wgu.shape[0], hidden, wd.shape[2])

    def time_cfg(c):
        return graph_ms(lambda: fused_moe(x, wgu, wd, ids, weights, config=c, sum_k=False))

    def phase(candidates):
        rows = []
        for c in candidates:
            try:
                rows.append({"config": c, "ms": time_cfg(c)})
            except Exception as e:  # a tile the GPU cannot hold
                print(f"  skip {c}: {type(e).__name__}")
        return sorted(rows, key=lambda r: r["ms"])

    gate_up = phase({**base, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": st,
                     "DOWN_STAGES": base.get("DOWN_STAGES", base["num_stages"])}
                    for bn, bk, w, st in itertools.product((2, 4, 8), (256, 512, 1024), (2, 4, 8), (1, 3)))
    best = gate_up[0]["config"]
    down = phase({**best, "DOWN_BLOCK_N": bn, "DOWN_BLOCK_K": bk, "DOWN_WARPS": w, "DOWN_STAGES": st}
                 for bn, bk, w, st in itertools.product((2, 4, 8, 16), (256, 512, 1024), (2, 4, 8), (1, 3)))
    best = down[0]["config"]
    again = {"base": [], "best": []}
    for _ in range(2):
        again["base"].append(time_cfg(base))
        again["best"].append(time_cfg(best))
    out = {"base": base, "best": best, "base_ms": statistics.median(again["base"]),
           "best_ms": statistics.median(again["best"]), "alternated_ms": again, "floor_ms": floor,
           "gate_up_phase": gate_up[:8], "down_phase": down[:8]}
    out["speedup"] = out["base_ms"] / out["best_ms"]
    out["best_of_floor"] = floor / out["best_ms"]
    return out


def measure(x, wgu, wd, ids, weights, bandwidth: float, cuda: bool, sweep: bool, wide: bool = False) -> dict:
    """One token count: the loop and the fused call timed, the fused output against the float32 loop."""
    t, hidden = x.shape
    experts, inter, k = wgu.shape[0], wd.shape[2], ids.shape[1]
    cfg = moe_config(t, k, experts, hidden, inter)
    want = moe_reference(x.float(), wgu.float(), wd.float(), ids, weights.float())
    got = fused_moe(x, wgu, wd, ids, weights)
    if not cuda:
        align_by_expert(ids, experts, cfg["BLOCK_M"])  # the GPU path's first step runs on the CPU too

    def fused(c=None):
        return fused_moe(x, wgu, wd, ids, weights, config=c)

    row = {"tokens": t, "experts_hit": int(torch.unique(ids).numel()), "config": cfg,
           "rel_err": ((got.float() - want).norm() / want.norm()).item(),
           "loop_ms": time_ms(lambda: moe_reference(x, wgu, wd, ids, weights)),
           "fused_ms": time_ms(fused),
           "floor_ms": floor_bytes(ids, hidden, inter, experts, x.element_size()) / (bandwidth * 1e9)}
    row["speedup"] = row["loop_ms"] / row["fused_ms"]
    row["graph_ms"] = graph_ms(fused) if cuda else None
    row["of_floor"] = row["floor_ms"] / (row["graph_ms"] or row["fused_ms"])
    if sweep and cuda:
        swept = []
        for c in sweep_configs(t):
            try:
                swept.append({"config": c, "ms": graph_ms(lambda c=c: fused(c))})
            except Exception as e:  # a config the GPU cannot hold (shared memory)
                print(f"  skip {c}: {type(e).__name__}")
        row["sweep"] = sorted(swept, key=lambda s: s["ms"])
    if wide and cuda and t <= DIRECT_MAX_TOKENS:
        row["direct_sweep"] = direct_sweep(x, wgu, wd, ids, weights, row["floor_ms"])
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=[s for s in SHAPES if s != "smoke"], default="30b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 2048])
    ap.add_argument("--bandwidth", type=float, default=3.3, help="TB/s for the bytes-moved floor")
    ap.add_argument("--sweep", action="store_true", help="time a grid of tile configs per token count")
    ap.add_argument("--direct-sweep", action="store_true",
                    help="for 1-2 tokens: the matrix-vector path's kernels swept one at a time, wider than --sweep")
    ap.add_argument("--pdl", action="store_true", help="programmatic dependent launch on, as the engine runs it")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks that this runs)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.smoke
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    if a.pdl:
        from app.llm import pdl

        print("programmatic dependent launch:", pdl.enable(True, torch.device(device)))
    shape = "smoke" if a.smoke else a.shape
    hidden, inter, experts, k = SHAPES[shape]
    tokens = [1, 8, 64] if a.smoke else a.tokens
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"device {name}, shape {shape}: hidden {hidden}, intermediate {inter}, {experts} experts, top-{k}, "
          f"{dtype}, floor at {a.bandwidth} TB/s")
    print(f"{'tokens':>7}{'experts hit':>12}{'loop ms':>10}{'fused ms':>10}{'speedup':>9}{'graph ms':>10}"
          f"{'floor ms':>10}{'of floor':>10}{'rel err':>10}  config")
    wgu, wd = expert_weights(hidden, inter, experts, dtype, device)
    rows = []
    for t in tokens:
        x, ids, weights = routed(hidden, experts, k, t, dtype, device, seed=t)
        row = measure(x, wgu, wd, ids, weights, a.bandwidth, cuda, a.sweep, a.direct_sweep)
        rows.append(row)
        graph = f"{row['graph_ms']:>10.3f}" if row["graph_ms"] is not None else f"{'-':>10}"
        print(f"{t:>7}{row['experts_hit']:>12}{row['loop_ms']:>10.3f}{row['fused_ms']:>10.3f}{row['speedup']:>8.1f}x"
              f"{graph}{row['floor_ms']:>10.4f}{row['of_floor']:>10.0%}{row['rel_err']:>10.1e}  "
              + " ".join(f"{key}={v}" for key, v in row["config"].items()))
        for s in row.get("sweep", [])[:5]:
            print(f"{'':>17}sweep {s['ms']:.3f} ms  " + " ".join(f"{key}={v}" for key, v in s["config"].items()))
        if "direct_sweep" in row:
            d = row["direct_sweep"]
            print(f"{'':>17}direct sweep: best {d['best_ms']:.4f} ms against {d['base_ms']:.4f} ({d['speedup']:.3f}x, "
                  f"{d['best_of_floor']:.0%} of floor)  " + " ".join(f"{key}={v}" for key, v in d["best"].items()))
            for name in ("gate_up_phase", "down_phase"):
                for r in d[name][:3]:
                    print(f"{'':>19}{name} {r['ms']:.4f} ms  " + " ".join(f"{key}={v}" for key, v in r["config"].items()))
    result = {"device": name, "shape": shape, "dims": {"hidden": hidden, "inter": inter, "experts": experts, "k": k},
              "dtype": str(dtype), "bandwidth_tb_s": a.bandwidth, "rows": rows}
    out = Path(a.out or Path(os.environ.get("OUT", ".")) / "moe_kernel.json")
    out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
