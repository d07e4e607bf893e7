"""Projections of one- and two-token steps (single-stream decode) as Triton matrix-vector products, used
per weight shape only where they beat cuBLAS on this GPU, as timed when the engine starts.

At one token a projection streams its weight once: bandwidth is the whole cost, and cuBLAS's plans for
small layers reach little of it (the 0.5 MB MoE router 4.85 us, the 30B o-projection's split-K about
2 TB/s on an H200). Each program owns BLOCK_N weight rows and streams them along K once, one float32
accumulator per token row, rounded once as F.linear rounds (only the order of the sums differs); split-K
tiles sum their parts in the same launch. `GemvTable.tune` times each shape against F.linear over every
layer's weight in turn (HBM reads, as in a step, where they outgrow the L2: 48 routers' 24 MB do not),
keeps a tile only below MIN_GAIN of cuBLAS and only if its output then matches F.linear's. On one H200:
30B-A3B single-stream decode +2.4%, 8B +3.2% (docs/concepts/engine.md, "Steps of one token").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import pdl
from .pdl import enter

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

log = logging.getLogger(__name__)

Linear = Callable[..., torch.Tensor]  # F.linear's signature: (x, weight, bias=None)

MAX_ROWS = 2  # token rows the kernel takes; steps with more go to cuBLAS
TUNED_ROWS = (1, 2)  # the step sizes timed at start-up
MIN_GAIN = 0.95  # the kernel is used where it takes at most this share of cuBLAS's time
# (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT) timed per shape: the three of six unsplit tiles that won
# a shape on an H200 (2026-12-01), and one whose program reads its rows in one K tile, which the weight
# prefetch (PREFETCH) then loads whole before the PDL wait (2026-12-06)
TILES = ((4, 512, 4, 3, 1), (8, 256, 4, 3, 1), (8, 512, 8, 3, 1), (4, 2048, 4, 1, 1))
# Split-K candidates (`llm.decode_gemv_split`, on since the engine's GPU tests passed with them, one H100,
# 2026-12-02): K divided among SPLIT programs per column tile, as cuBLAS's split-K plan for the o-projection
# does, the float32 parts summed in the same launch by the tile's last program, in split order. Meant for
# layers with few column tiles: 2048 x 4096 has 512 of 4 rows, and there the unsplit kernel's 9.12 us against
# cuBLAS's 9.53 missed MIN_GAIN.
SPLIT_TILES = ((8, 256, 4, 3, 4), (16, 256, 4, 3, 4), (8, 1024, 4, 1, 4))  # the last: one K tile per split
# Each program's first weight tile is loaded before the kernel's PDL wait (`_gemv_kernel`); False puts it after,
# as before 2026-12-06, for benchmarks/decode.py --no-weight-prefetch's A/B.
PREFETCH = True
# per (device, rows, N, BLOCK_N, SPLIT): the split tiles' float32 parts and per-tile counters. Made once,
# outside any CUDA graph (GemvTable.tune makes them before the engine captures its graphs), so the graphs
# replay with fixed addresses; each call leaves its counters at zero again.
_SCRATCH: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def scratch(device: torch.device, rows: int, n: int, block_n: int, split: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = (str(device), rows, n, block_n, split)
    if key not in _SCRATCH:
        _SCRATCH[key] = (torch.empty(split, rows, n, dtype=torch.float32, device=device),
                         torch.zeros(triton.cdiv(n, block_n), dtype=torch.int32, device=device))
    return _SCRATCH[key]


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         tile: tuple[int, int, int, int, int] = TILES[0]) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [rows <= MAX_ROWS, K] and weight [N, K] with contiguous rows."""
    rows, k = x.shape
    n = weight.shape[0]
    assert rows <= MAX_ROWS and weight.shape[1] == k and weight.stride(1) == 1 and x.stride(1) == 1
    block_n, block_k, warps, stages, split = tile
    chunk = triton.cdiv(triton.cdiv(k, split), block_k) * block_k  # each split's share of K, whole K tiles
    split = triton.cdiv(k, chunk)
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    parts, counts = scratch(x.device, rows, n, block_n, split) if split > 1 else (y, y)
    _gemv_kernel[(triton.cdiv(n, block_n), split)](
        x, weight, bias if bias is not None else weight, y, parts, counts, n, k, chunk, x.stride(0),
        weight.stride(0), y.stride(0), ROWS=rows, HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0,
        BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split, PREFETCH=PREFETCH, num_warps=warps, num_stages=stages,
        **pdl.args())
    return y


