"""MiniCPM-V's resampler attention, with its key and value projections folded into the learned queries.

The resampler's queries do not depend on the input, so the attention's linear maps can be
re-associated around them (`folded_attention` derives it): the scores become one GEMM against the
queries folded through the key projection (built once at load), the values one GEMM of the
probabilities against the normed inputs, half the work of the published forward for one 448^2 slice
and no [N, E] key or value tensor. Equal-size slices only (`uniform` batches); slices of unequal
sizes keep the projected path (minicpmv_tower.py). `normed_keys` computes the normed inputs and the
keys in one pass (LayerNorm, then the 2-D sin-cos position of each key added), in place of a
LayerNorm and eight elementwise kernels.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only installs
    triton = None


def sincos_frequencies(embed_dim: int) -> torch.Tensor:
    """The resampler's 1-D sin-cos frequencies for one coordinate (embed_dim / 4 of them), computed in
    float32 exactly as the published numpy code does."""
    omega = np.arange(embed_dim // 4, dtype=np.float32)
    omega /= embed_dim / 4
    return torch.from_numpy(1.0 / 10000**omega)


def key_positions(rc: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
    """2-D sin-cos embedding [N, E] of each patch's (row, col): column half first, then row half."""
    ang = rc[:, :, None] * omega  # [N, 2, E/4], float32 products as the published numpy code
    row, col = ang.unbind(1)
    return torch.cat([col.sin(), col.cos(), row.sin(), row.cos()], dim=-1)


# ---------------------------------------------------------------------------- x and keys in one pass
def normed_keys_torch(y: torch.Tensor, ln: torch.nn.LayerNorm, rc: torch.Tensor, omega: torch.Tensor):
    """(x, keys) = (ln(y), ln(y) + positions), with the published op order and roundings."""
    x = ln(y)
    return x, x + key_positions(rc, omega).to(x.dtype)


