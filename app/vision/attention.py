"""Block-diagonal (variable-length) attention for the tower, in Triton.

Inside a budget graph the batch is padded: `max_seqlen` must be the budget and there are
`max_frames_per_batch + 1` sequence slots, mostly empty. FlashAttention-2's varlen kernel launches a
program for every (slot, query block of `max_seqlen`, head), so the padding nearly doubles its time
(benchmarks/results/2026-11-21-vision-encoder-qwen3-vl.md). Here the work is listed instead: a small
host-built table holds one row per query block (first query row, sequence start, sequence end), and
the grid is that table's static length, its unused rows returning at once. 72-wide heads are split
in two parts (`split` says why). Padding tokens are a sequence of their own (see
metadata.cu_seqlens): their rows come out finite and never mix with real rows.
"""

from __future__ import annotations

import functools
import importlib.util
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from ..gpu import sdpa_backends
from . import flash4

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

# PyTorch's varlen FlashAttention (torch >= 2.10), imported at its first call: its module imports
# torch._dynamo, 1.5 s of every replica's start on the CPU machine, for a path the CPU never takes.
HAS_TORCH_VARLEN = importlib.util.find_spec("torch.nn.attention.varlen") is not None


def varlen_attn(*args, **kwargs):
    return _torch_varlen()(*args, **kwargs)


@functools.cache
def _torch_varlen():
    from torch.nn.attention.varlen import varlen_attn as fn

    return fn

DENSE_MIN_LENGTH = 512  # equal-length sequences at least this long take one dense attention call

# Query rows per program -> (key block, warps, pipeline stages), from the sweep in benchmarks/tower_kernels.py:
# 128 rows suit long sequences and mixed batches (budget graphs), 64 rows short ones (a 224^2 video's
# 196-token frames; benchmarks/results/2026-11-21-vision-encoder-qwen3-vl.md).
CONFIGS = {128: (64, 4, 3), 64: (64, 4, 3)}
BLOCK_M = 128
SHORT = 256  # equal-length sequences up to this long use 64-row blocks


def block_m_for(uniform_length: int | None) -> int:
    return 64 if uniform_length is not None and uniform_length <= SHORT else BLOCK_M


def split(head_dim: int) -> tuple[int, int] | None:
    """(main part, remainder part) widths for a head size, or None where this kernel does not apply.

    Qwen3-VL's vision heads are 72 wide (8B). Library kernels round that up (FlashAttention-2 to 96;
    cuDNN takes as long as at 128), so the head is split into a 64-wide part and a 16-wide remainder
    (8 real columns, 8 masked): the work of an 80-wide head. Heads of 64 or fewer (power of two) take
    a single part."""
    if head_dim <= 64 and head_dim >= 16 and head_dim & (head_dim - 1) == 0:
        return head_dim, 0
    if 64 < head_dim <= 80 and head_dim % 8 == 0:
        return 64, 16
    return None


def available(head_dim: int, device: torch.device) -> bool:
    return triton is not None and device.type == "cuda" and split(head_dim) is not None


def table_rows(tokens: int, seqs: int, block_m: int = BLOCK_M) -> int:
    """Most query blocks `seqs` sequences of `tokens` tokens in all can need: the static table size."""
    return tokens // block_m + seqs


def block_table(seq_lens: list[int], rows: int | None = None, block_m: int = BLOCK_M) -> torch.Tensor:
    """int32 [rows, 3]: (first query row, sequence start, sequence end) per query block, padded to
    `rows` with empty blocks (start = end) that do nothing."""
    out, start = [], 0
    for n in seq_lens:
        out.extend((q, start, start + n) for q in range(start, start + n, block_m))
        start += n
    if rows is not None:
        if len(out) > rows:
            raise ValueError(f"{len(out)} attention blocks exceed the table's {rows} rows")
        out.extend([(start, start, start)] * (rows - len(out)))
    return torch.tensor(out, dtype=torch.int32).reshape(-1, 3)