if triton is not None:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, parts_ptr, counts_ptr, n, width, chunk, stride_xt, stride_wn,
                     stride_yt, ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, PREFETCH: tl.constexpr,
                     PDL: tl.constexpr):
        # y[r, cols] = x[r] @ w[cols]^T (+ b[cols]) for the ROWS token rows, BLOCK_N weight rows per program;
        # with SPLIT > 1, program (tile, s) takes K's s-th `chunk` and the tile's last program sums the parts
        pid_n = tl.program_id(0)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        k_begin = tl.program_id(1) * chunk
        k_end = tl.minimum(width, k_begin + chunk)  # every split holds at least one K tile (gemv's `chunk`)
        ks = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + (k_begin + ks)[None, :]
        x_ptrs = x_ptr + k_begin + ks
        if PREFETCH:
            # No kernel writes a weight, so the first K tile's load may be issued before the wait (`enter`):
            # under PDL this program starts while the kernel before it still runs (a one-program add+RMSNorm,
            # an attention merge) and its first bytes are on the way when that one ends. Only x waits.
            w = _gemv_load_w(w_ptrs, col_ok, ks, k_end - k_begin, EVEN_K)
            enter(PDL)
        else:
            enter(PDL)
            w = _gemv_load_w(w_ptrs, col_ok, ks, k_end - k_begin, EVEN_K)
        acc0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        acc0, acc1 = _gemv_accumulate(w, x_ptrs, stride_xt, ks, k_end - k_begin, acc0, acc1, ROWS, EVEN_K)
        for k0 in range(k_begin + BLOCK_K, k_end, BLOCK_K):
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            w = _gemv_load_w(w_ptrs, col_ok, ks, k_end - k0, EVEN_K)
            acc0, acc1 = _gemv_accumulate(w, x_ptrs, stride_xt, ks, k_end - k0, acc0, acc1, ROWS, EVEN_K)
        if SPLIT > 1:
            # this program's part, then the tile's count; the program that makes it SPLIT sums every part in
            # split order (the same float32 sums whichever program is last) and sets the count back to 0
            part = parts_ptr + tl.program_id(1) * ROWS * n + cols
            tl.store(part, acc0, mask=col_ok)
            if ROWS == 2:
                tl.store(part + n, acc1, mask=col_ok)
            # every warp's part stored before the count is raised: a scalar atomic runs on one thread, and
            # its release orders only that thread's own earlier stores
            tl.debug_barrier()
            done = tl.atomic_add(counts_ptr + pid_n, 1, sem="acq_rel")
            if done == SPLIT - 1:
                acc0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
                acc1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
                for s in tl.static_range(SPLIT):
                    acc0 += tl.load(parts_ptr + s * ROWS * n + cols, mask=col_ok, other=0.0, cache_modifier=".cg")
                    if ROWS == 2:
                        acc1 += tl.load(parts_ptr + (s * ROWS + 1) * n + cols, mask=col_ok, other=0.0,
                                        cache_modifier=".cg")
                _gemv_store(y_ptr, b_ptr, cols, col_ok, acc0, acc1, stride_yt, ROWS, HAS_BIAS)
                tl.store(counts_ptr + pid_n, 0)
        else:
            _gemv_store(y_ptr, b_ptr, cols, col_ok, acc0, acc1, stride_yt, ROWS, HAS_BIAS)

    @triton.jit
    def _gemv_load_w(w_ptrs, col_ok, ks, left, EVEN_K: tl.constexpr):
        """One [BLOCK_N, BLOCK_K] weight tile, `left` columns of K from its start still in range."""
        if EVEN_K:
            return tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
        return tl.load(w_ptrs, mask=col_ok[:, None] & (ks < left)[None, :], other=0.0)

    @triton.jit
    def _gemv_accumulate(w, x_ptrs, stride_xt, ks, left, acc0, acc1, ROWS: tl.constexpr, EVEN_K: tl.constexpr):
        """The tile's products with each token row's K slice, summed into that row's float32 accumulator."""
        w = w.to(tl.float32)
        if EVEN_K:
            x0 = tl.load(x_ptrs).to(tl.float32)
        else:
            x0 = tl.load(x_ptrs, mask=ks < left, other=0.0).to(tl.float32)
        acc0 += tl.sum(w * x0[None, :], 1)
        if ROWS == 2:
            if EVEN_K:
                x1 = tl.load(x_ptrs + stride_xt).to(tl.float32)
            else:
                x1 = tl.load(x_ptrs + stride_xt, mask=ks < left, other=0.0).to(tl.float32)
            acc1 += tl.sum(w * x1[None, :], 1)
        return acc0, acc1

    @triton.jit
    def _gemv_store(y_ptr, b_ptr, cols, col_ok, acc0, acc1, stride_yt, ROWS: tl.constexpr, HAS_BIAS: tl.constexpr):
        """The float32 sums (+ bias) rounded once to y's dtype."""
        if HAS_BIAS:
            b = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            acc0 += b
            acc1 += b
        dtype = y_ptr.dtype.element_ty
        tl.store(y_ptr + cols, acc0.to(dtype), mask=col_ok)
        if ROWS == 2:
            tl.store(y_ptr + stride_yt + cols, acc1.to(dtype), mask=col_ok)


