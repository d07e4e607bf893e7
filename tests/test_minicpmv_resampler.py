"""MiniCPM-V's resampler with its key and value projections folded into the queries
(app/vision/minicpmv_resampler.py), and the one-pass kernels of its tower's embedding and keys.

CPU: the fold against `nn.MultiheadAttention` as the published resampler calls it, in float64 (the
fold only re-associates linear maps and drops a per-query constant the softmax ignores, so the two
agree to float64 rounding), with biases that are not zero. GPU (marker `gpu`): the Triton kernels
against their torch versions, and the folded bf16 resampler against the projected one, both judged
by the projected float32 path.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from app.vision import kernels as K
from app.vision.minicpmv_resampler import (
    fold_queries,
    folded_attention,
    key_positions,
    normed_keys,
    normed_keys_torch,
    sincos_frequencies,
    softmax_rows,
)


def _attention(embed: int, heads: int, dtype=torch.float64, seed: int = 0) -> nn.MultiheadAttention:
    torch.manual_seed(seed)
    mha = nn.MultiheadAttention(embed, heads).to(dtype)
    with torch.no_grad():
        mha.in_proj_bias.normal_(0, 0.5)  # nonzero: the fold must handle b_k (dropped) and b_v (kept)
        mha.out_proj.bias.normal_(0, 0.5)
    return mha.eval()


def _projected_queries(mha: nn.MultiheadAttention, query: torch.Tensor) -> torch.Tensor:
    """The attention's query projection, [H, Q, d], as the tower computes it once at load."""
    e, heads = mha.embed_dim, mha.num_heads
    q = F.linear(query, mha.in_proj_weight[:e], mha.in_proj_bias[:e])
    return q.view(query.shape[0], heads, e // heads).transpose(0, 1).contiguous()


@pytest.mark.parametrize("uniform", [(1, 37), (3, 20)])
def test_folded_attention_equals_the_published_attention_in_float64(uniform):
    """Every slice's 64 queries against its own keys = ln_kv output + positions, values = ln_kv output:
    nn.MultiheadAttention(query, keys, values) per slice, as published, against out_proj(fold)."""
    e, heads, nq = 256, 2, 64
    slices, length = uniform
    mha = _attention(e, heads)
    g = torch.Generator().manual_seed(1)
    query = torch.randn(nq, e, generator=g, dtype=torch.float64)
    x = torch.randn(slices * length, e, generator=g, dtype=torch.float64)
    keys = x + torch.randn(slices * length, e, generator=g, dtype=torch.float64)
    qk = fold_queries(_projected_queries(mha, query), mha.in_proj_weight[e:2 * e])
    with torch.no_grad():
        folded = mha.out_proj(folded_attention(qk, x, keys, mha.in_proj_weight[2 * e:], mha.in_proj_bias[2 * e:],
                                               heads, uniform))
        for i in range(slices):
            rows = slice(i * length, (i + 1) * length)
            ref = mha(query[:, None], keys[rows, None], x[rows, None])[0][:, 0]
            assert (folded[i] - ref).abs().max() <= 1e-10 * ref.abs().max()


def test_a_wrong_fold_is_caught():
    """The float64 comparison is sharp: the key bias, which the softmax ignores, may be dropped; the value
    bias may not."""
    e, heads, nq, length = 256, 2, 64, 30
    mha = _attention(e, heads, seed=3)
    g = torch.Generator().manual_seed(4)
    query = torch.randn(nq, e, generator=g, dtype=torch.float64)
    x = torch.randn(length, e, generator=g, dtype=torch.float64)
    qk = fold_queries(_projected_queries(mha, query), mha.in_proj_weight[e:2 * e])
    with torch.no_grad():
        ref = mha(query[:, None], x[:, None], x[:, None])[0][:, 0]
        no_value_bias = mha.out_proj(folded_attention(qk, x, x, mha.in_proj_weight[2 * e:],
                                                      torch.zeros(e, dtype=torch.float64), heads, (1, length)))
    assert (no_value_bias[0] - ref).abs().max() > 1e-3


def test_add_bias_layernorm_reads_a_table_by_row_ids():
    """`rows`: the residual is table[rows] + y + bias (a learned position embedding gathered in the add),
    out in the residual dtype asked for, the norm of it in y's dtype."""
    g = torch.Generator().manual_seed(0)
    table = torch.randn(50, 24, generator=g)
    y, rows = torch.randn(9, 24, generator=g), torch.randint(0, 50, (9,), generator=g)
    b, w, lb = (torch.randn(24, generator=g) for _ in range(3))
    x, h = K.add_bias_layernorm(table.double(), y, b, w, lb, 1e-6, rows=rows, residual_dtype=torch.float32)
    x0, h0 = K.add_bias_layernorm(table[rows], y, b, w, lb, 1e-6)
    assert x.dtype == torch.float32 and h.dtype == y.dtype
    assert torch.equal(x, x0) and torch.equal(h, h0)


def test_normalize_rows_gathers_and_pads():
    g = torch.Generator().manual_seed(0)
    px = torch.randint(0, 256, (7, 12), generator=g, dtype=torch.uint8)
    scale, offset = torch.rand(12, generator=g), torch.rand(12, generator=g)
    rows = torch.tensor([6, 0, 3])
    out = K.normalize_rows(px, scale, offset, torch.float32, pad=4, rows=rows)
    assert out.shape == (3, 16) and not out[:, 12:].any()
    assert torch.equal(out[:, :12], px[rows].float() * scale + offset)


# ---------------------------------------------------------------------------- GPU
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.Generator(device="cuda").manual_seed(0)


def _within_bf16(a: torch.Tensor, b: torch.Tensor) -> bool:
    """|a - b| within one bf16 ulp of b (at most 2^-7 of its magnitude: 8 significant bits), with a floor
    of a thousandth of that at b's largest magnitude for values near zero, where float32 sums taken in
    another order differ."""
    a, b = a.float(), b.float()
    return bool(((a - b).abs() <= 2**-7 * (b.abs() + 1e-3 * b.abs().max())).all())


@pytest.mark.gpu
def test_triton_kernels_of_the_minicpmv_path_equal_their_torch_versions():
    g = _cuda()
    # pixel rows: one rounding of the float32 result, so within one bf16 ulp of torch's
    px = torch.randint(0, 256, (1024, 588), device="cuda", dtype=torch.uint8, generator=g)
    scale, offset = torch.rand(588, device="cuda", generator=g), torch.rand(588, device="cuda", generator=g) - 0.5
    rows = torch.randperm(1024, device="cuda", generator=g)[:700]
    out = K.normalize_rows(px, scale, offset, torch.bfloat16, pad=4, rows=rows)
    ref = K.normalize_rows_torch(px, scale, offset, torch.bfloat16, pad=4, rows=rows)
    assert out.shape == ref.shape == (700, 592) and not out[:, 588:].any()
    assert _within_bf16(out, ref)
    # the embedding's gathered add + LayerNorm
    table = torch.randn(1024, 1152, device="cuda", dtype=torch.bfloat16, generator=g)
    y = torch.randn(1024, 1152, device="cuda", dtype=torch.bfloat16, generator=g)
    ids = torch.randint(0, 1024, (1024,), device="cuda", generator=g)
    b, w, lb = (torch.randn(1152, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    x, h = K.add_bias_layernorm(table, y, b, w, lb, 1e-6, rows=ids, residual_dtype=torch.float32)
    x0, h0 = K.add_bias_layernorm_torch(table, y, b, w, lb, 1e-6, rows=ids, residual_dtype=torch.float32)
    assert x.dtype == torch.float32 and (x - x0).abs().max() <= 1e-5 * x0.abs().max()
    assert _within_bf16(h, h0)
    # without a y (the resampler's out_proj bias and ln_post after a bias-free GEMM)
    xo, ho = K.add_bias_layernorm(y, None, b, w, lb, 1e-6)
    xo0, ho0 = K.add_bias_layernorm_torch(y, None, b, w, lb, 1e-6)
    assert torch.equal(xo, xo0) and _within_bf16(ho, ho0)
    # the resampler's softmax over float32 scores, rounded once to bf16
    scores = torch.randn(2048, 1000, device="cuda", generator=g) * 4
    assert _within_bf16(softmax_rows(scores, torch.bfloat16), torch.softmax(scores, -1))
    assert (softmax_rows(scores, torch.float32) - torch.softmax(scores, -1)).abs().max() <= 1e-6
    # the resampler's LayerNorm + sin-cos keys: against float32 math, one bf16 rounding each
    e = 4096
    ln = nn.LayerNorm(e, eps=1e-6).cuda()
    with torch.no_grad():
        ln.weight.normal_(1, 0.1, generator=g)
        ln.bias.normal_(0, 0.1, generator=g)
    yk = torch.randn(1000, e, device="cuda", generator=g)
    rc = torch.stack(torch.meshgrid(torch.arange(25.0), torch.arange(40.0), indexing="ij"), -1).reshape(-1, 2).cuda()
    omega = sincos_frequencies(e).cuda()
    xk, keys = normed_keys(yk.bfloat16(), ln.bfloat16(), rc, omega)
    x32 = F.layer_norm(yk.bfloat16().float(), (e,), ln.weight.float(), ln.bias.float(), 1e-6)
    k32 = x32 + key_positions(rc, omega)
    assert _within_bf16(xk, x32) and _within_bf16(keys, k32)
    xt, _ = normed_keys_torch(yk.bfloat16(), ln, rc, omega)  # (its keys are rounded twice: not compared)
    assert _within_bf16(xk, xt)


def _folded(mha, query, x, keys, uniform, dtype):
    e, w, b = mha.embed_dim, mha.in_proj_weight, mha.in_proj_bias
    qk = fold_queries(_projected_queries(mha, query).to(dtype), w[e:2 * e].to(dtype))
    return folded_attention(qk, x.to(dtype), keys.to(dtype), w[2 * e:].to(dtype), b[2 * e:].to(dtype),
                            mha.num_heads, uniform).float()


def _projected(mha, query, x, keys, uniform, dtype):
    """Keys and values projected, then one attention call per slice (the unfolded path)."""
    e, heads, w, b = mha.embed_dim, mha.num_heads, mha.in_proj_weight, mha.in_proj_bias
    q = _projected_queries(mha, query).to(dtype)
    k = F.linear(keys.to(dtype), w[e:2 * e].to(dtype), b[e:2 * e].to(dtype))
    v = F.linear(x.to(dtype), w[2 * e:].to(dtype), b[2 * e:].to(dtype))
    s, length = uniform
    k, v = (t.view(s, length, heads, e // heads).transpose(1, 2) for t in (k, v))
    out = F.scaled_dot_product_attention(q.expand(s, -1, -1, -1), k, v)
    return out.transpose(1, 2).reshape(s, query.shape[0], e).float()


@pytest.mark.gpu
def test_folded_bf16_resampler_is_as_close_to_float32_as_the_projected_one():
    """MiniCPM-V-4.5's resampler width (E = 4096, 32 heads, 64 queries), one 448^2 slice and four equal
    ones, in bf16: folded and projected attention against the projected float32 result."""
    g = _cuda()
    e, heads, nq = 4096, 32, 64
    mha = _attention(e, heads, dtype=torch.float32).cuda()
    with torch.no_grad():
        mha.in_proj_weight.normal_(0, e**-0.5, generator=g)
    query = torch.randn(nq, e, device="cuda", generator=g)
    for uniform in [(1, 1024), (4, 480)]:
        n = uniform[0] * uniform[1]
        x = torch.randn(n, e, device="cuda", generator=g)
        keys = x + torch.randn(n, e, device="cuda", generator=g)
        args = (mha, query, x, keys, uniform)
        with torch.no_grad():
            truth = _projected(*args, torch.float32)
            scale = truth.abs().max()
            assert (_folded(*args, torch.float32) - truth).abs().max() <= 1e-4 * scale
            err_fold = ((_folded(*args, torch.bfloat16) - truth).abs().max() / scale).item()
            err_proj = ((_projected(*args, torch.bfloat16) - truth).abs().max() / scale).item()
        assert err_fold <= 1e-2 and err_fold <= 2 * err_proj, (uniform, err_fold, err_proj)
