"""Which experts each token goes to, as transformers routes: the router's bf16 logits, a float32
softmax over every expert, the k largest (the first index on ties), renormalised when the checkpoint
says so, rounded to the model's dtype.

`route_topk_torch` is the CPU's path and the reference; `route_topk` runs softmax and top-k in one
Triton kernel after cuBLAS's logits (torch's ops were eight launches a layer); `route_tokens` with one
or two tokens (single-stream decode) runs it all in one kernel: programs each compute a few experts'
logits and the last to finish (an atomic counter, one per stream, set back to 0 by it) routes. At one
token on an H200 cuBLAS's GEMM took 5.0 us and the routing kernel 2.3 us a layer
(benchmarks/results/2026-11-27-models-beyond-one-gpu.md). A CUDA graph keeps the counter of the stream
it was captured on (cuda_graphs._capture warms up on that stream first, which makes it).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

# Up to this many tokens `route_tokens` runs the one fused kernel (fused_moe's DIRECT path covers the
# same steps); from there on the logits GEMM is cuBLAS's, as the tile of many tokens pays.
FUSED_ROUTER_MAX_TOKENS = 2
FUSED_BLOCK_E = 4  # experts per program: 32 programs at 128 experts
FUSED_BLOCK_K = 256
log = logging.getLogger(__name__)

_counters: dict[tuple[int, int], torch.Tensor] = {}
# captures that met no counter for their stream and fell back to the unfused path (a test holds it at 0)
capture_fallbacks = 0


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
                                              BLOCK_E=triton.next_power_of_2(e), RENORM=renormalize, num_warps=4)
    return ids, weights


def route_tokens(h: torch.Tensor, router_weight: torch.Tensor, k: int, renormalize: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states h [T, hidden] and the router's weight [E, hidden] -> (expert ids [T, k] int32 on
    CUDA, weights [T, k] in h's dtype). A few tokens on CUDA: one fused kernel; otherwise the logits
    by F.linear, then `route_topk`."""
    t = h.shape[0]
    if (triton is None or not h.is_cuda or t == 0 or t > FUSED_ROUTER_MAX_TOKENS
            or not h.is_contiguous() or not router_weight.is_contiguous()):
        return route_topk(F.linear(h, router_weight), k, renormalize, h.dtype)
    counter = _counter(h.device)
    if counter is None:  # first met inside a graph capture: no counter may be made there
        global capture_fallbacks
        capture_fallbacks += 1
        log.warning("route_tokens: no counter for the capturing stream (no warm-up on it): this graph routes "
                    "with the unfused path")
        return route_topk(F.linear(h, router_weight), k, renormalize, h.dtype)
    e, hidden = router_weight.shape
    logits = torch.empty(t, e, dtype=h.dtype, device=h.device)
    ids = torch.empty(t, k, dtype=torch.int32, device=h.device)
    weights = torch.empty(t, k, dtype=h.dtype, device=h.device)
    _fused_router_kernel[(triton.cdiv(e, FUSED_BLOCK_E),)](
        h, router_weight, logits, ids, weights, counter, t, hidden, e, h.stride(0), router_weight.stride(0),
        TOP_K=k, K_PAD=triton.next_power_of_2(k), T_PAD=triton.next_power_of_2(max(t, 2)),
        BLOCK_E=FUSED_BLOCK_E, BLOCK_K=FUSED_BLOCK_K, E_PAD=triton.next_power_of_2(e), RENORM=renormalize,
        num_warps=4)
    return ids, weights


def _counter(device: torch.device) -> torch.Tensor | None:
    """The fused kernel's counter for the current stream (made on first use, outside any capture)."""
    key = (device.index if device.index is not None else torch.cuda.current_device(),
           torch.cuda.current_stream(device).cuda_stream)
    c = _counters.get(key)
    if c is None:
        if torch.cuda.is_current_stream_capturing():
            return None
        c = _counters[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return c


if triton is not None:

    @triton.jit
    def _softmax_topk_store(z, rows, row_ok, cols, ids_ptr, weights_ptr, TOP_K: tl.constexpr,
                            K_PAD: tl.constexpr, RENORM: tl.constexpr):
        # z [rows, E_PAD] float32 logits, -inf past the experts: softmax, the k largest one at a time
        # (first index on ties), renormalised, stored as ids and weights of the rows that exist.
        z = tl.where(row_ok[:, None], z, 0.0)  # rows past t: finite values, never stored
        p = tl.exp(z - tl.max(z, 1)[:, None])
        p = p / tl.sum(p, 1)[:, None]
        slot = tl.arange(0, K_PAD)
        top_w = tl.zeros((z.shape[0], K_PAD), dtype=tl.float32)
        top_i = tl.zeros((z.shape[0], K_PAD), dtype=tl.int32)
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

    @triton.jit
    def _route_kernel(logits_ptr, ids_ptr, weights_ptr, t, num_experts, stride_lt, TOP_K: tl.constexpr,
                      K_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, RENORM: tl.constexpr):
        # BLOCK_T tokens' logits in, their ids and weights out
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, BLOCK_E)
        row_ok = rows < t
        z = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_lt + cols[None, :],
                    mask=row_ok[:, None] & (cols < num_experts)[None, :], other=float("-inf")).to(tl.float32)
        _softmax_topk_store(z, rows, row_ok, cols, ids_ptr, weights_ptr, TOP_K, K_PAD, RENORM)

    @triton.jit
    def _fused_router_kernel(x_ptr, w_ptr, logits_ptr, ids_ptr, weights_ptr, counter_ptr, t, hidden, num_experts,
                             stride_xt, stride_we, TOP_K: tl.constexpr, K_PAD: tl.constexpr, T_PAD: tl.constexpr,
                             BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, E_PAD: tl.constexpr,
                             RENORM: tl.constexpr):
        # Each program: BLOCK_E experts' logits for every token (float32 sums, rounded to the model's
        # dtype as the linear layer's output is). The last program to finish routes every token.
        rows = tl.arange(0, T_PAD)
        row_ok = rows < t
        es = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
        e_ok = es < num_experts
        acc = tl.zeros((T_PAD, BLOCK_E), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < hidden
            x = tl.load(x_ptr + rows[:, None] * stride_xt + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
            w = tl.load(w_ptr + es[:, None].to(tl.int64) * stride_we + ks[None, :],
                        mask=e_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        tl.store(logits_ptr + rows[:, None] * num_experts + es[None, :], acc.to(logits_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & e_ok[None, :])
        # Every thread's stores done before the count (the atomic's release covers only the thread that
        # issues it), and acq_rel: the last program's loads below then see every program's logits.
        tl.debug_barrier()
        done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(0) - 1:
            cols = tl.arange(0, E_PAD)
            z = tl.load(logits_ptr + rows[:, None] * num_experts + cols[None, :],
                        mask=row_ok[:, None] & (cols < num_experts)[None, :], other=float("-inf"),
                        cache_modifier=".cg").to(tl.float32)
            _softmax_topk_store(z, rows, row_ok, cols, ids_ptr, weights_ptr, TOP_K, K_PAD, RENORM)
            tl.atomic_xchg(counter_ptr, 0)  # ready for the next launch on this stream
