"""The text model's fused elementwise kernels (app/llm/kernels.py) at serving shapes, against memory bandwidth.

Each kernel is memory-bound: what it must read and write sets a floor, and the column "of peak" says
how close a call gets to it (bytes moved / time, over the bandwidth measured by a device-to-device copy
in the same run). Token counts: 64 (a decode step), 1,600 (a scheduler step at 1024² serving load: a
1,074-token prompt and a half beside decodes) and 4,096.

`--baseline FILE` times the same calls through another copy of kernels.py (e.g. `git show
REV:app/llm/kernels.py > /tmp/old_kernels.py`), side by side in one run, and checks that both give the
same values. µs per call from a CUDA graph of 20 calls, median of 30 replays (benchmarks/tower_kernels.py).

    python3 benchmarks/llm_kernels.py [--baseline /tmp/old_kernels.py] [--out $OUT/llm_kernels.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from app.llm import kernels  # noqa: E402
from benchmarks.tower_kernels import graph_us  # noqa: E402

HIDDEN, HEADS, KV, D, INTER = 2048, 16, 8, 128, 6144  # the 2B text model
BF = torch.bfloat16


def copy_bandwidth() -> float:
    """Bytes per µs of a 256 MiB device-to-device copy (read + write), the practical floor's rate."""
    a = torch.empty(128 << 20, dtype=BF, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() * 2 / graph_us(lambda: b.copy_(a), inner=5)


def calls(mod, t: int, gen: torch.Generator) -> dict:
    """name -> (function running one call, bytes it must move, function returning its outputs)."""
    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).to(BF)

    res, x, w = rnd(t, HIDDEN), rnd(t, HIDDEN), rnd(HIDDEN)
    qkv, qn, kn = rnd(t, (HEADS + 2 * KV) * D), rnd(D), rnd(D)
    ang = torch.randn(t, D // 2, device="cuda", generator=gen) * 50
    cos, sin = ang.cos().to(BF), ang.sin().to(BF)
    slots = torch.randperm(t + 64, device="cuda", generator=gen)[:t].int()
    k_cache, v_cache = (torch.zeros(t + 64, KV, D, device="cuda", dtype=BF) for _ in range(2))
    gu = rnd(t, 2 * INTER)
    out = {}

    def norm():
        out["add_rmsnorm"] = mod.add_rmsnorm(res, x, w, 1e-6)[1]

    def qk():
        out["qk_norm_rope_store"] = mod.qk_norm_rope_store(qkv, qn, kn, cos, sin, k_cache, v_cache, slots, HEADS,
                                                           KV, 1e-6)

    def silu():
        out["silu_mul"] = mod.silu_mul(gu)

    e = 2  # bytes per bf16 element
    return {"add_rmsnorm": (norm, 4 * t * HIDDEN * e, lambda: out["add_rmsnorm"]),
            "qk_norm_rope_store": (qk, 2 * t * (HEADS + 2 * KV) * D * e + 2 * t * D * e,
                                   lambda: (out["qk_norm_rope_store"], k_cache[slots.long()], v_cache[slots.long()])),
            "silu_mul": (silu, 3 * t * INTER * e, lambda: out["silu_mul"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", help="another kernels.py to time beside this tree's")
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 1600, 4096])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    mods = {"ours": kernels}
    if a.baseline:
        spec = importlib.util.spec_from_file_location("baseline_kernels", a.baseline)
        mods["baseline"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mods["baseline"])
    bw = copy_bandwidth()
    rows = []
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e6:.2f} TB/s")
    print(f"{'kernel':<20}{'tokens':>7}" + "".join(f"{n + ' µs':>14}{'of peak':>9}" for n in mods) + "  same values")
    for t in a.tokens:
        per_mod = {n: calls(m, t, torch.Generator(device="cuda").manual_seed(t)) for n, m in mods.items()}
        for name in per_mod["ours"]:
            row = {"kernel": name, "tokens": t}
            for n, cs in per_mod.items():
                fn, nbytes, _ = cs[name]
                us = graph_us(fn)
                row[n] = {"us": us, "of_peak": round(nbytes / us / bw, 3)}
            if "baseline" in mods:
                got = [per_mod[n][name][2]() for n in mods]
                flat = [g if isinstance(g, tuple) else (g,) for g in got]
                row["same_values"] = all(torch.equal(p, q) for p, q in zip(*flat))
            rows.append(row)
            print(f"{name:<20}{t:>7}" + "".join(f"{row[n]['us']:>14.1f}{row[n]['of_peak']:>9.0%}" for n in mods)
                  + (f"  {row['same_values']}" if "same_values" in row else ""))
    result = {"device": torch.cuda.get_device_name(), "copy_bytes_per_us": round(bw), "rows": rows}
    out = Path(a.out or Path(os.environ.get("OUT", ".")) / "llm_kernels.json")
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
