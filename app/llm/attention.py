"""Attention over the paged KV cache for every kind of step (decodes, prefill chunks, prompts whose
first blocks came from the prefix cache), all in one call.

Each sequence brings `n` new queries at the end of its `L` keys (the new keys are already in the
cache: `kernels.qk_norm_rope_store` wrote them), and query `i` sees keys `0 .. L - n + i`: decode is
n = 1, a whole prompt n = L, a chunk anything between. On CUDA one Triton kernel runs the programs of
a small host-built table (sequence, first query), so a step mixing decodes and long chunks launches
exactly the work it has; a program takes one KV head and all the query heads sharing it (GQA), so
each key tile is loaded once for the group. A decode step with too few programs to fill the GPU (a
single stream) splits each sequence's keys over several programs and merges their partial softmaxes
(`decode_kv_splits`). The CPU, and any shape the kernel does not take, uses per-sequence SDPA.
Timings: benchmarks/results/2026-11-23-1024-one-h200-gpu-time-pinned-copies.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from . import pdl
from .pdl import enter

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


@dataclass
class AttentionMetadata:
    """One step's layout. Device tensors feed the kernel; the host arrays feed the CPU path."""

    query_start: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32, keys per sequence after this step
    seq_rows: torch.Tensor  # [B] int32, row of each sequence in block_tables
    block_tables: torch.Tensor  # [rows, max_blocks] int32
    work_seq: torch.Tensor  # [W] int32, one entry per program
    work_q0: torch.Tensor  # [W] int32
    block_q: int  # queries per program
    block_size: int
    block_n: int = 64  # keys per tile
    kv_splits: int = 1  # decode steps only: each sequence's keys split over this many programs (decode_kv_splits)
    host_query_start: np.ndarray | None = None
    host_seq_lens: np.ndarray | None = None
    host_block_tables: list[list[int]] | None = None


