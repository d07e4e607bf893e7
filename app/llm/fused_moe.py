"""Mixture-of-experts SwiGLU layer (Qwen3-MoE, Qwen3-VL-MoE) as two grouped GEMMs on CUDA (Triton).

transformers runs the experts as a Python loop: per hit expert a gather, two GEMMs, the activation,
the weighting and an index_add, so one token's eight experts cost dozens of small launches, and the
loop's `nonzero` waits on the host. Here the assignments (token, slot) are sorted by expert
on the device, each expert's rows padded to a whole tile, and one launch does every expert's
gate/up GEMM with the activation fused, a second every down GEMM with the routing weight fused. No
step reads a value back to the host and every shape depends only on (tokens, top-k, experts), so
the layer can be captured in the decode CUDA graphs. Expert ids outside [0, E) (experts held by
another rank under expert parallelism) contribute nothing. The CPU runs `moe_reference`, which
rounds as transformers' `Qwen3VLMoeTextExperts` does; the kernels round at the same points.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import pdl
from .pdl import enter

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


# ---------------------------------------------------------------------------- reference (CPU)
def moe_reference(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> torch.Tensor:
    """x [T, H], w_gate_up [E, 2I, H] (gate rows then up rows), w_down [E, H, I], topk_ids/topk_weights
    [T, k] -> [T, H]. transformers' per-expert loop: same row order, same rounding."""
    out = torch.zeros_like(x)
    num_experts = w_gate_up.shape[0]
    ids = topk_ids.t()  # [k, T]: transformers takes each expert's rows slot-major
    for e in torch.unique(topk_ids[(topk_ids >= 0) & (topk_ids < num_experts)]).tolist():
        pos, tok = torch.where(ids == e)
        gate, up = F.linear(x[tok], w_gate_up[e]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, w_down[e]) * topk_weights[tok, pos, None]
        out.index_add_(0, tok, h.to(out.dtype))
    return out


# ---------------------------------------------------------------------------- alignment
def align_capacity(assignments: int, num_experts: int, block_m: int) -> int:
    """Static length of the sorted, padded list: each non-empty bucket (the experts and one for
    out-of-range ids) pads by at most block_m - 1, and at most `assignments` buckets are non-empty."""
    padded = assignments + min(num_experts + 1, assignments) * (block_m - 1)
    return -(-padded // block_m) * block_m


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the T*k assignments (flat index t*k + j) by expert, each group padded to a multiple of
    block_m, without synchronising with the host (shapes depend on T, k, E only).

    Returns `sorted_ids` [align_capacity] int32 (padding = T*k), `expert_of_block` [capacity / block_m]
    int32, and `total` [1] int32, the padded length in use. Out-of-range ids form a last group,
    bucket E: the gate/up kernel skips its blocks, the down kernel writes zeros for its rows (cheaper
    than clearing the whole output buffer on every step). Blocks from `total` on are unused.

    On CUDA three small Triton kernels; the torch version below took some twenty launches, about
    half of a one-token decode step's MoE time. Their order within a group comes from atomics; no
    output depends on it (each GEMM row is computed from its own inputs alone)."""
    if triton is None or not topk_ids.is_cuda or topk_ids.numel() == 0:
        return align_by_expert_torch(topk_ids, num_experts, block_m)
    ids = topk_ids.reshape(-1)
    n = ids.numel()
    dev = ids.device
    cap = align_capacity(n, num_experts, block_m)
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=dev)
    starts = torch.empty(num_experts + 1, dtype=torch.int32, device=dev)
    rank = torch.empty(n, dtype=torch.int32, device=dev)
    sorted_ids = torch.empty(cap, dtype=torch.int32, device=dev)
    expert_of_block = torch.empty(cap // block_m, dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int32, device=dev)
    block = 1024
    grid = (triton.cdiv(n, block),)
    _count_kernel[grid](ids, counts, rank, n, num_experts, BLOCK=block, num_warps=4, **pdl.args())
    _offsets_kernel[(1,)](counts, starts, sorted_ids, expert_of_block, total, n, num_experts, cap,
                          BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(num_experts + 1), BLOCK=1024,
                          BLOCK_B=32, num_warps=8, **pdl.args())
    _scatter_kernel[grid](ids, rank, starts, sorted_ids, n, num_experts, BLOCK=block, num_warps=4, **pdl.args())
    return sorted_ids, expert_of_block, total


def align_by_expert_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`align_by_expert` in torch ops (the CPU's, and the tests'): a stable sort by bucket, so each
    group keeps the assignments' order."""
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    dev = flat.device
    bucket = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev).scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    sorted_bucket, order = torch.sort(bucket, stable=True)
    first = counts.cumsum(0) - counts  # where each bucket begins in the unpadded sorted order
    dest = (ends - padded)[sorted_bucket] + torch.arange(n, device=dev) - first[sorted_bucket]
    cap = align_capacity(n, num_experts, block_m)
    sorted_ids = torch.full((cap,), n, dtype=torch.int32, device=dev).scatter_(0, dest, order.int())
    block_starts = torch.arange(0, cap, block_m, device=dev)
    expert_of_block = torch.searchsorted(ends, block_starts, right=True).int()
    return sorted_ids, expert_of_block, ends[-1:].int()


