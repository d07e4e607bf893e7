"""The LLM's paged attention at serving shapes: our Triton kernel's configurations against FlashAttention-2.

A 1024² image is a 1074-token prompt for the 2B shape (16 query heads, 8 KV heads, head 128, 28
layers), and at 16 output tokens its prefill is most of the engine's attention time. This script
times one layer's attention, as the engine calls it, for:

- `prefill 1x1074`, `prefill 2x1074`: whole prompts (no cached prefix);
- `chunk 900+174`: the rest of a prompt whose first 900 tokens are in the cache (a chunked prefill);
- `decode 32x1090`, `decode 128x1090`: one token each, as the decode graphs run them (16 rows a program);
- `mixed 32 decodes + 1x1074`: a step of the scheduler under load (decodes beside a new prompt), with
  the prefill program size.

Each case runs our kernel over a sweep of (rows per program, keys per tile, warps, stages, causal
split), and FlashAttention-2 (`aten._flash_attention_forward`, causal, GQA) on contiguous K/V as the
reference where the case is whole prompts. µs per call from a CUDA graph of 20 calls, median of 30
replays; TFLOP/s counts the causal half. Error against per-sequence fp32 SDPA.

    python3 benchmarks/llm_attention.py [--out $OUT/llm_attention.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from app.llm.attention import (  # noqa: E402
    AttentionMetadata,
    block_q_for,
    paged_attention,
    paged_attention_torch,
    work_table,
)
from benchmarks.tower_kernels import graph_us  # noqa: E402

HEADS, KV, D, PAGE = 16, 8, 128, 16
CASES = {  # name: (keys per sequence after the step, new queries per sequence)
    "prefill 1x1074": ([1074], [1074]),
    "prefill 2x1074": ([1074, 1074], [1074, 1074]),
    "chunk 900+174": ([1074], [174]),
    "decode 8x1090": ([1090] * 8, [1] * 8),
    "decode 32x1090": ([1090] * 32, [1] * 32),
    "decode 64x1090": ([1090] * 64, [1] * 64),
    "decode 128x1090": ([1090] * 128, [1] * 128),
    "decode 256x1090": ([1090] * 256, [1] * 256),
    "decode 32x4000": ([4000] * 32, [1] * 32),
    "mixed 32 decodes + 1x1074": ([1090] * 32 + [1074], [1] * 32 + [1074]),
}


def build(lens: list[int], qlens: list[int], block_m: int, gen: torch.Generator):
    nblocks = sum(-(-n // PAGE) for n in lens) + 1
    k_cache = torch.randn(nblocks * PAGE, KV, D, device="cuda", generator=gen).bfloat16()
    v_cache = torch.randn(nblocks * PAGE, KV, D, device="cuda", generator=gen).bfloat16()
    perm = (torch.randperm(nblocks - 1, generator=torch.Generator().manual_seed(0)) + 1).tolist()
    tables, i = [], 0
    for n in lens:
        need = -(-n // PAGE)
        tables.append(perm[i:i + need])
        i += need
    width = max(len(t) for t in tables)
    bt = torch.zeros(len(lens) + 1, width, dtype=torch.int32, device="cuda")
    for r, t in enumerate(tables):
        bt[r, :len(t)] = torch.tensor(t)
    qlens_np = np.array(qlens, dtype=np.int32)
    q = torch.randn(int(qlens_np.sum()), HEADS, D, device="cuda", generator=gen).bfloat16()
    qstart = np.concatenate([[0], np.cumsum(qlens_np)]).astype(np.int32)
    bq = block_q_for(HEADS // KV, block_m)
    ws, w0 = work_table(qlens_np, bq)
    t = {k: torch.tensor(v, dtype=torch.int32, device="cuda") for k, v in
         {"qs": qstart, "lens": lens, "rows": np.arange(len(lens)), "ws": ws, "w0": w0}.items()}
    meta = AttentionMetadata(t["qs"], t["lens"], t["rows"], bt, t["ws"], t["w0"], bq, PAGE, host_query_start=qstart,
                             host_seq_lens=np.array(lens), host_block_tables=tables)
    return q, k_cache, v_cache, meta


def causal_flops(lens: list[int], qlens: list[int]) -> float:
    # each query i of a sequence sees ctx + i + 1 keys: QK^T and PV, 2 FLOPs per multiply-add
    total = 0
    for n, qn in zip(lens, qlens):
        ctx = n - qn
        total += sum(ctx + i + 1 for i in range(qn))
    return 4.0 * total * HEADS * D


def flash_reference(q, k_cache, v_cache, meta, lens):
    """FlashAttention-2 varlen, causal, on K/V gathered into contiguous rows (whole prompts only)."""
    idx = torch.cat([(torch.tensor(t, device="cuda")[:, None] * PAGE + torch.arange(PAGE, device="cuda")).flatten()[:n]
                     for t, n in zip(meta.host_block_tables, lens)])
    k, v = k_cache[idx].contiguous(), v_cache[idx].contiguous()
    cu = meta.query_start
    m = max(lens)

    def run():
        return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, m, m, 0.0, True, False, scale=D ** -0.5)[0]
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="llm_attention.json")
    ap.add_argument("--cases", nargs="*", default=None, help="substrings of the case names to run (default: all)")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": {}}
    sweep = list(itertools.product([16, 64, 128], [32, 64, 128], [4, 8], [2, 3], [False, True]))
    for c, (name, (lens, qlens)) in enumerate(CASES.items()):
        if args.cases and not any(x in name for x in args.cases):
            continue
        flops = causal_flops(lens, qlens)
        rows, want = {}, None
        decode = all(n == 1 for n in qlens)
        for block_m, block_n, warps, stages, split in sweep:
            if decode != (block_m == 16):  # decodes take 16-row programs (one query x the GQA group)
                continue
            gen.manual_seed(c)  # the same inputs for every configuration
            q, kc, vc, meta = build(lens, qlens, block_m, gen)
            key = f"m{block_m} n{block_n} w{warps} s{stages} {'split' if split else 'masked'}"
            try:
                def fn(q=q, kc=kc, vc=vc, meta=meta, bn=block_n, w=warps, st=stages, sp=split):
                    return paged_attention(q, kc, vc, meta, D ** -0.5, block_n=bn, num_warps=w, num_stages=st,
                                           split=sp)
                got = fn()
                us = graph_us(fn)
            except Exception as e:  # noqa: BLE001 - a config the compiler rejects (shared memory)
                rows[key] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
                continue
            if want is None:
                want = paged_attention_torch(q.float(), kc.float(), vc.float(), meta, D ** -0.5)
            err = ((got.float() - want).abs().max() / want.abs().max()).item()
            rows[key] = {"us": us, "tflops": round(flops / us / 1e6, 1), "err": round(err, 5)}
        if all(n == q for n, q in zip(lens, qlens)):
            q, kc, vc, meta = build(lens, qlens, 64, gen)
            try:
                fn = flash_reference(q, kc, vc, meta, lens)
                us = graph_us(fn)
                rows["flash-attention-2 (contiguous K/V)"] = {"us": us, "tflops": round(flops / us / 1e6, 1)}
            except Exception as e:  # noqa: BLE001
                rows["flash-attention-2 (contiguous K/V)"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        ok = {k: r for k, r in rows.items() if "us" in r}
        default = "m16 n64 w4 s2 masked" if decode else "m64 n64 w4 s2 masked"
        best = min(ok, key=lambda k: ok[k]["us"])
        results["cases"][name] = {"rows": rows, "default_before": default, "best": best}
        print(f"\n## {name}: {flops / 1e9:.2f} GFLOP (causal)")
        print(f"before ({default}): {ok[default]['us']} µs; best ({best}): {ok[best]['us']} µs, "
              f"{ok[best]['tflops']} TFLOP/s")
        for k in sorted(ok, key=lambda k: ok[k]["us"])[:8]:
            print(f"  {k:36s} {ok[k]['us']:8.1f} µs {ok[k]['tflops']:7.1f} TFLOP/s err {ok[k].get('err', '-')}")
        for k, r in rows.items():
            if "error" in r:
                print(f"  {k}: {r['error']}")
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
