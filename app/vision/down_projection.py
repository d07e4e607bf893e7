"""The towers' MLP down projection (fc2 / down_proj), run the fastest of up to three ways per row count.

Its bias is applied later, in float32, by the fused residual add, so the GEMM itself has none. The MLP
width is padded with zero units (`kernels.pad_mlp`), and no single way to run the GEMM wins everywhere.
On an H200 (`benchmarks/kernels.py residual_gemms`, µs per GEMM):

- Qwen2.5-VL's width 3420 (rows of 6840 bytes, not 16-byte aligned): 53.2 unpadded, 16.7 padded to 3456,
  at 784 rows; 195 against 49 at 4096;
- SigLIP's 4304 (MiniCPM-V, and Qwen3-VL-8B): at 1024 rows 25.1 unpadded through cuBLAS, 17.9 padded
  through cuBLASLt (PyTorch sends an addmm with a vector bias there, so a zero bias picks it); at 4096
  rows the unpadded cuBLAS GEMM is the fastest (54.5 against 60.5 padded);
- Qwen3-VL-2B's 4096 (no padding): cuBLAS 11.9, cuBLASLt 16.8 at 784 rows.

So each tower times the ways once per row count on its own device (`tune`, which the graph manager calls
for every budget and uniform shape before it captures them) and keeps the winner; a batch of another
row count (an eager batch) takes the choice of the nearest tuned count above it. All ways compute the
same products: the padded units and the zero bias add exact zeros.
"""

from __future__ import annotations

import bisect

import torch
import torch.nn.functional as F

from .timing import graph_us

CUBLAS, CUBLAS_PADDED, LT_PADDED = "cublas", "cublas_padded", "cublaslt_padded"


class DownProjection:
    def __init__(self, width: int, padded: int, hidden: int, dtype: torch.dtype, device: torch.device):
        """`width`: the MLP's own width; `padded`: the width its tensors are stored at (>= width)."""
        self.width, self.padded = width, padded
        self.zero_bias = torch.zeros(hidden, dtype=dtype, device=device)
        self.ways = (CUBLAS, CUBLAS_PADDED, LT_PADDED) if padded > width else (CUBLAS, LT_PADDED)
        self.choice: dict[int, str] = {}  # rows -> way
        self.timings: dict[int, dict[str, float]] = {}  # rows -> way -> µs (the tuning's medians)
        self._tuned: list[int] = []  # sorted keys of `choice`

    def run(self, way: str, u: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """u [M, padded] @ weight [N, padded].T one way."""
        if way == CUBLAS:  # the unpadded product, on strided views (no copy)
            return F.linear(u[:, :self.width], weight[:, :self.width])
        if way == LT_PADDED:
            return F.linear(u, weight, self.zero_bias)
        return F.linear(u, weight)

    def keep(self, rows: int, way: str) -> None:
        """Use `way` for batches of `rows` tokens (and, when nearest, of fewer)."""
        if way not in self.ways:
            raise ValueError(f"unknown way {way!r}; one of {self.ways}")
        self.choice[rows] = way
        self._tuned = sorted(self.choice)

    def way_for(self, rows: int) -> str:
        if rows in self.choice:
            return self.choice[rows]
        i = bisect.bisect_left(self._tuned, rows)
        if i < len(self._tuned):
            return self.choice[self._tuned[i]]
        return self.choice[self._tuned[-1]] if self._tuned else CUBLAS_PADDED

    def __call__(self, u: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Off CUDA nothing is tuned, so `way_for` gives the padded product."""
        return self.run(self.way_for(u.shape[0]), u, weight)

    def tune(self, rows_list: list[int], weights: list[torch.Tensor], runs: int = 5) -> None:
        """Time every way at each new row count and keep the fastest. Not during graph capture; a no-op
        off CUDA.

        Each way is timed as the tower's graphs run it: replayed from a CUDA graph (timing.graph_us) of
        one call per layer weight in `weights` (distinct weights, read from memory as the tower reads
        them, not from L2), so the choice follows GPU time only. Timed eagerly, a ~20 µs GEMM measures
        the host's launch time instead: on a slow host that picked a way 5 µs slower per layer
        (MiniCPM-V at 1024 rows, 2026-11-25)."""
        if not weights[0].is_cuda or torch.cuda.is_current_stream_capturing():
            return
        for rows in sorted(set(rows_list) - set(self.choice)):
            u = torch.randn(rows, self.padded, dtype=weights[0].dtype, device=weights[0].device)
            u[:, self.width:] = 0  # as the padded units are
            times = {}
            for way in self.ways:
                def every_layer(way=way, u=u):
                    for w in weights:
                        self.run(way, u, w)
                times[way] = round(graph_us(every_layer, runs=runs, warmup=2) / len(weights), 2)
            self.timings[rows] = times
            self.keep(rows, min(times, key=times.get))
