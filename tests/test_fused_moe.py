"""The fused MoE layer (app/llm/fused_moe.py): the reference against transformers' experts, the
alignment's invariants on the CPU, and the Triton kernels against the reference on CUDA."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app.llm.fused_moe import (
    align_by_expert,
    align_capacity,
    fused_moe,
    moe_config,
    moe_reference,
)

ROOT = Path(__file__).resolve().parent.parent


def _experts(hidden, inter, experts, k, tokens, seed=0, dtype=torch.float32, device="cpu"):
    """Random weights in transformers' layout and routed inputs (softmax top-k, renormalised)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    x = rnd(tokens, hidden)
    w_gate_up = rnd(experts, 2 * inter, hidden, scale=hidden ** -0.5)
    w_down = rnd(experts, hidden, inter, scale=inter ** -0.5)
    logits = torch.randn(tokens, experts, generator=g, device=device)
    weights, ids = torch.topk(logits.softmax(-1), k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
    return x, w_gate_up, w_down, ids, weights


def test_reference_equals_transformers_experts_module():
    from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeTextConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
        Qwen3VLMoeTextExperts,
        Qwen3VLMoeTextTopKRouter,
    )

    cfg = Qwen3VLMoeTextConfig(hidden_size=64, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                               experts_implementation="eager")
    experts, router = Qwen3VLMoeTextExperts(cfg), Qwen3VLMoeTextTopKRouter(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=g) * 0.1)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=g) * 0.1)
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        for tokens in (1, 5, 37):
            x = torch.randn(tokens, 64, generator=g)
            _, weights, ids = router(x)
            want = experts(x, ids, weights)
            got = moe_reference(x, experts.gate_up_proj, experts.down_proj, ids, weights)
            assert torch.equal(got, want), tokens


def test_out_of_range_experts_contribute_nothing():
    x, wgu, wd, ids, weights = _experts(32, 24, 8, 3, 19, seed=1)
    ids = ids.clone()
    drop = torch.rand(ids.shape, generator=torch.Generator().manual_seed(2)) < 0.4
    ids[drop] = torch.tensor([-1, 8, 100])[torch.arange(int(drop.sum())) % 3]
    # the same assignments with those slots pointing at a real expert but weighted zero
    zeroed_ids = torch.where(drop, 0, ids)
    zeroed_w = torch.where(drop, 0.0, weights)
    got = fused_moe(x, wgu, wd, ids, weights)
    assert torch.allclose(got, moe_reference(x, wgu, wd, zeroed_ids, zeroed_w), atol=1e-6)
    # and every slot out of range: zeros
    assert torch.equal(fused_moe(x, wgu, wd, torch.full_like(ids, -1), weights), torch.zeros_like(x))