if triton is not None:

    @triton.jit
    def _keys_quarter(x_ptr, k_ptr, w_ptr, b_ptr, base, off, k, live, diff, rstd, pos):
        """One quarter of a row: x = the normed value, keys = x + its position term."""
        w = tl.load(w_ptr + off + k, mask=live, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + off + k, mask=live, other=0.0).to(tl.float32)
        x = diff * rstd * w + b
        tl.store(x_ptr + base + off + k, x.to(x_ptr.dtype.element_ty), mask=live)
        tl.store(k_ptr + base + off + k, (x + pos).to(k_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _normed_keys_kernel(y_ptr, w_ptr, b_ptr, rc_ptr, omega_ptr, x_ptr, k_ptr, eps, E: tl.constexpr,
                            QW: tl.constexpr, QB: tl.constexpr):
        # The row in its four quarters (sin(col), cos(col), sin(row), cos(row) times omega[k]), so that
        # each element evaluates one accurate sine or cosine, not both.
        row = tl.program_id(0).to(tl.int64)
        base = row * E
        k = tl.arange(0, QB)
        live = k < QW
        y0 = tl.load(y_ptr + base + k, mask=live, other=0.0).to(tl.float32)
        y1 = tl.load(y_ptr + base + QW + k, mask=live, other=0.0).to(tl.float32)
        y2 = tl.load(y_ptr + base + 2 * QW + k, mask=live, other=0.0).to(tl.float32)
        y3 = tl.load(y_ptr + base + 3 * QW + k, mask=live, other=0.0).to(tl.float32)
        mean = (tl.sum(y0, axis=0) + tl.sum(y1, axis=0) + tl.sum(y2, axis=0) + tl.sum(y3, axis=0)) / E
        d0, d1 = tl.where(live, y0 - mean, 0.0), tl.where(live, y1 - mean, 0.0)
        d2, d3 = tl.where(live, y2 - mean, 0.0), tl.where(live, y3 - mean, 0.0)
        var = (tl.sum(d0 * d0, axis=0) + tl.sum(d1 * d1, axis=0) + tl.sum(d2 * d2, axis=0)
               + tl.sum(d3 * d3, axis=0)) / E
        rstd = 1.0 / tl.sqrt(var + eps)
        omega = tl.load(omega_ptr + k, mask=live, other=0.0)
        ac = tl.load(rc_ptr + row * 2 + 1) * omega  # float32 products, as the published numpy code
        ar = tl.load(rc_ptr + row * 2) * omega
        _keys_quarter(x_ptr, k_ptr, w_ptr, b_ptr, base, 0, k, live, d0, rstd, libdevice.sin(ac))
        _keys_quarter(x_ptr, k_ptr, w_ptr, b_ptr, base, QW, k, live, d1, rstd, libdevice.cos(ac))
        _keys_quarter(x_ptr, k_ptr, w_ptr, b_ptr, base, 2 * QW, k, live, d2, rstd, libdevice.sin(ar))
        _keys_quarter(x_ptr, k_ptr, w_ptr, b_ptr, base, 3 * QW, k, live, d3, rstd, libdevice.cos(ar))

    @triton.jit
    def _softmax_rows_kernel(s_ptr, p_ptr, length, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        live = cols < length
        s = tl.load(s_ptr + row * length + cols, mask=live, other=float("-inf"))
        e = tl.exp(s - tl.max(s, axis=0))
        tl.store(p_ptr + row * length + cols, (e / tl.sum(e, axis=0)).to(p_ptr.dtype.element_ty), mask=live)


def normed_keys(y: torch.Tensor, ln: torch.nn.LayerNorm, rc: torch.Tensor, omega: torch.Tensor):
    """`normed_keys_torch` on CUDA in one Triton pass (float32 math, one rounding per output)."""
    if triton is None or not y.is_cuda:
        return normed_keys_torch(y, ln, rc, omega)
    n, e = y.shape
    x, keys = torch.empty_like(y), torch.empty_like(y)
    _normed_keys_kernel[(n,)](y, ln.weight, ln.bias, rc, omega, x, keys, ln.eps, e, e // 4,
                              triton.next_power_of_2(e // 4), num_warps=8 if e >= 2048 else 4)
    return x, keys


SOFTMAX_MAX_LENGTH = 16384  # rows up to this long fit one Triton program; longer ones take torch's kernels


def softmax_rows(s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """softmax over the last dim of float32 scores [R, L], rounded once to `dtype` (the probabilities'
    dtype for the next GEMM); one Triton kernel on CUDA instead of a softmax and a cast."""
    rows, length = s.shape
    if triton is None or not s.is_cuda or length > SOFTMAX_MAX_LENGTH:
        return torch.softmax(s, dim=-1).to(dtype)
    p = torch.empty(rows, length, dtype=dtype, device=s.device)
    block = triton.next_power_of_2(length)
    _softmax_rows_kernel[(rows,)](s, p, length, block, num_warps=8 if block >= 4096 else 4)
    return p


# ---------------------------------------------------------------------------- the folded attention
@torch.no_grad()
def fold_queries(queries: torch.Tensor, key_weight: torch.Tensor) -> torch.Tensor:
    """`Qk` [H Q, E]: each head's projected queries [H, Q, d] through that head's rows of the key
    projection [E, E], with the softmax scale 1/sqrt(d); computed in float32 (or wider), stored in
    the weights' dtype. Rows are (head, query)."""
    heads, nq, d = queries.shape
    wide = torch.promote_types(key_weight.dtype, torch.float32)
    w = key_weight.to(wide).view(heads, d, -1)
    return (queries.to(wide) @ w * d**-0.5).reshape(heads * nq, -1).to(key_weight.dtype)


@functools.cache
def _mm_float32_out(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch.mm can write float32 from `dtype` inputs here (CUDA's bf16/fp16 GEMMs can)."""
    try:
        a = torch.zeros(2, 2, dtype=dtype, device=device)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def _scores(qk: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """qk @ keys^T, from bf16/fp16 in float32: accumulated in float32 and not rounded to 16 bits before
    the softmax."""
    if qk.dtype not in (torch.bfloat16, torch.float16):
        return qk @ keys.t()
    if _mm_float32_out(qk.device, qk.dtype):
        return torch.mm(qk, keys.t(), out_dtype=torch.float32)
    return (qk @ keys.t()).float()


def folded_attention(qk: torch.Tensor, x: torch.Tensor, keys: torch.Tensor, value_weight: torch.Tensor,
                     value_bias: torch.Tensor, heads: int, uniform: tuple[int, int]) -> torch.Tensor:
    """Each of `uniform` = (slices, length) slices' H Q queries against its own keys -> [slices, Q, E]
    (the published attention's output before out_proj). x, keys [slices * length, E].

    With x = ln_kv(kv_proj(feats)) (N keys, E wide), keys = x + pos, H heads of d = E / H, Q queries
    per head and q_h the projected queries (scale 1/sqrt(d) included):

        scores_h = q_h (W_k,h keys + b_k,h)^T = (q_h W_k,h) keys^T + const      (one row per query)
        out_h    = P_h (x W_v,h^T + b_v,h)    = (P_h x) W_v,h^T + b_v,h         (rows of P_h sum to 1)

    `const` (q_h . b_k,h) is the same for every key of a query, so softmax drops it. The published
    forward projects every key and value through E x E weights: 2 N E^2 multiply-adds. Folded, the
    scores are one GEMM against `Qk` = [q_h W_k,h for each head] (H Q = E / 2 rows, `fold_queries`,
    built once at load) and the values one GEMM of the probabilities against x, then a small per-head
    GEMM: N E (H Q) + (H Q) N E + H Q E d, half the work for one 448^2 slice (1024 keys, E = 4096).
    Each slice's probabilities multiply its own keys, a loop over the batch's (static) slice count;
    for slices of unequal sizes a block-diagonal probability matrix would cost slices x keys."""
    slices, length = uniform
    e = x.shape[1]
    d = e // heads
    nq = qk.shape[0] // heads
    wv = value_weight.view(heads, d, e).transpose(1, 2)  # [H, E, d]
    bv = value_bias.view(heads, 1, d)
    out = x.new_empty(slices, nq, heads, d)
    for i in range(slices):
        rows = slice(i * length, (i + 1) * length)
        p = softmax_rows(_scores(qk, keys[rows]), x.dtype)  # [H Q, length]
        z = (p @ x[rows]).view(heads, nq, e)  # probability-weighted x per (head, query)
        out[i].copy_(torch.baddbmm(bv, z, wv).transpose(0, 1))  # [H, Q, d] -> [Q, H, d]
    return out.view(slices, nq, e)

