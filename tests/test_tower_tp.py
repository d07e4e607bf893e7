"""The vision tower in a tensor-parallel group (app/vision/tensor_parallel.py), 2 ranks over gloo on the
CPU, tiny Qwen3-VL tower in float32: (c) the sharded tower gives every rank the whole tower's outputs
within fp32 rounding (the all-reduce sums partial products in another order), for the reference body
and the fused one; (a) the broadcast and (b) the data-parallel gather give every rank exactly rank 0's
outputs in item order."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.multiprocessing as mp

from app.media.preprocess import PatchSpec
from app.serving.tensor_parallel import free_address

GRIDS = [(1, 8, 8), (2, 4, 6), (1, 6, 4), (1, 4, 4)]  # an image, a 4-frame video, two more images
ATOL = RTOL = 1e-5  # float32: only the order of the partial sums differs


def _visual(dtype=torch.float32, device="cpu"):
    from transformers import AutoConfig

    from app.checkpoints.model_builder import load_preset
    from app.vision.loading import vision_params

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(**load_preset("tiny")).vision_config
    return vision_params(cfg, torch.float32).to(device, dtype)  # a replica's module, the same weights anywhere


def _items(patch_dim: int):
    from app.vision.graphs import VisionItem

    g = torch.Generator().manual_seed(1)
    return [VisionItem(torch.randint(0, 256, (t * h * w, patch_dim), generator=g, dtype=torch.uint8), (t, h, w))
            for t, h, w in GRIDS]


def _manager(tower):
    from app.vision.graphs import GraphManager, GraphSettings

    return GraphManager(tower, GraphSettings([512], use_cuda_graphs=False, autotune=False, uint8_pixels=True,
                                             observe_dispatch=False))


NORM = PatchSpec().column_norm()  # uint8 rows normalised inside the tower, as served (Qwen3-VL's defaults)


def _whole(fused: bool, shares: list[list[int]]) -> tuple[list, list]:
    """Every item's (main, *deepstack) from one process holding the whole tower (one thread, as the
    ranks run): of the whole batch, and of each share's batch on its own."""
    from app.vision.tower import VisionTower

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        mgr = _manager(VisionTower(_visual(), NORM, fused=fused))
        items = _items(mgr.tower.patch_dim)
        whole = mgr.encode(items, force_eager=True)
        by_share = {i: e for s in shares for i, e in zip(s, mgr.encode([items[i] for i in s], force_eager=True))}
        return [[e.main, *e.deepstack] for e in whole], [[by_share[i].main, *by_share[i].deepstack]
                                                        for i in range(len(items))]
    finally:
        torch.set_num_threads(threads)


def _rank(rank: int, size: int, address: str, out: str, cuda: bool = False) -> None:
    import torch.distributed as dist

    from app.llm.parallel import TensorParallel
    from app.vision.tensor_parallel import (
        OutputSpec,
        balanced_shares,
        broadcast_outputs,
        data_parallel_encode,
        shard_tower,
    )
    from app.vision.tower import VisionTower

    torch.set_num_threads(1)
    dtype, device = torch.float32, torch.device("cpu")
    if cuda:
        dtype, device = torch.bfloat16, torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=f"tcp://{address}", rank=rank, world_size=size, device_id=device)
    else:
        dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=size)
    try:
        tp = TensorParallel(rank, size)
        results = {}
        with torch.inference_mode():
            for fused in (False, True):
                visual = _visual(dtype, device)
                whole = _manager(VisionTower(copy.deepcopy(visual), NORM, fused=fused))
                items = _items(whole.tower.patch_dim)
                spec, lay = OutputSpec.of(whole.tower), whole.tower.layout(GRIDS)
                sharded = _manager(shard_tower(VisionTower(visual, NORM, fused=fused), tp))
                a = broadcast_outputs(whole.encode(items, force_eager=True) if rank == 0 else None,
                                      lay.out_rows, spec, tp)
                shares = balanced_shares([t * h * w for t, h, w in GRIDS], size)
                b = data_parallel_encode(functools.partial(whole.encode, force_eager=True),
                                         [items[i] for i in shares[rank]], shares, lay.out_rows, spec, tp)
                c = sharded.encode(items, force_eager=True)
                results[fused] = {m: [[e.main.float().cpu(), *(d.float().cpu() for d in e.deepstack)] for e in embs]
                                  for m, embs in (("a", a), ("b", b), ("c", c))}
                results[fused]["shares"] = shares
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_three_ways_give_every_rank_the_whole_towers_outputs(tmp_path):
    out = str(tmp_path / "tower_tp.pt")
    mp.spawn(_rank, args=(2, free_address("127.0.0.1"), out), nprocs=2, join=True)
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    for fused in (False, True):
        shares = ranks[0][fused]["shares"]
        assert shares == [[0, 3], [1, 2]]  # 64 + 16 tokens against 48 + 24
        whole, per_share = _whole(fused, shares)
        for got in ranks:
            got = got[fused]
            for i, (w, s, a, b, c) in enumerate(zip(whole, per_share, got["a"], got["b"], got["c"], strict=True)):
                for j in range(len(w)):
                    # (a) is rank 0's batch, broadcast: bit for bit. (b) is each share's batch, gathered:
                    # bit for bit that batch's rows; against the whole batch only within fp32 rounding,
                    # since GEMMs over other row counts may sum in another order.
                    assert torch.equal(a[j], w[j]), (fused, i, j)
                    assert torch.equal(b[j], s[j]), (fused, i, j)
                    torch.testing.assert_close(b[j], w[j], atol=ATOL, rtol=RTOL)
                    torch.testing.assert_close(c[j], w[j], atol=ATOL, rtol=RTOL)


def test_heads_that_do_not_split_are_refused():
    from app.llm.parallel import TensorParallel
    from app.vision.tensor_parallel import shard_tower
    from app.vision.tower import VisionTower

    with pytest.raises(ValueError, match="4 attention heads do not split evenly over 3"):
        shard_tower(VisionTower(_visual(), NORM), TensorParallel(0, 3))


@pytest.mark.gpu
def test_two_gpus_over_nccl_shard_the_tower():
    """bf16 on 2 GPUs (Triton kernels, NCCL): every rank holds the same (a) and (b) outputs, and (c) is
    (a) within bf16 rounding of the partial sums."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/tower_tp.pt"
        mp.spawn(_rank, args=(2, free_address("127.0.0.1"), out, True), nprocs=2, join=True)
        ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    for fused in (False, True):
        for mode in "ab":
            assert all(torch.equal(x, y) for e0, e1 in zip(ranks[0][fused][mode], ranks[1][fused][mode])
                       for x, y in zip(e0, e1)), (fused, mode)
        for got in ranks:
            for ea, ec in zip(got[fused]["a"], got[fused]["c"], strict=True):
                for x, y in zip(ea, ec, strict=True):
                    assert (y - x).norm() <= 2e-2 * x.norm(), (fused, float((y - x).norm() / x.norm()))