# ---------------------------------------------------------------------------- tiles
DIRECT_MAX_TOKENS = 2


def moe_config(tokens: int, k: int, experts: int, hidden: int, inter: int) -> dict:
    """Tiles for both GEMMs, by the average rows an expert gets (tokens * k / experts). Decode
    streams each hit expert's weights once for a handful of rows: one 16-row block, narrow N tiles
    so the few experts still spread over every SM, long K steps. Prefill reuses each weight tile
    over many rows, so larger M tiles and grouped launch order (GROUP_M) for L2 reuse.

    Up to DIRECT_MAX_TOKENS tokens (single-stream decode) the assignments are not sorted at all
    (`DIRECT`): each is its own block, read straight from the router's ids, and the down kernel
    sums a token's k experts itself, so the layer is two launches instead of six. Two tokens rarely
    share an expert, so nothing is read twice that sorting would have read once.
    There VEC runs gate/up as matrix-vector products instead of 16-row tiles; the down projection runs
    per assignment, then a k-sum kernel (one kernel looping over a token's experts had too few programs:
    benchmarks/results/2026-11-27-models-beyond-one-gpu.md); DOWN_BLOCK_N, DOWN_BLOCK_K, DOWN_WARPS and
    DOWN_STAGES (default num_stages) shape it.
    The sweep in benchmarks/moe_kernel.py covers these choices."""
    rows = tokens * k / max(experts, 1)
    if tokens <= DIRECT_MAX_TOKENS:
        # swept on an H100 at the 30B shape, one kernel at a time (benchmarks/moe_kernel.py --tokens 1 2
        # --direct-sweep --pdl, 2026-12-02): the layer 1.06x (1 token) and 1.04x (2 tokens) the earlier pick
        # (BLOCK_N 4, BLOCK_K 256, 4 down warps, from --sweep's narrower grid, 2026-11-27); single-stream
        # decode 288.8-289.6 against 287.0-287.6 tok/s, alternated twice in one call
        cfg = {"BLOCK_M": 16, "BLOCK_N": 2, "BLOCK_K": 1024, "GROUP_M": 1, "num_warps": 4, "num_stages": 3,
               "DIRECT": True, "VEC": True, "DOWN_BLOCK_N": 4, "DOWN_BLOCK_K": 256, "DOWN_WARPS": 2,
               "DOWN_STAGES": 3}
    elif rows <= 4:
        cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 4}
    elif rows <= 16:
        cfg = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 4}
    elif rows <= 48:
        cfg = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 4, "num_warps": 4, "num_stages": 4}
    else:
        cfg = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}
    return cfg