@dataclass
class GemvChoice:
    """One (rows, N, K): cuBLAS's time and the best tile's, microseconds per call."""

    rows: int
    n: int
    k: int
    cublas_us: float
    kernel_us: float
    tile: tuple[int, int, int, int, int]
    agrees: bool = True  # the tile's output matched F.linear's on this GPU (checked after timing, on CUDA)

    @property
    def used(self) -> bool:
        return self.agrees and self.kernel_us <= MIN_GAIN * self.cublas_us


@dataclass
class GemvTable:
    """Which one- and two-row projections run as `gemv`, by (rows, N, K); empty: all cuBLAS."""

    choices: dict[tuple[int, int, int], GemvChoice] = field(default_factory=dict)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        c = self.choices.get((x.shape[0], weight.shape[0], weight.shape[1])) if x.shape[0] <= MAX_ROWS else None
        if c is None or not c.used or x.stride(1) != 1:
            return F.linear(x, weight, bias)
        return gemv(x, weight, bias, c.tile)

    def tune(self, weights_by_shape: dict[tuple[int, int], list[torch.Tensor]], timer, rows=TUNED_ROWS,
             tiles=TILES) -> None:
        """`weights_by_shape`: (N, K) -> every layer's weight of that shape, read in turn by each timed
        call. `timer(fn) -> us` times one call of `fn` (kernel_timing.graph_us, replayed from a graph).
        On CUDA the fastest tile's output is then checked against F.linear's on several layers' weights,
        several times over: a tile that disagrees is not used, whatever its speed."""
        for (n, k), ws in weights_by_shape.items():
            for r in rows:
                x = torch.randn(r, k, dtype=ws[0].dtype, device=ws[0].device)

                def cycle(op, ws=ws, x=x):
                    for w in ws:
                        op(x, w)

                base = timer(lambda: cycle(F.linear)) / len(ws)
                best, best_tile = float("inf"), tiles[0]
                for tile in tiles:
                    if x.is_cuda:  # compiled, and a split tile's scratch made, before any capture
                        gemv(x, ws[0], None, tile)
                    us = timer(lambda tile=tile: cycle(lambda a, w: gemv(a, w, None, tile))) / len(ws)
                    if us < best:
                        best, best_tile = us, tile
                agrees = agrees_with_f_linear(x, ws, best_tile) if x.is_cuda else True
                if not agrees:
                    log.warning("matrix-vector tile %s disagrees with F.linear at %d x %d x %d: cuBLAS kept",
                                best_tile, r, n, k)
                self.choices[(r, n, k)] = GemvChoice(r, n, k, base, best, best_tile, agrees)
        log.info("matrix-vector choice (rows, N, K: cuBLAS us, kernel us, tile, used): %s",
                 "; ".join(f"{c.rows}x{c.n}x{c.k}: {c.cublas_us:.1f}, {c.kernel_us:.1f}, {c.tile}, {c.used}"
                           for c in self.choices.values()))

    def as_dict(self) -> list[dict]:
        return [{"rows": c.rows, "n": c.n, "k": c.k, "cublas_us": round(c.cublas_us, 2),
                 "kernel_us": round(c.kernel_us, 2), "tile": list(c.tile), "agrees": c.agrees, "used": c.used}
                for c in self.choices.values()]

    def file_rows(self) -> list[dict]:
        """The choice for a file (tune_cache.TuneCache): `as_dict`'s fields with the times unrounded, so that
        a replica applying it decides `used` (MIN_GAIN) exactly as the one that timed."""
        return [{"rows": c.rows, "n": c.n, "k": c.k, "cublas_us": c.cublas_us, "kernel_us": c.kernel_us,
                 "tile": list(c.tile), "agrees": c.agrees} for c in self.choices.values()]

    def apply(self, table: list[dict], keys: Collection[tuple[int, int, int]], tiles=TILES) -> bool:
        """Another replica's choice (`file_rows`' rows, from tune_cache.TuneCache), if it holds a valid row
        for every (rows, N, K) of `keys` with a tile among `tiles`: kept as if timed here, its agreement
        check included (same GPU model and code by the cache's key). False, nothing changed, otherwise."""
        got = {}
        try:
            for r in table:
                c = GemvChoice(int(r["rows"]), int(r["n"]), int(r["k"]), float(r["cublas_us"]), float(r["kernel_us"]),
                               tuple(int(v) for v in r["tile"]), bool(r["agrees"]))
                if c.tile not in tiles:
                    return False
                got[(c.rows, c.n, c.k)] = c
        except (KeyError, TypeError, ValueError):
            return False
        if not set(keys) <= set(got):
            return False
        self.choices.update({key: c for key, c in got.items() if key in keys})  # the file's order, as timed
        return True