def work_table(query_lens: np.ndarray, block_q: int) -> tuple[np.ndarray, np.ndarray]:
    """Programs for a step: (sequence index, first query offset) per block of `block_q` queries. A
    CUDA-graph decode step lists one program per batch row."""
    per_seq = -(-query_lens // block_q)
    seq = np.repeat(np.arange(len(query_lens), dtype=np.int32), per_seq)
    starts = np.concatenate([[0], np.cumsum(per_seq)[:-1]]) if len(per_seq) else np.zeros(0, dtype=np.int64)
    q0 = (np.arange(len(seq)) - np.repeat(starts, per_seq)) * block_q
    return seq, q0.astype(np.int32)


def decode_block_n(rows: int) -> int:
    """Keys per tile in a decode step of `rows` sequences. Decode reads the whole cache once, bound by
    memory bandwidth: with few programs (one per sequence and KV head) longer tiles keep more bytes in
    flight; with many the GPU is full either way and shorter tiles win. The sweep that set 32:
    benchmarks/results/2026-11-23-1024-one-h200-gpu-time-pinned-copies.md."""
    return 128 if rows <= 32 else 64


SPLIT_BLOCK_N = 64  # keys per tile when the keys are split: more, shorter ranges in flight


def decode_kv_splits(rows: int, kv_heads: int, sms: int, most: int = 32) -> int:
    """Programs per (sequence, KV head) in a decode step of `rows` sequences. One program walks a whole
    sequence's keys for one KV head, so a single stream of a model with 4 KV heads (30B-A3B; 1 per rank
    for 235B-A22B at TP=4) runs 4 programs on a GPU of 132 SMs, each a chain of dependent tile loads
    (7.5 us per layer on an H200, benchmarks/results/2026-11-27-models-beyond-one-gpu.md). Split, each
    program takes a range of tiles and a second kernel merges their partial softmaxes
    (`_combine_splits_kernel`). Fixed per batch size, as a CUDA graph needs; the ranges follow each
    sequence's length at run time, and splits past its last tile write nothing that counts. 1 where
    the step already has programs for half the GPU. At most `most` (LLMConfig.decode_kv_splits)."""
    programs = rows * kv_heads
    if programs * 2 >= sms:
        return 1
    return max(1, min(most, sms // programs))


def block_q_for(group: int, block_m: int) -> int:
    """Queries per program so that queries x heads-per-KV-head fill `block_m` rows (at least 16 rows,
    the smallest tensor-core tile)."""
    return max(1, max(block_m, 16) // group)


# ---------------------------------------------------------------------------- CPU / reference
def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                          scale: float) -> torch.Tensor:
    """q [T, H, D]; k_cache/v_cache [slots, KV, D] (flat) -> [T, H, D]. One SDPA call per sequence."""
    out = torch.empty_like(q)
    qs, lens, tables, bs = meta.host_query_start, meta.host_seq_lens, meta.host_block_tables, meta.block_size
    for i in range(len(lens)):
        a, b, length = int(qs[i]), int(qs[i + 1]), int(lens[i])
        if b == a:
            continue
        blocks = torch.tensor(tables[i][:-(-length // bs)], dtype=torch.long, device=q.device)
        idx = (blocks[:, None] * bs + torch.arange(bs, device=q.device)).flatten()[:length]
        k, v = k_cache[idx].transpose(0, 1), v_cache[idx].transpose(0, 1)  # [KV, L, D]
        n = b - a
        visible = torch.arange(length, device=q.device)[None, :] <= (length - n + torch.arange(n, device=q.device))[:, None]
        o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k, v, attn_mask=visible, scale=scale,
                                           enable_gqa=True)
        out[a:b] = o.transpose(0, 1)
    return out


# ---------------------------------------------------------------------------- CUDA
if triton is not None:

    @triton.jit
    def _attend_tile(q, k_ptr, v_ptr, kv_row, d, load_mask, visible, m_i, l_i, acc, scale_log2,
                     MASKED: tl.constexpr, PRECISION: tl.constexpr):
        # One key tile of the online softmax: its keys and values at `kv_row` (`load_mask` over rows and
        # head dims), scores masked to `visible` where MASKED; the running max, sum and output updated.
        k = tl.load(k_ptr + kv_row[:, None] + d[None, :], mask=load_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        if MASKED:
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_row[:, None] + d[None, :], mask=load_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, tables_ptr, table_stride, rows_ptr, qstart_ptr,
                                lens_ptr, work_seq_ptr, work_q0_ptr, scale_log2,
                                H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                                GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                                PAGE: tl.constexpr, PRECISION: tl.constexpr, SPLIT: tl.constexpr,
                                PDL: tl.constexpr):
        enter(PDL)
        BLOCK_M: tl.constexpr = BLOCK_Q * GROUP
        w = tl.program_id(0)
        kvh = tl.program_id(1)
        seq = tl.load(work_seq_ptr + w)
        q0 = tl.load(work_q0_ptr + w)
        qs = tl.load(qstart_ptr + seq)
        qn = tl.load(qstart_ptr + seq + 1) - qs
        length = tl.load(lens_ptr + seq)
        ctx = length - qn
        table = tables_ptr + tl.load(rows_ptr + seq).to(tl.int64) * table_stride

        m = tl.arange(0, BLOCK_M)
        qi = q0 + m // GROUP
        head = kvh * GROUP + m % GROUP
        d = tl.arange(0, DP)
        dmask = d < D
        row_ok = qi < qn
        q = tl.load(q_ptr + ((qs + qi).to(tl.int64) * H + head)[:, None] * D + d[None, :],
                    mask=row_ok[:, None] & dmask[None, :], other=0.0)
        qpos = ctx + qi
        end = tl.minimum(length, ctx + q0 + BLOCK_Q)  # the block's last query sees keys below this

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DP], tl.float32)
        # An online softmax over the block table, tile by tile up to the causal limit. Keys up to
        # ctx + q0 are visible to every query of the block: whole tiles below that need no causal or
        # length mask; only the tiles that cross the diagonal (or the end) do (the split's gain:
        # benchmarks/results/2026-11-23-1024-one-h200-gpu-time-pinned-copies.md)
        open_end = (ctx + q0 + 1) // BLOCK_N * BLOCK_N if SPLIT else 0
        for start in range(0, open_end, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            blk = tl.load(table + n // PAGE).to(tl.int64)
            kv_row = ((blk * PAGE + n % PAGE) * KV + kvh) * D
            m_i, l_i, acc = _attend_tile(q, k_ptr, v_ptr, kv_row, d, dmask[None, :], dmask[None, :], m_i, l_i, acc,
                                         scale_log2, MASKED=False, PRECISION=PRECISION)
        for start in range(open_end, end, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < end
            blk = tl.load(table + n // PAGE, mask=n_ok, other=0).to(tl.int64)
            kv_row = ((blk * PAGE + n % PAGE) * KV + kvh) * D
            m_i, l_i, acc = _attend_tile(q, k_ptr, v_ptr, kv_row, d, n_ok[:, None] & dmask[None, :],
                                         (n[None, :] <= qpos[:, None]) & n_ok[None, :], m_i, l_i, acc, scale_log2,
                                         MASKED=True, PRECISION=PRECISION)
        out = acc / l_i[:, None]
        tl.store(o_ptr + ((qs + qi).to(tl.int64) * H + head)[:, None] * D + d[None, :], out.to(q.dtype),
                 mask=row_ok[:, None] & dmask[None, :])


    @triton.jit
    def _paged_decode_split_kernel(q_ptr, k_ptr, v_ptr, part_o_ptr, part_lse_ptr, tables_ptr, table_stride, rows_ptr,
                                   qstart_ptr, lens_ptr, scale_log2, H: tl.constexpr, KV: tl.constexpr,
                                   D: tl.constexpr, DP: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                                   BLOCK_N: tl.constexpr, PAGE: tl.constexpr, SPLITS: tl.constexpr,
                                   PRECISION: tl.constexpr, PDL: tl.constexpr):
        enter(PDL)
        # Decode only (one query per sequence, which sees every key): program (sequence, KV head, split)
        # runs the online softmax over its range of key tiles and writes its normalised output and
        # log2-sum-exp per query head; an empty range writes -inf, which the merge weighs as nothing.
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        row = tl.load(qstart_ptr + seq)
        length = tl.load(lens_ptr + seq)
        table = tables_ptr + tl.load(rows_ptr + seq).to(tl.int64) * table_stride
        m = tl.arange(0, BLOCK_M)
        row_ok = m < GROUP
        head = kvh * GROUP + tl.minimum(m, GROUP - 1)
        d = tl.arange(0, DP)
        dmask = d < D
        q = tl.load(q_ptr + (row.to(tl.int64) * H + head)[:, None] * D + d[None, :],
                    mask=row_ok[:, None] & dmask[None, :], other=0.0)
        per = tl.cdiv(tl.cdiv(length, BLOCK_N), SPLITS) * BLOCK_N
        lo = split * per
        hi = tl.minimum(length, lo + per)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DP], tl.float32)
        for start in range(lo, hi, BLOCK_N):  # every tile holds at least one key below hi
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < hi
            blk = tl.load(table + n // PAGE, mask=n_ok, other=0).to(tl.int64)
            kv_row = ((blk * PAGE + n % PAGE) * KV + kvh) * D
            m_i, l_i, acc = _attend_tile(q, k_ptr, v_ptr, kv_row, d, n_ok[:, None] & dmask[None, :], n_ok[None, :],
                                         m_i, l_i, acc, scale_log2, MASKED=True, PRECISION=PRECISION)
        has = l_i > 0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        part = (seq * SPLITS + split) * H + head
        tl.store(part_o_ptr + part[:, None].to(tl.int64) * D + d[None, :], out, mask=row_ok[:, None] & dmask[None, :])
        tl.store(part_lse_ptr + part, lse, mask=row_ok)

    @triton.jit
    def _combine_splits_kernel(part_o_ptr, part_lse_ptr, o_ptr, qstart_ptr, H: tl.constexpr, D: tl.constexpr,
                               DP: tl.constexpr, SPLITS: tl.constexpr, SP: tl.constexpr, PDL: tl.constexpr):
        enter(PDL)
        # One (sequence, query head): the splits' outputs weighted by their share of the softmax's sum.
        seq = tl.program_id(0)
        head = tl.program_id(1)
        sp = tl.arange(0, SP)
        sp_ok = sp < SPLITS
        part = (seq * SPLITS + sp) * H + head
        lse = tl.load(part_lse_ptr + part, mask=sp_ok, other=float("-inf"))
        w = tl.exp2(lse - tl.max(lse, 0))  # split 0 always holds the first key: the max is finite
        d = tl.arange(0, DP)
        dmask = d < D
        o = tl.load(part_o_ptr + part[:, None].to(tl.int64) * D + d[None, :], mask=sp_ok[:, None] & dmask[None, :],
                    other=0.0)
        out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
        row = tl.load(qstart_ptr + seq).to(tl.int64)
        tl.store(o_ptr + (row * H + head) * D + d, out.to(o_ptr.dtype.element_ty), mask=dmask)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, block_n: int | None = None, num_warps: int = 4, num_stages: int = 2,
                    split: bool = True) -> torch.Tensor:
    """Tiles from `meta` unless given (benchmarks/llm_attention.py sweeps them); `split=False` masks
    every tile, as the kernel did before the causal split (kept for that comparison). A decode step
    whose keys are split (`meta.kv_splits` > 1) takes its own tiles (SPLIT_BLOCK_N) and ignores those."""
    if triton is None or not q.is_cuda:
        return paged_attention_torch(q, k_cache, v_cache, meta, scale)
    assert q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
    t, h, d = q.shape
    kv = k_cache.shape[1]
    group = h // kv
    out = torch.empty_like(q)
    if meta.kv_splits > 1:
        return _decode_split(q, k_cache, v_cache, meta, scale, out, num_warps)
    work = meta.work_seq.shape[0]
    if work:
        _paged_attention_kernel[(work, kv)](
            q, k_cache, v_cache, out, meta.block_tables, meta.block_tables.stride(0), meta.seq_rows,
            meta.query_start, meta.seq_lens, meta.work_seq, meta.work_q0, scale * 1.4426950408889634,
            H=h, KV=kv, D=d, DP=triton.next_power_of_2(d), GROUP=group, BLOCK_Q=meta.block_q,
            BLOCK_N=block_n or meta.block_n, PAGE=meta.block_size,
            # float32 models (tests) keep full-precision dots; tf32 would round them
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SPLIT=split, num_warps=num_warps,
            num_stages=num_stages, **pdl.args())
    return out


def _decode_split(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out: torch.Tensor,
                  num_warps: int) -> torch.Tensor:
    """A decode step with each sequence's keys over `meta.kv_splits` programs, then the merge."""
    b, splits = meta.seq_lens.shape[0], meta.kv_splits
    t, h, d = q.shape
    kv = k_cache.shape[1]
    group = h // kv
    part_o = torch.empty(b * splits * h, d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(b * splits * h, dtype=torch.float32, device=q.device)
    dp = triton.next_power_of_2(d)
    _paged_decode_split_kernel[(b, kv, splits)](
        q, k_cache, v_cache, part_o, part_lse, meta.block_tables, meta.block_tables.stride(0), meta.seq_rows,
        meta.query_start, meta.seq_lens, scale * 1.4426950408889634, H=h, KV=kv, D=d, DP=dp, GROUP=group,
        BLOCK_M=max(16, triton.next_power_of_2(group)), BLOCK_N=SPLIT_BLOCK_N, PAGE=meta.block_size, SPLITS=splits,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps, num_stages=2, **pdl.args())
    _combine_splits_kernel[(b, h)](part_o, part_lse, out, meta.query_start, H=h, D=d, DP=dp, SPLITS=splits,
                                   SP=triton.next_power_of_2(splits), num_warps=4, **pdl.args())
    return out