def _check_alignment(ids, experts, block_m):
    """align_by_expert's promises, checked on the CPU whatever device ran it."""
    sorted_ids, expert_of_block, total = (t.cpu() for t in align_by_expert(ids, experts, block_m))
    ids = ids.cpu()
    n = ids.numel()
    cap = align_capacity(n, experts, block_m)
    assert sorted_ids.shape == (cap,) and cap % block_m == 0 and expert_of_block.shape == (cap // block_m,)
    assert sorted_ids.dtype == expert_of_block.dtype == total.dtype == torch.int32
    total = int(total)
    assert total % block_m == 0 and total <= cap
    flat = ids.reshape(-1).long()
    bucket = torch.where((flat >= 0) & (flat < experts), flat, experts)
    assert torch.all(sorted_ids[total:] == n)  # nothing past the padded length
    used = sorted_ids[:total].long()
    real = used[used < n]
    assert torch.equal(real.sort().values, torch.arange(n))  # every assignment exactly once
    blocks = expert_of_block[:total // block_m].long()
    assert torch.all(blocks[1:] >= blocks[:-1])  # grouped by expert, the out-of-range bucket last
    per_row = blocks.repeat_interleave(block_m)
    live = used < n
    assert torch.equal(bucket[used[live]], per_row[live])  # each row belongs to its block's expert
    for b in blocks.unique().tolist():  # each group: its rows first, then padding, a whole number of blocks
        rows = used[per_row == b]
        c = int((bucket == b).sum())
        assert c > 0 and rows.numel() == -(-c // block_m) * block_m
        assert torch.all(rows[:c] < n) and torch.all(rows[c:] == n)


ALIGN_CASES = [(1, 8, 128), (7, 2, 8), (300, 8, 16), (50, 4, 5)]


@pytest.mark.parametrize("block_m", [1, 4, 16, 64])
@pytest.mark.parametrize("tokens,k,experts", ALIGN_CASES)
def test_alignment_groups_every_assignment_by_expert(tokens, k, experts, block_m):
    g = torch.Generator().manual_seed(tokens * 31 + block_m)
    _check_alignment(torch.randint(-2, experts + 2, (tokens, k), generator=g, dtype=torch.int32), experts, block_m)


def test_config_table_covers_decode_and_prefill():
    decode = moe_config(1, 8, 128, 2048, 768)
    prefill = moe_config(2048, 8, 128, 2048, 768)
    assert decode["BLOCK_M"] == 16 and prefill["BLOCK_M"] == 64
    for t in (1, 8, 64, 512, 2048, 16384):
        cfg = moe_config(t, 8, 128, 4096, 384)
        assert {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"} <= set(cfg)
        assert cfg.get("DIRECT", False) == (t <= 2)  # single-stream decode skips the sorting


def test_benchmark_smoke_runs_on_the_cpu(tmp_path):
    out = tmp_path / "moe.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "moe_kernel.py"), "--smoke", "--out", str(out)],
                   check=True, cwd=ROOT, capture_output=True, timeout=120)
    res = json.loads(out.read_text())
    assert res["rows"] and all(r["rel_err"] < 1e-5 for r in res["rows"])


# ---------------------------------------------------------------------------- GPU
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _rel(got, want):
    return ((got.float() - want).norm() / want.norm()).item()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("tokens,k,experts", ALIGN_CASES + [(2048, 8, 128), (5000, 8, 128)])
def test_triton_alignment_keeps_the_same_promises(tokens, k, experts, block_m):
    g = torch.Generator().manual_seed(tokens + block_m)
    ids = torch.randint(-2, experts + 2, (tokens, k), generator=g)
    _check_alignment(ids.cuda(), experts, block_m)  # int64 ids
    _check_alignment(ids.int().cuda(), experts, block_m)
    in_range = torch.randint(0, experts, (tokens, k), generator=g).cuda()  # no out-of-range bucket
    _check_alignment(in_range, experts, block_m)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 7, 64, 512, 2048])
def test_fused_moe_bf16_30b_shape(tokens):
    x, wgu, wd, ids, weights = _experts(2048, 768, 128, 8, tokens, seed=tokens, dtype=torch.bfloat16, device="cuda")
    got = fused_moe(x, wgu, wd, ids, weights)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    want = moe_reference(x.float(), wgu.float(), wd.float(), ids, weights.float())
    assert _rel(got, want) < 1e-2, tokens


@pytest.mark.gpu
@needs_cuda
def test_fused_moe_bf16_out_of_range_ids_and_float32_weights():
    x, wgu, wd, ids, weights = _experts(2048, 768, 128, 8, 300, seed=5, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(6)
    # expert parallelism: this rank holds experts 0..63, the rest are remapped out of range
    local = torch.where(ids < 64, ids, torch.where(torch.rand(ids.shape, generator=g, device="cuda") < 0.5, -1, 64))
    wgu, wd = wgu[:64].contiguous(), wd[:64].contiguous()
    w32 = weights.float()
    got = fused_moe(x, wgu, wd, local, w32)
    keep = (local >= 0) & (local < 64)
    want = moe_reference(x.float(), wgu.float(), wd.float(), torch.where(keep, local, 0),
                         torch.where(keep, w32, 0.0))
    assert _rel(got, want) < 1e-2
    assert torch.equal(fused_moe(x, wgu, wd, torch.full_like(local, 64), w32), torch.zeros_like(x))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 33, 300])