def agrees_with_f_linear(x: torch.Tensor, ws: list[torch.Tensor], tile, layers: int = 4, repeats: int = 8) -> bool:
    """The tile's output against F.linear's on the first `layers` weights, `repeats` times each (a race
    shows as a wrong sum now and then, not every time): relative error within what two roundings to x's
    dtype allow."""
    tol = 1e-4 if x.dtype == torch.float32 else 2e-2
    for w in ws[:layers]:
        want = F.linear(x, w).float()
        for _ in range(repeats):
            got = gemv(x, w, None, tile).float()
            if not torch.isfinite(got).all() or (got - want).norm() > tol * want.norm() + 1e-6:
                return False
    return True


def choose_gemv(model, split: bool = False, cache=None) -> tuple[str, float, float] | None:
    """Tune `model.gemv` (a TextModel's GemvTable) on its own weights before the decode graphs are
    captured (they capture whichever kernel the table names); `split` adds SPLIT_TILES to the candidates.
    With `cache` (a tune_cache.TuneCache, `gemv_cache_for`), the choice that a replica timed for the same
    key is applied instead, and one timed here is kept: the timing runs (about a second on the 2B shape)
    otherwise run at every start, beside a serving replica's kernels where one is added under load.
    -> the start-up phase (name, start, end), or None where Triton is missing."""
    if triton is None:
        return None
    import time

    t = time.time()
    device = next(model.parameters()).device
    tiles = TILES + (SPLIT_TILES if split else ())
    weights = model.projection_weights()
    with torch.inference_mode():
        if cache is None:
            _time_gemv(model.gemv, weights, tiles, device)
        else:
            keys = {(r, n, k) for n, k in weights for r in TUNED_ROWS}

            def measure() -> list[dict]:
                _time_gemv(model.gemv, weights, tiles, device)
                return model.gemv.file_rows()

            source = cache.applied_or_measured(lambda table: model.gemv.apply(table, keys, tiles), measure)
            if source != "measured":
                log.info("matrix-vector choice %s", source)
                _compile_and_check_used(model.gemv, weights)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # the timing graphs' blocks back before the KV cache is sized from free memory
    return ("matrix-vector choice", t, time.time())


def _time_gemv(table: GemvTable, weights, tiles, device) -> None:
    from ..gpu.kernel_timing import graph_us

    side = torch.cuda.Stream(device)  # one side stream for every timing: each new one keeps its own cuBLAS workspace
    table.tune(weights, lambda fn: graph_us(fn, runs=10, stream=side), tiles=tiles)


def _compile_and_check_used(table: GemvTable, weights: dict[tuple[int, int], list[torch.Tensor]]) -> None:
    """Every kernel an applied choice uses, checked against F.linear on this GPU as the timing checks its
    winner (a race shows on one GPU and not another): compiled, and a split tile's scratch made, before
    the decode graphs capture it; one that disagrees here goes back to cuBLAS."""
    for c in table.choices.values():
        if c.used:
            ws = weights[(c.n, c.k)]
            x = torch.randn(c.rows, c.k, dtype=ws[0].dtype, device=ws[0].device)
            if not agrees_with_f_linear(x, ws, c.tile):
                log.warning("matrix-vector tile %s disagrees with F.linear at %d x %d x %d: cuBLAS kept",
                            c.tile, c.rows, c.n, c.k)
                c.agrees = False


def gemv_cache_for(folder, checkpoint: str, device, dtype, ranks: str, split: bool):
    """Where the matrix-vector choice is kept (tune_cache.TuneCache): by GPU model, torch and Triton,
    checkpoint config, dtype, tensor parallelism (`ranks`: its size and MoE split, which set each rank's
    shapes), the split tiles and the engine's kernel code."""
    from ..gpu.tune_cache import ENGINE_CODE, TuneCache, checkpoint_parts, library_versions, source_digest

    parts = {**checkpoint_parts(checkpoint, device, dtype), "ranks": ranks, "split": split,
             "pdl": pdl.on(),  # PDL changes how each launch overlaps the one before it, and so the times
             "code": source_digest(ENGINE_CODE), **library_versions(("triton",))}
    return TuneCache(folder, parts, "matrix-vector choice")