# ---------------------------------------------------------------------------- Triton
if triton is not None:

    @triton.jit
    def _count_kernel(ids_ptr, counts_ptr, rank_ptr, n, num_experts, BLOCK: tl.constexpr, PDL: tl.constexpr):
        enter(PDL)
        # each assignment's bucket (E for out-of-range ids) counted, and its rank within the bucket kept
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        e = tl.load(ids_ptr + offs, mask=ok, other=0)
        b = tl.where((e >= 0) & (e < num_experts), e, num_experts).to(tl.int32)
        rank = tl.atomic_add(counts_ptr + b, tl.full([BLOCK], 1, tl.int32), mask=ok)
        tl.store(rank_ptr + offs, rank, mask=ok)

    @triton.jit
    def _offsets_kernel(counts_ptr, starts_ptr, sorted_ptr, block_expert_ptr, total_ptr, n, num_experts, cap,
                        BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK: tl.constexpr, BLOCK_B: tl.constexpr,
                        PDL: tl.constexpr):
        enter(PDL)
        # one program: padded group starts, the total, every block's expert, and the padding filled in
        eb = tl.arange(0, BLOCK_E)
        live = eb <= num_experts
        c = tl.load(counts_ptr + eb, mask=live, other=0)
        padded = (c + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, 0)
        tl.store(starts_ptr + eb, ends - padded, mask=live)
        tl.store(total_ptr, tl.sum(padded, 0))
        for s in range(0, cap, BLOCK):
            offs = s + tl.arange(0, BLOCK)
            tl.store(sorted_ptr + offs, tl.full([BLOCK], 0, tl.int32) + n, mask=offs < cap)
        num_blocks = cap // BLOCK_M
        for s in range(0, num_blocks, BLOCK_B):
            blk = s + tl.arange(0, BLOCK_B)
            # a block's expert: how many groups end at or before its first row (searchsorted, right)
            done = (ends[None, :] <= (blk * BLOCK_M)[:, None]) & live[None, :]
            tl.store(block_expert_ptr + blk, tl.sum(done.to(tl.int32), 1), mask=blk < num_blocks)

    @triton.jit
    def _scatter_kernel(ids_ptr, rank_ptr, starts_ptr, sorted_ptr, n, num_experts, BLOCK: tl.constexpr,
                        PDL: tl.constexpr):
        enter(PDL)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        e = tl.load(ids_ptr + offs, mask=ok, other=0)
        b = tl.where((e >= 0) & (e < num_experts), e, num_experts).to(tl.int32)
        dest = tl.load(starts_ptr + b, mask=ok, other=0) + tl.load(rank_ptr + offs, mask=ok, other=0)
        tl.store(sorted_ptr + dest, offs, mask=ok)

    @triton.jit
    def _tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
        """Program -> (M block, N tile), GROUP_M blocks at a time across all N tiles (L2 reuse)."""
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m

    @triton.jit
    def _gate_up_kernel(x_ptr, w_ptr, h_ptr, sorted_ptr, block_expert_ptr, total_ptr,
                        n_assign, num_blocks, hidden, inter, num_experts,
                        stride_xt, stride_xk, stride_we, stride_wn, stride_wk, stride_ht,
                        TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
                        PRECISION: tl.constexpr, DIRECT: tl.constexpr, PDL: tl.constexpr):
        enter(PDL)
        # h[a] = silu(x[a // k] @ gate_e^T) * (x[a // k] @ up_e^T) for the BLOCK_M sorted assignments
        # of one expert and BLOCK_N intermediate columns; gate and up tiles share the x tile.
        # DIRECT: block m is assignment m alone (its first row), its expert read from the router's ids
        # (`sorted_ptr`); out-of-range experts are skipped here and in the down kernel.
        pid_m, pid_n = _tile(tl.program_id(0), num_blocks, tl.cdiv(inter, BLOCK_N), GROUP_M)
        if DIRECT:
            expert = tl.load(sorted_ptr + pid_m)
            if (expert < 0) | (expert >= num_experts):
                return
            a = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, n_assign)
        else:
            if pid_m * BLOCK_M >= tl.load(total_ptr):
                return
            expert = tl.load(block_expert_ptr + pid_m)
            if expert >= num_experts:  # the out-of-range bucket: the down kernel zeroes its rows
                return
            a = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        row_ok = a < n_assign  # padding rows hold n_assign
        tok = (a // TOP_K).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < inter
        ks = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + tok[:, None] * stride_xt + ks[None, :] * stride_xk
        w_e = w_ptr + expert.to(tl.int64) * stride_we
        g_ptrs = w_e + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None] * stride_wk
        u_ptrs = w_e + (cols + inter).to(tl.int64)[None, :] * stride_wn + ks[:, None] * stride_wk
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            if EVEN_K:
                xa = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
                wg = tl.load(g_ptrs, mask=col_ok[None, :], other=0.0)
                wu = tl.load(u_ptrs, mask=col_ok[None, :], other=0.0)
            else:
                k_ok = ks < hidden - k0
                xa = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                wg = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                wu = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc_g = tl.dot(xa, wg, acc=acc_g, input_precision=PRECISION)
            acc_u = tl.dot(xa, wu, acc=acc_u, input_precision=PRECISION)
            x_ptrs += BLOCK_K * stride_xk
            g_ptrs += BLOCK_K * stride_wk
            u_ptrs += BLOCK_K * stride_wk
        # transformers rounds each GEMM's output, silu(gate), and the product to the model dtype
        dtype = h_ptr.dtype.element_ty
        gate = acc_g.to(dtype).to(tl.float32)
        up = acc_u.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        h_ptrs = h_ptr + a.to(tl.int64)[:, None] * stride_ht + cols[None, :]
        tl.store(h_ptrs, (act * up).to(dtype), mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _down_kernel(h_ptr, w_ptr, out_ptr, weights_ptr, sorted_ptr, block_expert_ptr, total_ptr,
                     n_assign, num_blocks, hidden, inter, num_experts,
                     stride_ht, stride_we, stride_wn, stride_wk, stride_ot,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
        enter(PDL)
        # out[a] = weight[a] * (h[a] @ down_e^T) for the BLOCK_M sorted assignments of one expert and
        # BLOCK_N hidden columns; rows of out-of-range assignments get zeros.
        pid_m, pid_n = _tile(tl.program_id(0), num_blocks, tl.cdiv(hidden, BLOCK_N), GROUP_M)
        if pid_m * BLOCK_M >= tl.load(total_ptr):
            return
        expert = tl.load(block_expert_ptr + pid_m)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        a = tl.load(sorted_ptr + rows)
        row_ok = a < n_assign
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < hidden
        out_ptrs = out_ptr + a.to(tl.int64)[:, None] * stride_ot + cols[None, :]
        out_mask = row_ok[:, None] & col_ok[None, :]
        if expert >= num_experts:
            tl.store(out_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty), mask=out_mask)
            return
        ks = tl.arange(0, BLOCK_K)
        h_ptrs = h_ptr + a.to(tl.int64)[:, None] * stride_ht + ks[None, :]
        w_ptrs = (w_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64)[None, :] * stride_wn
                  + ks[:, None] * stride_wk)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            if EVEN_K:
                ha = tl.load(h_ptrs, mask=row_ok[:, None], other=0.0)
                wd = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
            else:
                k_ok = ks < inter - k0
                ha = tl.load(h_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                wd = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(ha, wd, acc=acc, input_precision=PRECISION)
            h_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
        dtype = out_ptr.dtype.element_ty
        wt = tl.load(weights_ptr + a, mask=row_ok, other=0.0).to(tl.float32)
        y = acc.to(dtype).to(tl.float32) * wt[:, None]  # the GEMM rounds, then the weight multiplies
        tl.store(out_ptrs, y.to(dtype), mask=out_mask)


if triton is not None:

    @triton.jit
    def _gate_up_vec_kernel(x_ptr, w_ptr, h_ptr, ids_ptr, hidden, inter, num_experts,
                            stride_xt, stride_xk, stride_we, stride_wn, stride_wk, stride_ht,
                            TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        enter(PDL)
        # The DIRECT path's gate/up as matrix-vector products on the CUDA cores: one assignment's row
        # against BLOCK_N gate and up rows (no 16-row tile of which 15 rows would be padding).
        num_n = tl.cdiv(inter, BLOCK_N)
        a, pid_n = tl.program_id(0) // num_n, tl.program_id(0) % num_n
        expert = tl.load(ids_ptr + a)
        if (expert < 0) | (expert >= num_experts):
            return
        tok = (a // TOP_K).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < inter
        ks = tl.arange(0, BLOCK_K)
        w_e = w_ptr + expert.to(tl.int64) * stride_we
        g_ptrs = w_e + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :] * stride_wk
        u_ptrs = w_e + (cols + inter).to(tl.int64)[:, None] * stride_wn + ks[None, :] * stride_wk
        x_ptrs = x_ptr + tok * stride_xt + ks * stride_xk
        acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k_ok = ks < hidden - k0
            xv = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)
            m = col_ok[:, None] & k_ok[None, :]
            acc_g += tl.sum(tl.load(g_ptrs, mask=m, other=0.0).to(tl.float32) * xv[None, :], 1)
            acc_u += tl.sum(tl.load(u_ptrs, mask=m, other=0.0).to(tl.float32) * xv[None, :], 1)
            x_ptrs += BLOCK_K * stride_xk
            g_ptrs += BLOCK_K * stride_wk
            u_ptrs += BLOCK_K * stride_wk
        dtype = h_ptr.dtype.element_ty  # rounded where transformers rounds (see _gate_up_kernel)
        gate = acc_g.to(dtype).to(tl.float32)
        up = acc_u.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        tl.store(h_ptr + a.to(tl.int64) * stride_ht + cols, (act * up).to(dtype), mask=col_ok)


if triton is not None:

    @triton.jit
    def _down_vec_kernel(h_ptr, w_ptr, y_ptr, weights_ptr, ids_ptr, hidden, inter, num_experts,
                         stride_ht, stride_we, stride_wn, stride_wk, stride_yt,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        enter(PDL)
        # The DIRECT path's down projection per assignment (matrix-vector): y[a] = weight[a] * (h[a] @
        # down_e^T) for BLOCK_N hidden columns, rounded as the sorted path rounds it; zeros for an
        # expert held elsewhere. One program per (assignment, N tile): k times the programs of a kernel
        # that loops over a token's experts, which is what the memory system needs at one token.
        num_n = tl.cdiv(hidden, BLOCK_N)
        a, pid_n = tl.program_id(0) // num_n, tl.program_id(0) % num_n
        expert = tl.load(ids_ptr + a)
        limit = tl.where((expert >= 0) & (expert < num_experts), inter, 0)
        expert = tl.where(limit > 0, expert, 0).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < hidden
        ks = tl.arange(0, BLOCK_K)
        h_ptrs = h_ptr + a.to(tl.int64) * stride_ht + ks
        w_ptrs = w_ptr + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :] * stride_wk
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k_ok = ks < limit - k0
            hv = tl.load(h_ptrs, mask=k_ok, other=0.0).to(tl.float32)
            wd = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(wd * hv[None, :], 1)
            h_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
        dtype = y_ptr.dtype.element_ty
        wt = tl.load(weights_ptr + a).to(tl.float32)
        tl.store(y_ptr + a.to(tl.int64) * stride_yt + cols, (acc.to(dtype).to(tl.float32) * wt).to(dtype), mask=col_ok)

    @triton.jit
    def _sum_k_kernel(y_ptr, out_ptr, hidden, stride_yt, stride_ot, TOP_K: tl.constexpr, BLOCK: tl.constexpr,
                      PDL: tl.constexpr):
        enter(PDL)
        # out[t] = sum over the token's k rows of y, in float32, in slot order
        num_n = tl.cdiv(hidden, BLOCK)
        tok, pid_n = tl.program_id(0) // num_n, tl.program_id(0) % num_n
        cols = pid_n * BLOCK + tl.arange(0, BLOCK)
        ok = cols < hidden
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            total += tl.load(y_ptr + (tok * TOP_K + j).to(tl.int64) * stride_yt + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + tok.to(tl.int64) * stride_ot + cols, total.to(out_ptr.dtype.element_ty), mask=ok)


def _fused_moe_direct(x, w_gate_up, w_down, topk_ids, topk_weights, cfg, precision, sum_k=True):
    """A few tokens: no sorting. Gate/up per assignment (16-row tensor-core tiles, or matrix-vector
    products with VEC), then the down projection per assignment (matrix-vector) and the sum over k
    (`sum_k` False: left to the caller, [T, k, H]; the next add+RMSNorm sums them the same way)."""
    t, hidden = x.shape
    num_experts, two_i, _ = w_gate_up.shape
    inter, k = two_i // 2, topk_ids.shape[1]
    n = t * k
    ids = topk_ids.reshape(-1).contiguous()
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    launch = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    h = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    strides = (x.stride(0), x.stride(1), w_gate_up.stride(0), w_gate_up.stride(1), w_gate_up.stride(2), h.stride(0))
    if cfg.get("VEC"):
        _gate_up_vec_kernel[(n * triton.cdiv(inter, bn),)](
            x, w_gate_up, h, ids, hidden, inter, num_experts, *strides, TOP_K=k, BLOCK_N=bn, BLOCK_K=bk, **launch,
            **pdl.args())
    else:
        _gate_up_kernel[(n * triton.cdiv(inter, bn),)](
            x, w_gate_up, h, ids, ids, ids, n, n, hidden, inter, num_experts, *strides,
            TOP_K=k, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, EVEN_K=hidden % bk == 0,
            PRECISION=precision, DIRECT=True, **launch, **pdl.args())
    dbn, dbk = cfg.get("DOWN_BLOCK_N", 8), cfg.get("DOWN_BLOCK_K", 256)
    weights = topk_weights.reshape(-1).contiguous()
    y = torch.empty(n, hidden, dtype=x.dtype, device=x.device)  # per assignment, then the sum over k
    _down_vec_kernel[(n * triton.cdiv(hidden, dbn),)](
        h, w_down, y, weights, ids, hidden, inter, num_experts,
        h.stride(0), w_down.stride(0), w_down.stride(1), w_down.stride(2), y.stride(0),
        BLOCK_N=dbn, BLOCK_K=dbk, num_warps=cfg.get("DOWN_WARPS", 4),
        num_stages=cfg.get("DOWN_STAGES", cfg["num_stages"]), **pdl.args())
    return sum_over_k(y.view(t, k, hidden)) if sum_k else y.view(t, k, hidden)


def sum_over_k(y: torch.Tensor) -> torch.Tensor:
    """[T, k, H] -> [T, H]: each token's k rows summed in float32 in slot order, rounded once (the DIRECT
    path's own sum)."""
    t, k, hidden = y.shape
    if triton is None or not y.is_cuda:
        return y.float().sum(1).to(y.dtype)
    y = y.contiguous().view(t * k, hidden)
    out = torch.empty(t, hidden, dtype=y.dtype, device=y.device)
    _sum_k_kernel[(t * triton.cdiv(hidden, 1024),)](y, out, hidden, y.stride(0), out.stride(0), TOP_K=k,
                                                     BLOCK=1024, num_warps=4, **pdl.args())
    return out


def _fused_moe_triton(x, w_gate_up, w_down, topk_ids, topk_weights, config, sum_k=True):
    t, hidden = x.shape
    num_experts, two_i, _ = w_gate_up.shape
    inter = two_i // 2
    k = topk_ids.shape[1]
    n = t * k
    assert w_gate_up.dtype == x.dtype == w_down.dtype, "x and the expert weights share one dtype"
    assert w_gate_up.shape[2] == hidden and tuple(w_down.shape) == (num_experts, hidden, inter)
    if n == 0:
        return torch.zeros_like(x)
    cfg = config or moe_config(t, k, num_experts, hidden, inter)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # float32 tests keep full-precision dots
    if cfg.get("DIRECT"):
        return _fused_moe_direct(x, w_gate_up, w_down, topk_ids, topk_weights, cfg, precision, sum_k)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    sorted_ids, expert_of_block, total = align_by_expert(topk_ids, num_experts, bm)
    blocks = expert_of_block.numel()
    launch = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    h = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(blocks * triton.cdiv(inter, bn),)](
        x, w_gate_up, h, sorted_ids, expert_of_block, total, n, blocks, hidden, inter, num_experts,
        x.stride(0), x.stride(1), w_gate_up.stride(0), w_gate_up.stride(1), w_gate_up.stride(2), h.stride(0),
        TOP_K=k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"], EVEN_K=hidden % bk == 0,
        PRECISION=precision, DIRECT=False, **launch, **pdl.args())
    out = torch.empty(n, hidden, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()
    _down_kernel[(blocks * triton.cdiv(hidden, bn),)](
        h, w_down, out, weights, sorted_ids, expert_of_block, total, n, blocks, hidden, inter, num_experts,
        h.stride(0), w_down.stride(0), w_down.stride(1), w_down.stride(2), out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"], EVEN_K=inter % bk == 0,
        PRECISION=precision, **launch, **pdl.args())
    return out.view(t, k, hidden).sum(1)  # each row in a fixed order: deterministic, no atomics


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, config: dict | None = None, sum_k: bool = True) -> torch.Tensor:
    """The MoE layer's experts: x [T, H] -> [T, H] in x's dtype. Triton on CUDA, else `moe_reference`.
    `config` overrides `moe_config`'s tiles (the benchmark sweeps them). `sum_k` False lets the few-token
    path return its k weighted rows per token unsummed, [T, k, H] (one kernel less: the model's next
    add+RMSNorm sums them, `sum_over_k`'s arithmetic); the other paths return [T, H] whatever it says."""
    if triton is None or not x.is_cuda:
        return moe_reference(x, w_gate_up, w_down, topk_ids, topk_weights)
    return _fused_moe_triton(x, w_gate_up, w_down, topk_ids, topk_weights, config, sum_k)
