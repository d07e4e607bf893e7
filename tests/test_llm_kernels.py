"""The text model's GPU kernels (app/llm/kernels.py, app/llm/attention.py) against their torch versions."""

import dataclasses
import itertools

import numpy as np
import pytest
import torch


@pytest.mark.gpu
def test_triton_kernels_equal_their_torch_versions():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from app.llm import kernels as K

    g = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16

    def rnd(*shape, dtype=bf):
        return torch.randn(*shape, device="cuda", generator=g).to(dtype)

    t, hidden, heads, kv, d = 37, 2048, 16, 8, 128
    res, x, w = rnd(t, hidden), rnd(t, hidden), rnd(hidden)
    r1, h1 = K.add_rmsnorm(res.clone(), x, w, 1e-6)
    r0, h0 = K.add_rmsnorm_torch(res, x, w, 1e-6)
    assert torch.equal(r1, r0) and (h1.float() - h0.float()).abs().max() <= 1e-2 * h0.float().abs().max()
    qkv, qn, kn = rnd(t, (heads + 2 * kv) * d), rnd(d), rnd(d)
    ang = rnd(t, d // 2, dtype=torch.float32) * 50
    cos, sin = ang.cos().to(bf), ang.sin().to(bf)
    slots = torch.randperm(64, device="cuda", generator=g)[:t].int()
    caches = [torch.zeros(64, kv, d, device="cuda", dtype=bf) for _ in range(4)]
    q1 = K.qk_norm_rope_store(qkv, qn, kn, cos, sin, caches[0], caches[1], slots, heads, kv, 1e-6)
    q0 = K.qk_norm_rope_store_torch(qkv, qn, kn, cos, sin, caches[2], caches[3], slots.long(), heads, kv, 1e-6)
    for a, b in ((q1, q0), (caches[0], caches[2]), (caches[1], caches[3])):
        assert (a.float() - b.float()).abs().max() <= 1e-2 * b.float().abs().max()
    # cos/sin as the multi-axis rotary can produce them: a [T, D/2] view of a transposed tensor
    cos_t, sin_t = cos.t().contiguous().t(), sin.t().contiguous().t()
    assert not cos_t.is_contiguous()
    q2 = K.qk_norm_rope_store(qkv, qn, kn, cos_t, sin_t, caches[0], caches[1], slots, heads, kv, 1e-6)
    assert torch.equal(q2, q1)
    # head counts that are not powers of two (masked rows of the per-token tile), no q/k norm, head 64
    for heads2, kv2, d2, norm in ((28, 4, 128, False), (12, 2, 64, True)):
        qkv2 = rnd(t, (heads2 + 2 * kv2) * d2)
        w2 = (rnd(d2), rnd(d2)) if norm else (None, None)
        c2, s2 = ang[:, :d2 // 2].cos().to(bf), ang[:, :d2 // 2].sin().to(bf)
        cc = [torch.zeros(64, kv2, d2, device="cuda", dtype=bf) for _ in range(4)]
        a = K.qk_norm_rope_store(qkv2, *w2, c2, s2, cc[0], cc[1], slots, heads2, kv2, 1e-6)
        b = K.qk_norm_rope_store_torch(qkv2, *w2, c2, s2, cc[2], cc[3], slots.long(), heads2, kv2, 1e-6)
        for x, y in ((a, b), (cc[0], cc[2]), (cc[1], cc[3])):
            assert (x.float() - y.float()).abs().max() <= 1e-2 * y.float().abs().max(), (heads2, kv2, d2)
        assert torch.equal(cc[1], cc[3])  # values are copied, not computed
    gu = rnd(t, 2 * 6144)
    a, b = K.silu_mul(gu), K.silu_mul_torch(gu)
    assert (a.float() - b.float()).abs().max() <= 1e-2 * b.float().abs().max()


def _shuffled_block_tables(lens, block_size: int, num_blocks: int, width: int, seed: int):
    """Each sequence's blocks drawn in a shuffled order from 1..num_blocks-1 (block 0 is the padding
    rows'): the host lists and the device table (one row more, for padding)."""
    perm = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed)) + 1
    tables, i = [], 0
    for n in lens:
        need = -(-int(n) // block_size)
        tables.append(perm[i:i + need].tolist())
        i += need
    bt = torch.zeros(len(lens) + 1, width, dtype=torch.int32, device="cuda")
    for r, tb in enumerate(tables):
        bt[r, :len(tb)] = torch.tensor(tb)
    return tables, bt


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_paged_attention_kernel_equals_per_sequence_attention(dtype):
    """Decodes, whole prompts and chunks after a cached prefix in one call, GQA 2 and 4, blocks in a
    shuffled order: the Triton kernel against per-sequence SDPA (the CPU path) on the same cache."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from app.llm.attention import (
        AttentionMetadata,
        block_q_for,
        paged_attention,
        paged_attention_torch,
        work_table,
    )

    g = torch.Generator(device="cuda").manual_seed(1)
    for heads, kv, d in ((16, 8, 128), (32, 8, 128), (4, 2, 16)):
        bs, nblocks = 16, 256
        k_cache = torch.randn(nblocks * bs, kv, d, device="cuda", generator=g).to(dtype)
        v_cache = torch.randn(nblocks * bs, kv, d, device="cuda", generator=g).to(dtype)
        lens = np.array([1, 37, 300, 129, 513, 16, 64])  # keys after the step
        qlens = np.array([1, 37, 1, 64, 200, 16, 1])  # new queries (decode, prompt, chunk after a prefix)
        tables, bt = _shuffled_block_tables(lens, bs, nblocks, width=64, seed=2)
        q = torch.randn(int(qlens.sum()), heads, d, device="cuda", generator=g).to(dtype)
        qstart = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
        want = None
        # the prefill and decode program sizes, every tile length the engine or the benchmark uses, and
        # the causal split (unmasked tiles below the diagonal) on and off
        for block_m, block_n, split in itertools.product((64, 16), (32, 64, 128), (True, False)):
            bq = block_q_for(heads // kv, block_m)
            ws, w0 = work_table(qlens.astype(np.int32), bq)
            dev = {k: torch.tensor(v, dtype=torch.int32, device="cuda") for k, v in
                   {"qs": qstart, "lens": lens, "rows": np.arange(len(lens)), "ws": ws, "w0": w0}.items()}
            meta = AttentionMetadata(dev["qs"], dev["lens"], dev["rows"], bt, dev["ws"], dev["w0"], bq, bs, block_n,
                                     host_query_start=qstart, host_seq_lens=lens, host_block_tables=tables)
            got = paged_attention(q, k_cache, v_cache, meta, d ** -0.5, split=split)
            if want is None:
                want = paged_attention_torch(q.float(), k_cache.float(), v_cache.float(), meta, d ** -0.5)
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
            assert (got.float() - want).abs().max() <= tol * want.abs().max(), (heads, kv, d, block_m, block_n, split)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_attention_split_over_the_keys_equals_per_sequence_attention(dtype):
    """Decode steps with each sequence's keys split over 2, 5 and 16 programs and the partial softmaxes
    merged: lengths below, at and past one tile and across many, GQA 8 (30B-A3B), 16 with one KV head
    (235B-A22B per rank at TP=4) and 2; against per-sequence SDPA and the unsplit kernel."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from app.llm.attention import SPLIT_BLOCK_N, AttentionMetadata, paged_attention, paged_attention_torch

    g = torch.Generator(device="cuda").manual_seed(3)
    for heads, kv, d in ((32, 4, 128), (16, 1, 128), (16, 8, 128), (4, 2, 16)):
        bs, nblocks = 16, 400
        k_cache = torch.randn(nblocks * bs, kv, d, device="cuda", generator=g).to(dtype)
        v_cache = torch.randn(nblocks * bs, kv, d, device="cuda", generator=g).to(dtype)
        lens = np.array([1, 37, SPLIT_BLOCK_N, SPLIT_BLOCK_N + 1, 300, 513, 2000], dtype=np.int32)
        b = len(lens)
        tables, bt = _shuffled_block_tables(lens, bs, nblocks, width=200, seed=4)
        q = torch.randn(b, heads, d, device="cuda", generator=g).to(dtype)
        qstart = np.arange(b + 1, dtype=np.int32)

        ar = torch.arange(b + 1, dtype=torch.int32, device="cuda")
        one = AttentionMetadata(ar, torch.tensor(lens, device="cuda"), ar[:b], bt, ar[:b],
                                torch.zeros(b, dtype=torch.int32, device="cuda"), max(1, 16 // (heads // kv)), bs, 64,
                                host_query_start=qstart, host_seq_lens=lens, host_block_tables=tables)
        want = paged_attention_torch(q.float(), k_cache.float(), v_cache.float(), one, d ** -0.5)
        unsplit = paged_attention(q, k_cache, v_cache, one, d ** -0.5)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        for splits in (2, 5, 16):
            got = paged_attention(q, k_cache, v_cache, dataclasses.replace(one, kv_splits=splits), d ** -0.5)
            assert (got.float() - want).abs().max() <= tol * want.abs().max(), (heads, kv, d, splits)
            assert (got.float() - unsplit.float()).abs().max() <= tol * want.abs().max(), (heads, kv, d, splits)


def test_decode_splits_fill_the_gpu_only_where_a_step_has_few_programs():
    from app.llm.attention import decode_kv_splits

    assert decode_kv_splits(1, 4, 132) == 32  # 30B-A3B, one stream: 4 programs unsplit
    assert decode_kv_splits(1, 1, 132) == 32  # 235B-A22B's rank at TP=4: one
    assert decode_kv_splits(1, 1, 132, most=8) == 8 and decode_kv_splits(1, 4, 132, most=1) == 1
    assert decode_kv_splits(8, 4, 132) == 4
    assert decode_kv_splits(16, 8, 132) == 1  # 128 programs: the GPU is full either way
    assert all(decode_kv_splits(b, kv, 132) * b * kv <= max(132, b * kv) for b in range(1, 65) for kv in (1, 2, 4, 8))


@pytest.mark.gpu
def test_a_padded_step_layout_changes_no_real_row_of_attention():
    """A step graph runs every step on its token bucket's padded layout (model_runner.StepLayout): extra
    query rows, sequences with no queries and no keys, and attention programs pointing at them. The real
    rows' output is bit for bit the unpadded call's."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from app.llm.attention import AttentionMetadata, block_q_for, paged_attention, work_table
    from app.llm.step_inputs import StepLayout

    g = torch.Generator(device="cuda").manual_seed(3)
    heads, kv, d, bs = 16, 8, 128, 16
    lens = np.array([1, 37, 300, 129, 513, 16, 64])
    qlens = np.array([1, 37, 1, 64, 200, 16, 1], dtype=np.int32)
    k_cache = torch.randn(256 * bs, kv, d, device="cuda", generator=g).to(torch.bfloat16)
    v_cache = torch.randn(256 * bs, kv, d, device="cuda", generator=g).to(torch.bfloat16)
    bt = torch.zeros(len(lens) + 1, 64, dtype=torch.int32, device="cuda")  # the last row: padding (block 0)
    start = 1
    for r, n in enumerate(lens):
        need = -(-int(n) // bs)
        bt[r, :need] = torch.arange(start, start + need)
        start += need
    t = int(qlens.sum())
    q = torch.randn(t + 77, heads, d, device="cuda", generator=g).to(torch.bfloat16)  # 77 padding rows
    bq = block_q_for(heads // kv, 64)
    ws, w0 = work_table(qlens, bq)
    a = {"ids": np.zeros(t), "pos": np.zeros((3, t)), "slots": np.zeros(t), "vis_mask": np.zeros(t),
         "qstart": np.concatenate([[0], np.cumsum(qlens)]), "lens": lens, "rows": np.arange(len(lens)),
         "wseq": ws, "wq0": w0}

    def i32(x):
        return torch.tensor(np.asarray(x), dtype=torch.int32, device="cuda")

    exact = AttentionMetadata(i32(a["qstart"]), i32(lens), i32(a["rows"]), bt, i32(ws), i32(w0), bq, bs)
    want = paged_attention(q[:t], k_cache, v_cache, exact, d ** -0.5)
    layout = StepLayout(t + 77, len(lens) + 5, len(ws) + 40)
    v = layout.views(i32(layout.fill(a, padding_row=len(lens))))
    assert (v["wseq"][len(ws):] == len(lens) + 4).all() and (v["lens"][len(lens):] == 0).all()
    padded = AttentionMetadata(v["qstart"], v["lens"], v["rows"], bt, v["wseq"], v["wq0"], bq, bs)
    got = paged_attention(q, k_cache, v_cache, padded, d ** -0.5)
    assert torch.equal(got[:t], want)