def padded_block_table(seq_lens: list[int], tokens: int | None, seq_slots: int, block_m: int) -> torch.Tensor:
    """`block_table` for a batch's sequences: exact for an eager batch (`tokens` None); for a graph,
    padded to its static rows, the padding tokens (when `tokens` exceeds the sequences' sum) being one
    more sequence."""
    if tokens is None:
        return block_table(seq_lens, None, block_m)
    seqs = list(seq_lens)
    if tokens > sum(seqs):
        seqs.append(tokens - sum(seqs))
    return block_table(seqs, table_rows(tokens, seq_slots, block_m), block_m)


if triton is not None:

    @triton.jit
    def _varlen_fwd(Q, K, V, Out, Table, stride_q, stride_k, stride_v, stride_o, qk_scale, D: tl.constexpr,
                    DA: tl.constexpr, DB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        blk = tl.program_id(0)
        h = tl.program_id(1)
        q0 = tl.load(Table + blk * 3)
        s0 = tl.load(Table + blk * 3 + 1)
        s1 = tl.load(Table + blk * 3 + 2)
        if q0 >= s1:
            return
        # Head offsets as h * D with D a compile-time constant: the compiler then knows they are
        # 16-byte aligned and vectorises the loads (a runtime head stride of 72 was markedly slower:
        # benchmarks/results/2026-11-21-vision-encoder-qwen3-vl.md).
        rows = q0 + tl.arange(0, BM)
        rm = rows < s1
        da = tl.arange(0, DA)
        qa = tl.load(Q + rows[:, None] * stride_q + h * D + da[None, :], mask=rm[:, None], other=0.0)
        acc_a = tl.zeros([BM, DA], tl.float32)
        if DB > 0:
            db = DA + tl.arange(0, DB)
            dbm = db < D
            qb = tl.load(Q + rows[:, None] * stride_q + h * D + db[None, :], mask=rm[:, None] & dbm[None, :],
                         other=0.0)
            acc_b = tl.zeros([BM, DB], tl.float32)
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        for n0 in range(s0, s1, BN):
            cols = n0 + tl.arange(0, BN)
            cm = cols < s1
            ka = tl.load(K + cols[:, None] * stride_k + h * D + da[None, :], mask=cm[:, None], other=0.0)
            s = tl.dot(qa, tl.trans(ka))
            if DB > 0:
                kb = tl.load(K + cols[:, None] * stride_k + h * D + db[None, :], mask=cm[:, None] & dbm[None, :],
                             other=0.0)
                s += tl.dot(qb, tl.trans(kb))
            s = tl.where(cm[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            va = tl.load(V + cols[:, None] * stride_v + h * D + da[None, :], mask=cm[:, None], other=0.0)
            p = p.to(va.dtype)  # probabilities in the value dtype for the second GEMM, as FlashAttention
            acc_a = acc_a * alpha[:, None] + tl.dot(p, va)
            if DB > 0:
                vb = tl.load(V + cols[:, None] * stride_v + h * D + db[None, :], mask=cm[:, None] & dbm[None, :],
                             other=0.0)
                acc_b = acc_b * alpha[:, None] + tl.dot(p, vb)
            m_i = m_new
        o = Out + rows[:, None] * stride_o + h * D
        tl.store(o + da[None, :], (acc_a / l_i[:, None]).to(Out.dtype.element_ty), mask=rm[:, None])
        if DB > 0:
            tl.store(o + db[None, :], (acc_b / l_i[:, None]).to(Out.dtype.element_ty), mask=rm[:, None] & dbm[None, :])


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
                     block_m: int = BLOCK_M, config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """q, k, v [N, H, D] (rows of any stride; heads packed, unit column stride) -> out [N, H, D].

    `table` comes from `block_table` with the same `block_m` (on q's device). Softmax scale
    1/sqrt(D), no mask within a sequence, nothing across sequences. `config` = (key block, warps,
    stages) overrides `CONFIGS[block_m]` (the benchmark's sweep).
    """
    block_n, warps, stages = config or CONFIGS[block_m]
    n, heads, d = q.shape
    da, db = split(d)
    for t in (q, k, v):
        if t.stride(2) != 1 or t.stride(1) != d:
            raise ValueError("q, k, v need packed heads ([N, H, D] views with unit column stride)")
    out = torch.empty(n, heads, d, dtype=q.dtype, device=q.device)
    _varlen_fwd[(table.shape[0], heads)](q, k, v, out, table, q.stride(0), k.stride(0), v.stride(0), out.stride(0),
                                         1.4426950408889634 / math.sqrt(d), d, da, db, block_m, block_n,
                                         num_warps=warps, num_stages=stages)
    return out


def uses_torch_varlen(device: torch.device, dtype: torch.dtype) -> bool:
    """PyTorch's varlen FlashAttention runs here: CUDA, bf16/fp16, Ampere or newer."""
    return (HAS_TORCH_VARLEN and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and _capability(device.index)[0] >= 8)


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                     *, table: torch.Tensor | None = None, block_m: int = BLOCK_M,
                     uniform: tuple[int, int] | None = None, static: bool = False,
                     use_flash4: bool = False) -> torch.Tensor:
    """Block-diagonal self-attention over a packed batch: q, k, v [N, H, D] -> [N, H, D], each token
    attending to the tokens of its own sequence (`cu_seqlens`, int32, monotonic, padded slots of zero
    length). Softmax scale 1/sqrt(D). Every tower's body calls this; the path depends on the device:

    - equal-length sequences (`uniform`) without a table, or of at least DENSE_MIN_LENGTH tokens: one
      dense batched call: in graphs FlashAttention-4 with `use_flash4` (flash4.py), else SDPA (cuDNN's
      kernel only inside graphs: sdpa_backends says why);
    - with a block `table` (CUDA, our Triton kernel): `varlen_attention`;
    - CUDA bf16/fp16 without one: PyTorch's varlen FlashAttention;
    - CPU: one SDPA call per sequence (no graph to keep static; a mask over the whole padded batch
      costs (sum of lengths)^2 instead of the sum of squares, see
      benchmarks/results/2026-11-21-serving-under-load-graphs-on-off.md. 4-D inputs take torch's CPU
      flash kernel; 3-D ones the much slower math path);
    - otherwise (CUDA fp32): SDPA with a block-diagonal mask built on the device (graph-safe).
    """
    n, heads, d = q.shape
    if uniform is not None and (table is None or uniform[1] >= DENSE_MIN_LENGTH):
        s, length = uniform
        if use_flash4 and static:
            return flash4.dense(*(t.reshape(s, length, heads, d) for t in (q, k, v))).reshape(s * length, heads, d)
        q, k, v = (t.reshape(s, length, heads, d).transpose(1, 2) for t in (q, k, v))
        backends = sdpa_backends.CAPTURED if static else sdpa_backends.UNCAPTURED
        with sdpa_kernel(backends, set_priority=True):
            out = F.scaled_dot_product_attention(q, k, v)
        return out.transpose(1, 2).reshape(s * length, heads, d)
    if table is not None:
        return varlen_attention(q, k, v, table, block_m)
    if uses_torch_varlen(q.device, q.dtype):
        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    if q.device.type == "cpu":
        bounds = cu_seqlens.tolist()
        return torch.cat([F.scaled_dot_product_attention(*(t[None, a:b].transpose(1, 2) for t in (q, k, v)))[0]
                          .transpose(0, 1) for a, b in zip(bounds, bounds[1:]) if b > a])
    seg = torch.searchsorted(cu_seqlens[1:], torch.arange(n, device=q.device, dtype=cu_seqlens.dtype), right=True)
    mask = seg[:, None] == seg[None, :]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
    return out.transpose(0, 1)
