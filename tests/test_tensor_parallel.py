"""Tensor parallelism on the CPU: 2 and 4 ranks over gloo, each its own process holding its share of
the tiny checkpoints (dense Qwen3-VL and Qwen3-VL-MoE, experts split by units and by whole experts),
give the logits of one rank holding everything, within fp32 rounding (the all-reduces sum partial
products in another order). Vision rows and deepstack features ride along: they are replicated."""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

CASES = [("tiny", "tp"), ("tiny-qwen3-vl-moe", "tp"), ("tiny-qwen3-vl-moe", "ep")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prefill_logits(model, seed: int = 0) -> torch.Tensor:
    """Logits of a 40-token prompt with 12 vision rows (random embeddings and deepstack features) over
    a paged cache whose blocks are out of order."""
    from app.llm.attention import AttentionMetadata
    from app.llm.model import VisionBatch

    s, n, bs = model.spec, 40, 4
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, s.vocab, (n,), generator=g)
    vis = torch.arange(10, 22)
    main = torch.randn(len(vis), s.hidden, generator=g)
    deep = torch.randn(s.deepstack_layers, len(vis), s.hidden, generator=g)
    pos = torch.stack([torch.arange(n), torch.arange(n) // 2, torch.arange(n) % 7])
    blocks = n // bs + 1
    table = list(reversed(range(blocks)))
    slots = torch.tensor([table[i // bs] * bs + i % bs for i in range(n)])
    kv = torch.zeros(s.layers, 2, blocks * bs, model.local.kv_heads, s.head_dim)
    meta = AttentionMetadata(*[None] * 6, block_q=8, block_size=bs, host_query_start=np.array([0, n]),
                             host_seq_lens=np.array([n]), host_block_tables=[table])
    with torch.no_grad():
        h = model(ids, pos, slots, kv, meta, VisionBatch.from_rows(vis, main, deep, n))
        return model.logits(h)


def _rank(rank: int, size: int, port: int, cache: str, out: str) -> None:
    import torch.distributed as dist

    from app.checkpoints.model_builder import ensure_embedded
    from app.llm.loader import load_checkpoint
    from app.llm.parallel import TensorParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        results = {}
        for preset, moe in CASES:
            tp = TensorParallel(rank, size, moe=moe)
            model = load_checkpoint(ensure_embedded(preset, cache), torch.float32, torch.device("cpu"), 256, tp).model
            results[(preset, moe)] = _prefill_logits(model)
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def single_rank(model_cache):
    from app.checkpoints.model_builder import ensure_embedded
    from app.llm.loader import load_checkpoint

    out = {}
    for preset, moe in CASES:
        model = load_checkpoint(ensure_embedded(preset, model_cache), torch.float32, torch.device("cpu"), 256).model
        out[(preset, moe)] = _prefill_logits(model)
    return out


@pytest.mark.parametrize("size", [2, 4])
def test_ranks_together_give_the_single_rank_logits(single_rank, model_cache, tmp_path, size):
    out = str(tmp_path / "logits.pt")
    mp.spawn(_rank, args=(size, _free_port(), model_cache, out), nprocs=size, join=True)
    got = torch.load(out)
    for case, want in single_rank.items():
        assert got[case].shape == want.shape, case
        assert (got[case] - want).abs().max() <= 1e-5 * want.abs().max(), case


def test_shares_follow_the_heads_units_and_vocabulary():
    from app.llm.model import LocalShapes
    from app.llm.parallel import TensorParallel
    from app.llm.spec import TextSpec

    spec = TextSpec(vocab=151936, hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, intermediate=6144,
                    eps=1e-6, rope_theta=5e6, rope_axes=(0,) * 64, experts=128, experts_per_token=8,
                    expert_intermediate=768, sparse_layers=tuple(range(48)))
    tp8 = TensorParallel(5, 8)
    shapes = LocalShapes.of(spec, tp8)
    # 4 KV heads over 8 ranks: each rank keeps the KV head its 4 query heads (20..23) read
    assert (shapes.heads, shapes.kv_heads) == (4, 1) and tp8.kv_heads(32, 4) == (2, 1)
    assert (shapes.experts, shapes.expert_intermediate) == (128, 96)
    assert LocalShapes.of(spec, TensorParallel(1, 2, moe="ep")).experts == 64
    assert TensorParallel(3, 4).padded_part(10) == (9, 10, 3)  # the last share is padded
    with pytest.raises(ValueError, match="do not split"):
        LocalShapes.of(spec, TensorParallel(0, 3))


def test_an_all_reduce_goes_through_the_fast_path_only_where_it_fits():
    """TensorParallel.all_reduce: a tensor the small-message path takes goes there; any other to NCCL
    (here: no process group, so torch.distributed says so)."""

    class Fast:
        def __init__(self):
            self.calls = 0

        def fits(self, x):
            return x.numel() <= 4

        def __call__(self, x):
            self.calls += 1
            return x.mul_(2)  # what two ranks holding the same x would sum to

    from app.llm.parallel import TensorParallel

    fast = Fast()
    tp = TensorParallel(0, 2, fast=fast)
    assert torch.equal(tp.all_reduce(torch.ones(4)), torch.full((4,), 2.0)) and fast.calls == 1
    with pytest.raises((RuntimeError, ValueError), match="[Dd]efault process group|init_process_group"):
        tp.all_reduce(torch.ones(5))
    assert fast.calls == 1
    assert TensorParallel(0, 1, fast=fast).all_reduce(torch.ones(2)).sum() == 2 and fast.calls == 1  # one rank


def _gpu_rank(rank: int, size: int, port: int, cache: str, out: str) -> None:
    import torch.distributed as dist

    from app.checkpoints.model_builder import ensure_embedded
    from app.llm.loader import load_checkpoint
    from app.llm.parallel import TensorParallel
    from app.llm.symm_all_reduce import checked_symm_all_reduce

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            device_id=torch.device("cuda", rank))
    try:
        results = {}
        dev = torch.device("cuda", rank)
        fast = checked_symm_all_reduce(None, dev, torch.bfloat16, rank)
        results["symm_available"] = fast is not None
        if fast is not None:
            results["symm_in_graph"] = _symm_all_reduce_in_a_graph(fast, rank, dev)
        for preset, moe in CASES:
            path = ensure_embedded(preset, cache)
            for how in ("nccl", "symm") if fast is not None else ("nccl",):
                tp = TensorParallel(rank, size, moe=moe, fast=fast if how == "symm" else None)
                model = load_checkpoint(path, torch.bfloat16, dev, 256, tp).model
                results[(preset, moe, how)] = _prefill_logits_cuda(model).float().cpu()
                del model
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def _symm_all_reduce_in_a_graph(fast, rank: int, dev: torch.device) -> bool:
    """The symmetric all-reduce captured in a CUDA graph as the engine captures its decode graphs
    (cuda_graphs._capture) and replayed on new inputs equals NCCL's sums (integers: exact in any order)."""
    import torch.distributed as dist

    from app.llm.cuda_graphs import _capture

    x = torch.zeros(7, 2048, dtype=torch.bfloat16, device=dev)
    graph = _capture(lambda: fast(x), dev, None)
    same = True
    for step in range(3):
        fresh = ((torch.arange(x.numel(), device=dev) * (step + 1) + rank) % 31).to(torch.bfloat16).view_as(x)
        want = fresh.clone()
        dist.all_reduce(want)
        x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize(dev)
        same = same and torch.equal(x, want)
    return same


def _prefill_logits_cuda(model) -> torch.Tensor:
    """As _prefill_logits, through the Triton kernels (paged attention, fused MoE) on the GPU."""
    from app.llm.attention import AttentionMetadata, block_q_for, work_table

    s, n, bs, dev = model.spec, 40, 4, model.device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, s.vocab, (n,), generator=g).to(dev)
    pos = torch.stack([torch.arange(n), torch.arange(n) // 2, torch.arange(n) % 7]).to(dev, torch.int32)
    blocks = n // bs + 1
    table = torch.tensor([list(reversed(range(blocks)))], dtype=torch.int32, device=dev)
    slots = torch.tensor([(blocks - 1 - i // bs) * bs + i % bs for i in range(n)], dtype=torch.int32, device=dev)
    kv = torch.zeros(s.layers, 2, blocks * bs, model.local.kv_heads, s.head_dim, dtype=model.dtype, device=dev)
    bq = block_q_for(model.local.heads // model.local.kv_heads, 64)
    ws, w0 = work_table(np.array([n]), bq)

    def i32(a):
        return torch.tensor(np.asarray(a), dtype=torch.int32, device=dev)

    meta = AttentionMetadata(i32([0, n]), i32([n]), i32([0]), table, i32(ws), i32(w0), bq, bs)
    with torch.no_grad():
        return model.logits(model(ids, pos, slots, kv, meta))


@pytest.mark.gpu
def test_two_gpus_over_nccl_give_one_gpus_logits(model_cache, tmp_path):
    """bf16: two ranks' logits against one rank's, within bf16 rounding of the partial sums' order; with
    the symmetric-memory all-reduce, the same as NCCL's."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from app.checkpoints.model_builder import ensure_embedded
    from app.llm.loader import load_checkpoint

    for preset, _ in CASES:  # built here: ranks building it at once would read each other's half-written folder
        ensure_embedded(preset, model_cache)
    out = str(tmp_path / "logits.pt")
    mp.spawn(_gpu_rank, args=(2, _free_port(), model_cache, out), nprocs=2, join=True)
    got = torch.load(out)
    for preset, moe in CASES:
        model = load_checkpoint(ensure_embedded(preset, model_cache), torch.bfloat16, torch.device("cuda", 0), 256).model
        want = _prefill_logits_cuda(model).float().cpu()
        err = (got[(preset, moe, "nccl")] - want).norm() / want.norm()
        assert err < 2e-2, (preset, moe, float(err))
    # the symmetric-memory all-reduce (llm.tp_all_reduce: symm_mem): at two ranks a sum has two terms,
    # rounded once either way, so its logits equal NCCL's bit for bit, and so do its graph replays
    assert got["symm_available"], "symmetric memory did not start on two GPUs of one host (see the ranks' log)"
    assert got["symm_in_graph"]
    for preset, moe in CASES:
        assert torch.equal(got[(preset, moe, "symm")], got[(preset, moe, "nccl")]), (preset, moe)


def test_each_rank_reads_only_its_share_of_the_checkpoint(model_cache):
    """Safetensors slices: no rank of two reads a whole attention, MLP, expert or vocabulary tensor."""
    from app.checkpoints.model_builder import ensure_embedded
    from app.llm.model import TextModel
    from app.llm.parallel import TensorParallel
    from app.llm.spec import TextSpec
    from app.llm.weights import TensorSource, checkpoint_sources, load_weights

    path = ensure_embedded("tiny-qwen3-vl-moe", model_cache)
    spec = TextSpec.from_config(__import__("json").loads((path / "config.json").read_text()))
    read: dict[str, tuple[int, int]] = {}  # name -> (elements read, elements in the tensor)

    def recording(sources):
        for src in sources:
            def read_part(idx, src=src):
                part = src.read(idx)
                n = read.get(src.name, (0, 0))[0]
                read[src.name] = (n + part.numel(), int(np.prod(src.shape)))
                return part
            yield TensorSource(src.name, src.shape, read_part)

    model = TextModel(spec, torch.float32, torch.device("cpu"), 64, TensorParallel(1, 2))
    load_weights(model, recording(checkpoint_sources(path, torch.device("cpu"), (*spec.prefixes, spec.head_name))))
    split = [n for n in read if any(k in n for k in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj", "experts.", "embed_tokens", "lm_head"))]
    assert split and all(read[n][0] * 2 == read[n][1] for n in split), {n: read[n] for n in split}
    norms = [n for n in read if n.endswith("norm.weight") or n.endswith("mlp.gate.weight")]
    assert norms and all(read[n][0] == read[n][1] for n in norms)  # replicated: read whole


def test_the_symmetric_path_takes_only_what_its_kernel_can_write():
    """SymmetricAllReduce.fits, on a buffer made without a process group (the method reads only its
    dtype and size): bf16 or float32 of its dtype, contiguous, at most its size, whole 4-byte words,
    and 16-byte aligned, since the kernel writes its result into the tensor in 16-byte vectors."""
    from app.llm.symm_all_reduce import SymmetricAllReduce

    fast = SymmetricAllReduce.__new__(SymmetricAllReduce)
    fast.buffer = torch.empty(64, dtype=torch.bfloat16)
    x = torch.zeros(64, dtype=torch.bfloat16)
    assert x.data_ptr() % 16 == 0 and fast.fits(x) and fast.fits(x[:8])
    assert not fast.fits(x[1:9])  # 2 bytes past an aligned start
    assert not fast.fits(x[8:11])  # 6 bytes: not whole words
    assert not fast.fits(torch.zeros(65, dtype=torch.bfloat16))  # larger than the buffer
    assert not fast.fits(torch.zeros(8, dtype=torch.float32))  # another dtype
    assert not fast.fits(torch.zeros(8, 8, dtype=torch.bfloat16)[:, :2])  # not contiguous
