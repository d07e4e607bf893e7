"""Micro-benchmark: attention back-ends for the tower's shapes (varlen FA2 vs SDPA back-ends).

    python benchmarks/attention.py
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.varlen import varlen_attn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from app.vision.timing import cuda_times_ms  # noqa: E402


def bench(fn, runs=50):
    """Median microseconds."""
    return statistics.median(cuda_times_ms(fn, runs, warmup=5)) * 1000


def main():
    for case in [("1x448 (784)", [784], 1, 784), ("1x448 in graph 896/33", [784, 112], 33, 896),
                 ("video 4x196", [196] * 4, 4, 196), ("1x1024 (4096)", [4096], 1, 4096),
                 ("4x448 (4x784)", [784] * 4, 4, 784)]:
        run_case(*case)


def run_case(label, seqs, slots, maxlen, heads=16, hd=72):
    if True:
        n = sum(seqs)
        q, k, v = (torch.randn(n, heads, hd, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        cu = torch.tensor([0] + torch.tensor(seqs).cumsum(0).tolist() + [n] * (slots - len(seqs)), device="cuda",
                          dtype=torch.int32)
        row = {"varlen": bench(lambda: varlen_attn(q, k, v, cu, cu, maxlen, maxlen))}
        if len(set(seqs)) == 1:
            b = len(seqs)
            qb, kb, vb = (t.view(b, seqs[0], heads, hd).transpose(1, 2) for t in (q, k, v))
            for name, be in [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                             ("efficient", SDPBackend.EFFICIENT_ATTENTION)]:
                try:
                    with sdpa_kernel(be):
                        row[name] = bench(lambda: F.scaled_dot_product_attention(qb, kb, vb))
                except RuntimeError as e:
                    row[name] = f"n/a ({str(e)[:40]})"
        seg = torch.repeat_interleave(torch.arange(len(seqs), device="cuda"), torch.tensor(seqs, device="cuda"))
        mask = seg[:, None] == seg[None, :]
        for name, be in [("cudnn+mask", SDPBackend.CUDNN_ATTENTION), ("efficient+mask", SDPBackend.EFFICIENT_ATTENTION)]:
            try:
                with sdpa_kernel(be):
                    row[name] = bench(lambda: F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                                             v.transpose(0, 1)[None], attn_mask=mask))
            except RuntimeError as e:
                row[name] = f"n/a ({str(e)[:40]})"
        print(label, {k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}, "us", flush=True)


if __name__ == "__main__":
    main()
