"""Fused elementwise kernels for the tower on CUDA (Triton), with exact torch fallbacks.

Profiling the reference tower showed that the GEMMs take under half of its GPU time: the rest
is a dozen small elementwise kernels per layer (float32 rotary with concatenations, separate bias
and residual adds, layer norms). Two Triton kernels remove most of them:

- `rotary_qk`: q and k straight from the qkv GEMM output, rotated in float32, written once.
- `add_bias_layernorm`: x + y + bias (the residual), and the next layer norm of it, in one pass.

Both follow the reference's rounding points (bf16 storage, float32 math). Qwen2.5-VL's tower
(RMSNorm, SwiGLU) has two more: `add_bias_rmsnorm` (the residual add and the next RMSNorm in one pass)
and `silu_mul` (SwiGLU's activation over one fused gate/up GEMM output).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


def triton_available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


# ---------------------------------------------------------------------------- torch fallbacks
def rotary_qk_torch(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int):
    """qkv [N, 3*H*D]; cos/sin [N, D/2] float32 -> q, k [N, H, D] in qkv's dtype."""
    n = qkv.shape[0]
    q, k, _ = qkv.view(n, 3, heads, -1).unbind(1)
    c, s = cos[:, None, :], sin[:, None, :]

    def rot(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(qkv.dtype)

    return rot(q), rot(k)


def add_bias_layernorm_torch(x, y, bias, ln_weight, ln_bias, eps, rows=None, residual_dtype=None):
    """Residual `x` may be float32 (kept in full precision); the normed output takes y's dtype (x's
    without a y). With `rows`, x is a table and row i of the sum reads x[rows[i]]; the residual comes
    out in `residual_dtype` (default: x's)."""
    if rows is not None:
        x = x.index_select(0, rows)
    s = x.float() + (y.float() if y is not None else 0.0) + (bias.float() if bias is not None else 0.0)
    out_dtype = residual_dtype or x.dtype
    if ln_weight is None:
        return s.to(out_dtype), None
    h = F.layer_norm(s, (s.shape[-1],), ln_weight.float(), ln_bias.float(), eps)
    return s.to(out_dtype), h.to((y if y is not None else x).dtype)


def normalize_rows_torch(px, scale, offset, dtype, pad=0, rows=None):
    """uint8 pixel rows -> px * scale + offset in float32 (the processor's rescale and normalise per
    column), rounded once to `dtype`; gathered by `rows` and widened by `pad` zero columns if given."""
    if rows is not None:
        px = px.index_select(0, rows)
    out = (px.float() * scale + offset).to(dtype)
    return F.pad(out, (0, pad)) if pad else out


def add_bias_rmsnorm_torch(x, y, bias, weight, eps):
    """(x + y + bias, rms_norm(that) * weight); y and bias may be None; no norm when weight is None.
    The residual keeps x's dtype; the normed output takes the weight's dtype."""
    s = x.float()
    if y is not None:
        s = s + y.float()
    if bias is not None:
        s = s + bias.float()
    if weight is None:
        return s.to(x.dtype), None
    h = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return s.to(x.dtype), h.to(weight.dtype)


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2I] (gate, then up) -> silu(gate) * up [N, I]."""
    g, u = gate_up.chunk(2, dim=-1)
    return F.silu(g) * u


if triton is not None:

    @triton.jit
    def _add_rms_kernel(x_ptr, y_ptr, b_ptr, w_ptr, out_x_ptr, out_h_ptr, eps, C: tl.constexpr, BLOCK: tl.constexpr,
                        HAS_Y: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < C
        s = tl.load(x_ptr + row * C + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_Y:
            s += tl.load(y_ptr + row * C + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            s += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_x_ptr + row * C + cols, s.to(out_x_ptr.dtype.element_ty), mask=mask)
        if HAS_NORM:
            rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / C + eps)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_h_ptr + row * C + cols, (s * rstd * w).to(out_h_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        g = tl.load(gu_ptr + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
        out = g / (1.0 + tl.exp(-g)) * u
        tl.store(out_ptr + row * inter + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotary_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, H: tl.constexpr, D: tl.constexpr,
                       HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
        n = tl.program_id(0)
        which = tl.program_id(1)  # 0 = q, 1 = k
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_HALF)[None, :]
        mask = (h < H) & (d < HALF)
        src = qkv_ptr + n * 3 * H * D + which * H * D + h * D + d
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + n * HALF + d, mask=d < HALF, other=0.0)
        s = tl.load(sin_ptr + n * HALF + d, mask=d < HALF, other=0.0)
        o1 = x1 * c - x2 * s
        o2 = x2 * c + x1 * s
        off = n * H * D + h * D + d
        if which == 0:
            tl.store(q_ptr + off, o1.to(q_ptr.dtype.element_ty), mask=mask)
            tl.store(q_ptr + off + HALF, o2.to(q_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(k_ptr + off, o1.to(k_ptr.dtype.element_ty), mask=mask)
            tl.store(k_ptr + off + HALF, o2.to(k_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _normalize_rows_kernel(px_ptr, scale_ptr, off_ptr, rows_ptr, out_ptr, C: tl.constexpr, CO: tl.constexpr,
                               BLOCK: tl.constexpr, HAS_ROWS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        src = tl.load(rows_ptr + row).to(tl.int64) if HAS_ROWS else row
        cols = tl.arange(0, BLOCK)
        live = cols < C
        px = tl.load(px_ptr + src * C + cols, mask=live, other=0).to(tl.float32)
        val = px * tl.load(scale_ptr + cols, mask=live, other=0.0) + tl.load(off_ptr + cols, mask=live, other=0.0)
        tl.store(out_ptr + row * CO + cols, tl.where(live, val, 0.0).to(out_ptr.dtype.element_ty), mask=cols < CO)

    @triton.jit
    def _add_ln_kernel(x_ptr, y_ptr, b_ptr, w_ptr, lb_ptr, rows_ptr, out_x_ptr, out_h_ptr, eps, C: tl.constexpr,
                       BLOCK: tl.constexpr, HAS_Y: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LN: tl.constexpr,
                       HAS_ROWS: tl.constexpr):
        row = tl.program_id(0)
        src = tl.load(rows_ptr + row).to(tl.int64) if HAS_ROWS else row
        cols = tl.arange(0, BLOCK)
        mask = cols < C
        s = tl.load(x_ptr + src * C + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_Y:
            s += tl.load(y_ptr + row * C + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            s += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_x_ptr + row * C + cols, s.to(out_x_ptr.dtype.element_ty), mask=mask)
        if HAS_LN:
            v = s
            mean = tl.sum(v, axis=0) / C
            diff = tl.where(mask, v - mean, 0.0)
            var = tl.sum(diff * diff, axis=0) / C
            rstd = 1.0 / tl.sqrt(var + eps)
            w = tl.load(w_ptr + cols, mask=mask, other=1.0).to(tl.float32)
            lb = tl.load(lb_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_h_ptr + row * C + cols, (diff * rstd * w + lb).to(out_h_ptr.dtype.element_ty), mask=mask)


def rotary_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int):
    if not triton_available(qkv.device):
        return rotary_qk_torch(qkv, cos, sin, heads)
    n = qkv.shape[0]
    d = qkv.shape[1] // (3 * heads)
    q = torch.empty(n, heads, d, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty_like(q)
    _rotary_kernel[(n, 2)](qkv, cos, sin, q, k, heads, d, d // 2, triton.next_power_of_2(heads),
                           triton.next_power_of_2(d // 2), num_warps=4)
    return q, k


def add_bias_layernorm(x, y, bias, ln_weight, ln_bias, eps: float, rows=None, residual_dtype=None):
    """(x + y + bias, layer_norm(that)); the norm is skipped (None) when ln_weight is None, the add of
    y when y is None.

    The residual x keeps its dtype (float32 in the fused tower: one rounding less per layer than
    the reference); the normed output, which feeds the next GEMM, takes y's dtype (x's without a y).
    With `rows`, x is a table gathered row by row (a learned position embedding) and the residual
    comes out in `residual_dtype`.
    """
    if not triton_available(x.device):
        return add_bias_layernorm_torch(x, y, bias, ln_weight, ln_bias, eps, rows, residual_dtype)
    n = rows.shape[0] if rows is not None else x.shape[0]
    c = x.shape[1]
    out_x = torch.empty(n, c, dtype=residual_dtype or x.dtype, device=x.device)
    out_h = torch.empty(n, c, dtype=(y if y is not None else x).dtype, device=x.device) if ln_weight is not None else None
    block = triton.next_power_of_2(c)
    _add_ln_kernel[(n,)](x, y if y is not None else x, bias if bias is not None else x,
                         ln_weight if ln_weight is not None else x, ln_bias if ln_bias is not None else x,
                         rows if rows is not None else x, out_x, out_h if out_h is not None else out_x, eps, c, block,
                         y is not None, bias is not None, ln_weight is not None, rows is not None,
                         num_warps=8 if block >= 2048 else 4)
    return out_x, out_h


def normalize_rows(px, scale, offset, dtype, pad: int = 0, rows=None):
    """`normalize_rows_torch` in one pass on CUDA (a float copy, a multiply, an add, a cast, a pad and a
    gather were a kernel each)."""
    if not triton_available(px.device):
        return normalize_rows_torch(px, scale, offset, dtype, pad, rows)
    c = px.shape[1]
    n = rows.shape[0] if rows is not None else px.shape[0]
    out = torch.empty(n, c + pad, dtype=dtype, device=px.device)
    _normalize_rows_kernel[(n,)](px, scale, offset, rows if rows is not None else px, out, c, c + pad,
                                 triton.next_power_of_2(c + pad), rows is not None, num_warps=4)
    return out


def linear_gelu_tanh(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x @ W.T + b) with the GEMM's fused bias+GELU epilogue where cuBLASLt has one."""
    if x.is_cuda:
        return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")


