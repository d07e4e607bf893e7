"""Which experts each token goes to, as transformers routes: the router's bf16 logits, a float32
softmax over every expert, the k largest (the first index on ties), renormalised when the checkpoint
says so, rounded to the model's dtype.

`route_topk_torch` is the CPU's path and the reference; `route_topk` runs softmax and top-k in one
Triton kernel after the logits (cuBLAS's GEMM, or for one or two tokens gemv.py's matrix-vector kernel
where faster: 4.85 to 2.84 us on an H200; torch's ops were eight launches a layer). Two fusions for
single-stream decode were measured slower on an H100 and dropped: logits+top-k in one kernel (13.2 us
against 7.3 a layer, 2026-11-27), and top-k inside the experts' gate/up kernel, the same bits with one
launch less a layer (250 against 289 tok/s, 2026-12-02: every program's loads waited on its routing).
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


def route_topk_torch(logits: torch.Tensor, k: int, renormalize: bool, dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (expert ids [T, k], weights [T, k] in `dtype`), in torch ops."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(dtype)


def route_topk(logits: torch.Tensor, k: int, renormalize: bool, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_topk_torch`'s result; on CUDA from one Triton kernel."""
    if triton is None or not logits.is_cuda or logits.shape[0] == 0:
        return route_topk_torch(logits, k, renormalize, dtype)
    t, e = logits.shape
    ids = torch.empty(t, k, dtype=torch.int32, device=logits.device)
    weights = torch.empty(t, k, dtype=dtype, device=logits.device)
    block_t = 4
    _route_kernel[(triton.cdiv(t, block_t),)](logits, ids, weights, t, e, logits.stride(0), TOP_K=k,
                                              K_PAD=triton.next_power_of_2(k), BLOCK_T=block_t,
                                              BLOCK_E=triton.next_power_of_2(e), RENORM=renormalize, num_warps=4,
                                              **pdl.args())
    return ids, weights


def route_tokens(h: torch.Tensor, router_weight: torch.Tensor, k: int, renormalize: bool, linear=F.linear
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states h [T, hidden] and the router's weight [E, hidden] -> (expert ids [T, k] int32 on
    CUDA, weights [T, k] in h's dtype): the logits by `linear` (F.linear, or the model's
    GemvTable.linear for one or two tokens), then `route_topk`."""
    return route_topk(linear(h, router_weight), k, renormalize, h.dtype)


if triton is not None:

    @triton.jit
    def _route_kernel(logits_ptr, ids_ptr, weights_ptr, t, num_experts, stride_lt, TOP_K: tl.constexpr,
                      K_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, RENORM: tl.constexpr,
                      PDL: tl.constexpr):
        enter(PDL)
        # BLOCK_T tokens: softmax over the experts in float32, the k largest one at a time (first index
        # on ties), renormalised, rounded to the weights' dtype.
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, BLOCK_E)
        row_ok = rows < t
        z = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_lt + cols[None, :],
                    mask=row_ok[:, None] & (cols < num_experts)[None, :], other=float("-inf")).to(tl.float32)
        z = tl.where(row_ok[:, None], z, 0.0)  # rows past t: finite values, never stored
        p = tl.exp(z - tl.max(z, 1)[:, None])
        p = p / tl.sum(p, 1)[:, None]
        slot = tl.arange(0, K_PAD)
        top_w = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
        top_i = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int32)
        for j in tl.static_range(TOP_K):
            best = tl.argmax(p, 1)
            top_w = tl.where(slot[None, :] == j, tl.max(p, 1)[:, None], top_w)
            top_i = tl.where(slot[None, :] == j, best[:, None].to(tl.int32), top_i)
            p = tl.where(cols[None, :] == best[:, None], -1.0, p)  # masked experts already hold 0
        if RENORM:
            top_w = top_w / tl.sum(top_w, 1)[:, None]
        offs = rows[:, None] * TOP_K + slot[None, :]
        ok = row_ok[:, None] & (slot < TOP_K)[None, :]
        tl.store(ids_ptr + offs, top_i, mask=ok)
        tl.store(weights_ptr + offs, top_w.to(weights_ptr.dtype.element_ty), mask=ok)
