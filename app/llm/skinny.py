"""Linear layers for one or two rows (single-stream decode) as matrix-vector products in Triton.

At one token a projection only streams its weight once, so memory bandwidth is the whole cost; cuBLAS
picks split-K tiles there that reached about half of it for the 30B-A3B shape's o-projection and qkv
on an H100 (benchmarks/results/2026-11-27-models-beyond-one-gpu.md). Here each program reads BLOCK_N
weight rows once for both rows of x, accumulates in float32 and rounds once, like F.linear. Opt-in
(`llm.skinny_gemm`) until a device run has measured it against cuBLAS on every shape it would serve.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

MAX_ROWS = 2  # the rows the kernel takes at once; more rows go to F.linear


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, enabled: bool = True
           ) -> torch.Tensor:
    """F.linear, through the matrix-vector kernel when `enabled` and x has at most MAX_ROWS rows on CUDA."""
    if not enabled or triton is None or not x.is_cuda or x.shape[0] > MAX_ROWS or x.dim() != 2:
        return F.linear(x, weight, bias)
    return _matvec(x, weight, bias)


def _block_n(n: int, programs: int = 128) -> int:
    """Weight rows per program: 8, or fewer so that a small layer (the MoE router's 128 rows) still
    spreads over about `programs` SMs; at least 2."""
    bn = 8
    while bn > 2 and -(-n // bn) < programs:
        bn //= 2
    return bn


def _matvec(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, block_n: int | None = None,
            block_k: int = 256, num_warps: int = 4) -> torch.Tensor:
    t, k = x.shape
    n = weight.shape[0]
    block_n = block_n or _block_n(n)
    assert weight.shape[1] == k and weight.stride(1) == 1, "weight [N, K], rows contiguous"
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    _matvec_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, t, n, k, x.stride(0), x.stride(1), weight.stride(0),
        y.stride(0), HAS_BIAS=bias is not None, ROWS=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=3)
    return y


if triton is not None:

    @triton.jit
    def _matvec_kernel(x_ptr, w_ptr, b_ptr, y_ptr, t, n, k, stride_xt, stride_xk, stride_wn, stride_yt,
                       HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # y[r, cols] = x[r] @ w[cols]^T (+ b[cols]) for every row r < t, BLOCK_N weight rows per program
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        rows = tl.arange(0, ROWS)
        row_ok = rows < t
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            k_ok = (k0 + ks) < k
            xv = tl.load(x_ptr + rows[:, None] * stride_xt + (k0 + ks)[None, :] * stride_xk,
                         mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            wv = tl.load(w_ptr + cols.to(tl.int64)[:, None] * stride_wn + (k0 + ks)[None, :],
                         mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(xv[:, None, :] * wv[None, :, :], 2)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rows[:, None] * stride_yt + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])
