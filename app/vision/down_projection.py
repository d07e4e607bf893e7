"""The towers' MLP down projection (fc2 / down_proj), run the fastest of up to three ways per row count.

The GEMM has no bias (the fused residual add applies it later, in float32), and the MLP width is
padded with zero units (`kernels.pad_mlp`): a width such as Qwen2.5-VL's 3420 makes rows that are not
16-byte aligned, and cuBLAS then falls back to slow kernels. Beyond that no way wins everywhere, and
the winner moves with the row count (unpadded through cuBLAS, padded through cuBLAS, padded through
cuBLASLt, which PyTorch picks for an addmm with a vector bias, hence a zero bias;
benchmarks/results/2026-11-23-mlp-down-projection-padded-tuned.md). So `tune` times the ways once per
row count on the tower's own device and keeps the winner; a batch of another row count (an eager
batch) takes the choice of the nearest tuned count above it. All ways compute the same products: the
padded units and the zero bias add exact zeros.
"""

from __future__ import annotations

import bisect

import torch
import torch.nn.functional as F

from ..gpu.kernel_timing import graph_us

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

    def table(self) -> list[dict]:
        """The choice as rows for a file (tune_cache.TuneCache): row count, way, and the timings if measured."""
        return [{"rows": r, "way": w, "us": self.timings.get(r)} for r, w in sorted(self.choice.items())]

    def apply(self, table: list[dict], rows_list: list[int]) -> bool:
        """Another replica's choice (`table`), if it names one of this projection's ways for every row
        count of `rows_list`: kept as if timed here. False, with nothing changed, for a table that misses
        a count or names a way this one does not have (another width: a foreign or damaged file)."""
        if not isinstance(table, list) or not all(isinstance(r, dict) for r in table):
            return False
        ways = {r.get("rows"): r.get("way") for r in table}
        if not all(isinstance(ways.get(rows), str) and ways[rows] in self.ways for rows in rows_list):
            return False
        for rows in rows_list:
            self.keep(rows, ways[rows])
        return True

    def tune(self, rows_list: list[int], weights: list[torch.Tensor], runs: int = 5) -> None:
        """Time every way at each new row count and keep the fastest. Not during graph capture; a no-op
        off CUDA. The graph manager calls it for every budget and uniform shape before capturing them.

        Each way is timed as the tower's graphs run it: replayed from a CUDA graph (timing.graph_us) of
        one call per layer weight in `weights` (distinct weights, read from memory as the tower reads
        them, not from L2), so the choice follows GPU time only. Timed eagerly, a GEMM this short
        measures the host's launch time instead, and a slow host picked a slower way
        (benchmarks/results/2026-11-25-minicpm-v-down-projection-patch-gemm-resampler.md)."""
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