def test_fused_moe_float32_small_shape(tokens):
    # sizes that are not multiples of the tiles: masked K steps and N tiles, int64 ids
    x, wgu, wd, ids, weights = _experts(200, 72, 16, 4, tokens, seed=7, device="cuda")
    want = moe_reference(x, wgu, wd, ids, weights)
    for cfg in (None, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4, "num_warps": 4, "num_stages": 2}):
        got = fused_moe(x, wgu, wd, ids, weights, config=cfg)
        assert _rel(got, want) < 1e-4, (tokens, cfg)
    # a non-contiguous x (a column slice of a wider buffer)
    wide = torch.zeros(tokens, 256, device="cuda")
    wide[:, 16:216] = x
    assert _rel(fused_moe(wide[:, 16:216], wgu, wd, ids.int(), weights), want) < 1e-4
    # and a column-major one (the kernel takes both strides)
    assert _rel(fused_moe(x.t().contiguous().t(), wgu, wd, ids, weights), want) < 1e-4


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_fused_moe_replays_in_a_cuda_graph(tokens):
    x, wgu, wd, ids, weights = _experts(2048, 768, 128, 8, tokens, seed=11, dtype=torch.bfloat16, device="cuda")
    eager = fused_moe(x, wgu, wd, ids, weights)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fused_moe(x, wgu, wd, ids, weights)  # compiled before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, wgu, wd, ids, weights)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    # new routing and inputs copied into the captured buffers: the replay follows them
    x2, _, _, ids2, weights2 = _experts(2048, 768, 128, 8, tokens, seed=12, dtype=torch.bfloat16, device="cuda")
    x.copy_(x2)
    ids.copy_(ids2)
    weights.copy_(weights2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fused_moe(x, wgu, wd, ids, weights))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 2])
def test_direct_path_for_a_few_tokens_equals_the_sorted_path_and_skips_experts_held_elsewhere(tokens):
    x, wgu, wd, ids, weights = _experts(2048, 768, 128, 8, tokens, seed=21, dtype=torch.bfloat16, device="cuda")
    assert moe_config(tokens, 8, 128, 2048, 768).get("DIRECT")
    sorted_cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 4}
    direct = fused_moe(x, wgu, wd, ids, weights)
    assert torch.allclose(direct.float(), fused_moe(x, wgu, wd, ids, weights, config=sorted_cfg).float(),
                          rtol=0, atol=2e-2 * direct.float().abs().max().item())
    want = moe_reference(x.float(), wgu.float(), wd.float(), ids, weights.float())
    assert _rel(direct, want) < 1e-2
    # expert parallelism: experts 64.. live on another rank, ids shifted out of range on both sides
    local = torch.where(ids < 64, ids, torch.where(ids % 2 == 0, -1, 64))
    keep = (local >= 0) & (local < 64)
    got = fused_moe(x, wgu[:64].contiguous(), wd[:64].contiguous(), local, weights)
    want = moe_reference(x.float(), wgu[:64].float(), wd[:64].float(), torch.where(keep, local, 0),
                         torch.where(keep, weights.float(), 0.0))
    assert _rel(got, want) < 1e-2
    assert torch.equal(fused_moe(x, wgu[:64].contiguous(), wd[:64].contiguous(), torch.full_like(local, -1), weights),
                       torch.zeros_like(x))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 2, 7])
def test_unsummed_experts_give_the_next_add_rmsnorm_the_same_bits(tokens):
    """`sum_k=False`: the few-token path hands back its k weighted rows per token, and add+RMSNorm (or
    `sum_over_k`) sums them exactly as the path's own sum kernel did; more tokens come back summed."""
    from app.llm.fused_moe import sum_over_k
    from app.llm.kernels import add_rmsnorm

    x, wgu, wd, ids, weights = _experts(2048, 768, 128, 8, tokens, seed=31, dtype=torch.bfloat16, device="cuda")
    whole = fused_moe(x, wgu, wd, ids, weights)
    parts = fused_moe(x, wgu, wd, ids, weights, sum_k=False)
    if tokens > 2:
        assert torch.equal(parts, whole)  # the sorted path sums anyway
        return
    assert parts.shape == (tokens, 8, 2048) and torch.equal(sum_over_k(parts), whole)
    residual = torch.randn(tokens, 2048, device="cuda").to(torch.bfloat16)
    norm = torch.randn(2048, device="cuda").to(torch.bfloat16)
    r1, h1 = add_rmsnorm(residual.clone(), whole, norm, 1e-6)
    r2, h2 = add_rmsnorm(residual.clone(), parts, norm, 1e-6)
    assert torch.equal(r1, r2) and torch.equal(h1, h2)