PAD_MULTIPLE = 64  # MLP widths are padded to this with zero units (exact): down_projection.py says why


def padded_width(width: int) -> int:
    return -(-width // PAD_MULTIPLE) * PAD_MULTIPLE


def pad_mlp(fc1_weight: torch.Tensor, fc1_bias: torch.Tensor | None, fc2_weight: torch.Tensor,
            halves: int = 1) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """An MLP's hidden width rounded up to PAD_MULTIPLE with zero rows in fc1 (and its bias) and zero
    columns in fc2: each extra unit is act(0) = 0 (GELU, or SiLU(0) * 0) and adds exactly nothing.
    `halves` = 2 for a fused [gate; up] fc1, each half padded. Returns new (fc1 weight, fc1 bias, fc2
    weight); unchanged tensors when the width is already a multiple."""
    width = fc2_weight.shape[1]
    wide = padded_width(width)
    if wide == width:
        return fc1_weight, fc1_bias, fc2_weight
    w1 = fc1_weight.new_zeros(halves * wide, fc1_weight.shape[1])
    b1 = fc1_bias.new_zeros(halves * wide) if fc1_bias is not None else None
    for i in range(halves):
        w1[i * wide:i * wide + width] = fc1_weight[i * width:(i + 1) * width]
        if b1 is not None:
            b1[i * wide:i * wide + width] = fc1_bias[i * width:(i + 1) * width]
    w2 = fc2_weight.new_zeros(fc2_weight.shape[0], wide)
    w2[:, :width] = fc2_weight
    return w1, b1, w2


def pad_mlp_modules(fc1: torch.nn.Linear | tuple[torch.nn.Linear, ...], fc2: torch.nn.Linear
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`pad_mlp` for Linear modules, whose parameters become views of the padded tensors (their
    published names and values stay; no memory is added). `fc1` may be several modules (a SwiGLU's
    (gate, up)): they become one fused weight, each part padded. Returns (fc1 weight, fc1 bias, fc2
    weight)."""
    parts = fc1 if isinstance(fc1, tuple) else (fc1,)
    width = fc2.weight.shape[1]
    def joined(tensors: list[torch.Tensor]) -> torch.Tensor:  # one module's own tensor: no copy
        return tensors[0] if len(tensors) == 1 else torch.cat(tensors)

    w1, b1, w2 = pad_mlp(joined([m.weight.data for m in parts]), joined([m.bias.data for m in parts]),
                         fc2.weight.data, halves=len(parts))
    wide = w2.shape[1]
    for i, m in enumerate(parts):
        m.weight.data, m.bias.data = w1[i * wide:i * wide + width], b1[i * wide:i * wide + width]
    fc2.weight.data = w2[:, :width]
    return w1, b1, w2


def add_bias_rmsnorm(x, y, bias, weight, eps: float):
    """Fused `add_bias_rmsnorm_torch`: one pass over the row, float32 math, one rounding of each output."""
    if not triton_available(x.device):
        return add_bias_rmsnorm_torch(x, y, bias, weight, eps)
    n, c = x.shape
    out_x = torch.empty_like(x)
    out_h = torch.empty(n, c, dtype=weight.dtype, device=x.device) if weight is not None else None
    block = triton.next_power_of_2(c)
    _add_rms_kernel[(n,)](x, y if y is not None else x, bias if bias is not None else x,
                          weight if weight is not None else x, out_x, out_h if out_h is not None else out_x, eps, c,
                          block, y is not None, bias is not None, weight is not None,
                          num_warps=8 if block >= 2048 else 4)
    return out_x, out_h


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if not triton_available(gate_up.device):
        return silu_mul_torch(gate_up)
    n, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty(n, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(n, triton.cdiv(inter, block))](gate_up, out, inter, block, num_warps=4)
    return out
