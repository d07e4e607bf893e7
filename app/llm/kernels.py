"""Fused elementwise kernels for the text model on CUDA (Triton), with torch versions for the CPU.

A decode step at batch 1 moves the weights once but would launch a few hundred kernels: transformers'
layer runs about forty, most tiny, each costing microseconds even inside a CUDA graph
(benchmarks/results/2026-11-21-llm-engine.md). Three kernels take most of them away: `add_rmsnorm`
(the residual add and the next RMSNorm, one pass), `qk_norm_rope_store` (q/k RMSNorm for Qwen3, the
rotary embedding, and the new keys and values written into their KV-cache slots, straight from the
fused qkv GEMM's output) and `silu_mul` (SwiGLU's activation). All three round where transformers'
modules round (bf16 storage, float32 arithmetic inside one op), so the torch versions below are the
reference the GPU tests hold them to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import pdl
from .fused_moe import sum_over_k
from .pdl import enter

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


def use_triton(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


# ---------------------------------------------------------------------------- torch versions
def rmsnorm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed


def add_rmsnorm_torch(residual: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor, eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + x, rmsnorm of it). With x None: (residual, rmsnorm(residual))."""
    s = residual if x is None else residual + x
    return s, rmsnorm_torch(s, weight, eps)


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, D/2] in x's dtype. transformers' `q * cos + rotate_half(q) * sin`."""
    c = torch.cat((cos, cos), -1)[:, None, :]
    s = torch.cat((sin, sin), -1)[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * c + torch.cat((-x2, x1), -1) * s


def qk_norm_rope_store_torch(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, slots, heads, kv_heads, eps):
    """qkv [T, (H + 2 KV) D] -> q [T, H, D]; rotated k and v go into k_cache/v_cache [slots, KV, D]."""
    t = qkv.shape[0]
    d = k_cache.shape[-1]
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k, v = q.reshape(t, heads, d), k.reshape(t, kv_heads, d), v.reshape(t, kv_heads, d)
    if q_norm is not None:
        q, k = rmsnorm_torch(q, q_norm, eps), rmsnorm_torch(k, k_norm, eps)
    q, k = rope_torch(q, cos, sin), rope_torch(k, cos, sin)
    k_cache[slots] = k
    v_cache[slots] = v
    return q


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---------------------------------------------------------------------------- Triton
if triton is not None:

    @triton.jit
    def _add_rmsnorm_kernel(res_ptr, x_ptr, w_ptr, out_ptr, n, eps, HAS_X: tl.constexpr, X_ROWS: tl.constexpr,
                            BLOCK: tl.constexpr, PDL: tl.constexpr):
        enter(PDL)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        r = tl.load(res_ptr + row * n + cols, mask=mask, other=0.0)
        if HAS_X:
            if X_ROWS == 1:
                x = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0)
            else:  # x's X_ROWS rows per token (an MoE block's k experts, unsummed): summed as sum_over_k does
                acc = tl.zeros((BLOCK,), dtype=tl.float32)
                for j in tl.static_range(X_ROWS):
                    acc += tl.load(x_ptr + (row * X_ROWS + j).to(tl.int64) * n + cols, mask=mask,
                                   other=0.0).to(tl.float32)
                x = acc.to(r.dtype)
            r = (r.to(tl.float32) + x.to(tl.float32)).to(r.dtype)
            tl.store(res_ptr + row * n + cols, r, mask=mask)
        rf = r.to(tl.float32)
        var = tl.sum(rf * rf, axis=0) / n
        normed = (rf * tl.rsqrt(var + eps)).to(r.dtype)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        tl.store(out_ptr + row * n + cols, (normed.to(tl.float32) * w.to(tl.float32)).to(r.dtype), mask=mask)

    @triton.jit
    def _norm_rope_heads(x1, x2, w_ptr, c, s, j, eps, D: tl.constexpr, HAS_NORM: tl.constexpr):
        """[heads, HALF] halves of a token's heads -> their rotated (and, for Qwen3, RMS-normed) halves,
        rounded where transformers' modules round."""
        dtype = x1.dtype
        if HAS_NORM:
            f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
            inv = tl.rsqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / D + eps)[:, None]
            w1 = tl.load(w_ptr + j).to(tl.float32)
            w2 = tl.load(w_ptr + (D // 2) + j).to(tl.float32)
            x1 = ((f1 * inv).to(dtype).to(tl.float32) * w1).to(dtype)
            x2 = ((f2 * inv).to(dtype).to(tl.float32) * w2).to(dtype)
        a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
        o1 = ((a1 * c).to(dtype).to(tl.float32) + (-(a2 * s)).to(dtype).to(tl.float32)).to(dtype)
        o2 = ((a2 * c).to(dtype).to(tl.float32) + (a1 * s).to(dtype).to(tl.float32)).to(dtype)
        return o1, o2

    @triton.jit
    def _qk_norm_rope_store_kernel(qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                                   slots_ptr, eps, H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr,
                                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr,
                                   HAS_NORM: tl.constexpr, PDL: tl.constexpr):
        enter(PDL)
        # One program per (token, q or k/v): every head of the token in one tile. A program per head
        # (one warp moving 256 bytes) left most of the memory bandwidth unused
        # (benchmarks/results/2026-11-23-overlapped-engine-steps.md).
        t = tl.program_id(0)
        row = qkv_ptr + t * (H + 2 * KV) * D
        j = tl.arange(0, HALF)[None, :]
        c = tl.load(cos_ptr + t * HALF + j).to(tl.float32)
        s = tl.load(sin_ptr + t * HALF + j).to(tl.float32)
        if tl.program_id(1) == 0:  # the query heads
            hq = tl.arange(0, BLOCK_H)[:, None]
            mq = (hq < H) & (j < HALF)
            q1 = tl.load(row + hq * D + j, mask=mq, other=0.0)
            q2 = tl.load(row + hq * D + HALF + j, mask=mq, other=0.0)
            q1, q2 = _norm_rope_heads(q1, q2, qn_ptr, c, s, j, eps, D, HAS_NORM)
            out = q_out_ptr + (t * H + hq) * D
            tl.store(out + j, q1, mask=mq)
            tl.store(out + HALF + j, q2, mask=mq)
        else:  # the key heads into their cache slot, the values beside them (each branch its own names:
            # Triton types a name once per function)
            hk = tl.arange(0, BLOCK_KV)[:, None]
            mk = (hk < KV) & (j < HALF)
            k1 = tl.load(row + (H + hk) * D + j, mask=mk, other=0.0)
            k2 = tl.load(row + (H + hk) * D + HALF + j, mask=mk, other=0.0)
            k1, k2 = _norm_rope_heads(k1, k2, kn_ptr, c, s, j, eps, D, HAS_NORM)
            slot = tl.load(slots_ptr + t).to(tl.int64)
            dst = k_cache_ptr + (slot * KV + hk) * D
            tl.store(dst + j, k1, mask=mk)
            tl.store(dst + HALF + j, k2, mask=mk)
            d = tl.arange(0, D)[None, :]
            mv = (hk < KV) & (d < D)
            v = tl.load(row + (H + KV + hk) * D + d, mask=mv, other=0.0)
            tl.store(v_cache_ptr + (slot * KV + hk) * D + d, v, mask=mv)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
        enter(PDL)
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        g = tl.load(gu_ptr + row * 2 * inter + cols, mask=mask, other=0.0)
        u = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        tl.store(out_ptr + row * inter + cols, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


# ---------------------------------------------------------------------------- dispatch
def add_rmsnorm(residual: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (residual + x, rmsnorm(residual + x) * weight). On CUDA the sum is written into
    `residual` in place. x [T, k, n] (an MoE block's experts left unsummed) adds the sum of its k rows,
    taken in float32 and rounded once, as fused_moe.sum_over_k does."""
    if not use_triton(residual):
        if x is not None and x.dim() == 3:
            x = sum_over_k(x)
        return add_rmsnorm_torch(residual, x, weight, eps)
    t, n = residual.shape
    assert residual.is_contiguous() and (x is None or x.is_contiguous())  # summed in place, rows as t * n
    out = torch.empty_like(residual)
    _add_rmsnorm_kernel[(t,)](residual, x if x is not None else residual, weight, out, n, eps,
                              HAS_X=x is not None, X_ROWS=x.shape[1] if x is not None and x.dim() == 3 else 1,
                              BLOCK=triton.next_power_of_2(n), num_warps=8 if n > 2048 else 4, **pdl.args())
    return residual, out


def qk_norm_rope_store(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, slots, heads, kv_heads, eps):
    if not use_triton(qkv) or (k_cache.shape[-1] & (k_cache.shape[-1] - 1)):
        return qk_norm_rope_store_torch(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, slots, heads, kv_heads, eps)
    t = qkv.shape[0]
    d = k_cache.shape[-1]
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()  # the kernel indexes rows as t * width
    q = torch.empty(t, heads, d, dtype=qkv.dtype, device=qkv.device)
    if t:
        _qk_norm_rope_store_kernel[(t, 2)](
            qkv, q_norm if q_norm is not None else qkv, k_norm if k_norm is not None else qkv, cos, sin, q,
            k_cache, v_cache, slots, eps, H=heads, KV=kv_heads, D=d, HALF=d // 2,
            BLOCK_H=triton.next_power_of_2(heads), BLOCK_KV=triton.next_power_of_2(kv_heads),
            HAS_NORM=q_norm is not None, num_warps=4, **pdl.args())
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if not use_triton(gate_up):
        return silu_mul_torch(gate_up)
    gate_up = gate_up.contiguous()
    t, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty(t, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(t, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block, num_warps=4, **pdl.args())
    return out
