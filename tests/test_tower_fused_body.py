"""Every tower's fused body (the CUDA path: float32 residual stream, fused add+norm, one qkv or gate/up
GEMM, the MLP width padded with zero units, bias-free GEMMs given a zero bias) against its
reference-op body, both on the CPU in float32 (the Triton kernels' torch fallbacks run there).

The padding (`kernels.pad_mlp`) adds units whose activation is exactly zero, so the outputs may differ
only by float32 rounding of differently ordered sums. The tiny models' MLP widths (96 and 128) are
multiples of 64 or pad to 128; PAD_MULTIPLE 80 here makes every family pad (to 160). A wrong padding
(a shifted half of Qwen2.5-VL's fused [gate; up], a non-zero unit) errs by O(1).
"""

from __future__ import annotations

import pytest
import torch

from app.vision import kernels
from app.vision.graphs import GraphManager, GraphSettings, VisionItem
from app.vision.loading import build_tower

TOL = 1e-5
# (preset, grids): an image and a second item of another shape (a two-frame video where the family
# takes video; MiniCPM-V items are slices)
CASES = {"tiny": [(1, 6, 10), (2, 4, 4)], "tiny-qwen2.5-vl": [(1, 16, 12), (2, 8, 8)],
         "tiny-minicpm-v-4.5": [(1, 10, 14), (1, 6, 6)]}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def mlp_widths(tower) -> set[int]:
    return {w2.shape[1] for w2 in tower.down_weights}


def test_pad_mlp_adds_zero_units_that_change_nothing():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 24, generator=g, dtype=torch.float64)
    w1, b1, w2 = (torch.randn(2 * 90, 24, generator=g, dtype=torch.float64),
                  torch.randn(2 * 90, generator=g, dtype=torch.float64),
                  torch.randn(24, 90, generator=g, dtype=torch.float64))
    p1, q1, p2 = kernels.pad_mlp(w1, b1, w2, halves=2)
    assert p1.shape == (256, 24) and q1.shape == (256,) and p2.shape == (24, 128)

    def swiglu(w, b, down, width):
        gu = x @ w.T + b
        return (torch.nn.functional.silu(gu[:, :width]) * gu[:, width:]) @ down.T

    assert torch.allclose(swiglu(p1, q1, p2, 128), swiglu(w1, b1, w2, 90), rtol=1e-12, atol=1e-12)
    # each half keeps its own rows, in place; the padding is zero
    assert torch.equal(p1[:90], w1[:90]) and torch.equal(p1[128:218], w1[90:]) and not p1[90:128].any()
    assert torch.equal(p2[:, :90], w2) and not p2[:, 90:].any()
    same = kernels.pad_mlp(w1[:128], b1[:128], w2[:, :64].contiguous())  # already a multiple: untouched
    assert same[2].shape == (24, 64)


@pytest.mark.parametrize("preset", list(CASES))
def test_fused_body_with_padded_mlps_equals_the_reference_ops(preset, model_cache, monkeypatch):
    from app.checkpoints.model_builder import ensure_embedded

    monkeypatch.setattr(kernels, "PAD_MULTIPLE", 80)
    path = ensure_embedded(preset, model_cache)
    plain = build_tower(path, torch.float32, "cpu", fused=False)
    fused = build_tower(path, torch.float32, "cpu", fused=True)
    assert mlp_widths(fused) == {160}
    g = torch.Generator().manual_seed(1)
    items = [VisionItem(torch.randn(t * h * w, plain.patch_dim, generator=g), (t, h, w)) for t, h, w in CASES[preset]]
    settings = GraphSettings(budgets=[512], max_items_per_batch=4, max_frames_per_batch=8, autotune=False)
    with torch.inference_mode():
        ref = GraphManager(plain, settings).encode(items, force_eager=True)
        mgr = GraphManager(fused, settings)
        for out in (mgr.encode(items, force_eager=True), mgr.encode(items)):  # exact shape, then padded to 512
            for a, b in zip(out, ref, strict=True):
                assert rel(a.main, b.main) <= TOL, rel(a.main, b.main)
                for da, db in zip(a.deepstack, b.deepstack, strict=True):
                    assert rel(da, db) <= TOL
        assert mgr.stats.per_budget[512] == 1


def test_down_projection_ways_agree_and_other_counts_take_the_nearest_tuned_choice():
    from app.vision.down_projection import CUBLAS, CUBLAS_PADDED, LT_PADDED, DownProjection

    g = torch.Generator().manual_seed(2)
    dp = DownProjection(90, 128, 24, torch.float64, torch.device("cpu"))
    assert dp.ways == (CUBLAS, CUBLAS_PADDED, LT_PADDED)
    u, w = torch.randn(7, 128, generator=g, dtype=torch.float64), torch.randn(24, 128, generator=g, dtype=torch.float64)
    u[:, 90:], w[:, 90:] = 0, 0  # the padded units and columns, as pad_mlp makes them
    want = u[:, :90] @ w[:, :90].T
    for way in dp.ways:
        assert torch.allclose(dp.run(way, u, w), want, rtol=1e-12, atol=1e-12), way
    assert dp.way_for(100) == CUBLAS_PADDED  # nothing tuned: the padded product
    dp.tune([256], [w])  # off CUDA: nothing is timed
    assert dp.choice == {}
    dp.keep(256, CUBLAS)
    dp.keep(1024, LT_PADDED)
    assert [dp.way_for(n) for n in (100, 256, 257, 1024, 5000)] == [CUBLAS, CUBLAS, LT_PADDED, LT_PADDED, LT_PADDED]
    with pytest.raises(ValueError):
        dp.keep(512, "cutlass")
    assert DownProjection(128, 128, 24, torch.float64, torch.device("cpu")).ways == (CUBLAS, LT_PADDED)


@pytest.mark.gpu
def test_down_projection_tunes_on_the_gpu_and_every_way_gives_the_product():
    """SigLIP's shape (4304 padded to 4352) in bf16, over several layers' weights: a way per token
    count from the timings, each way within bf16 rounding of the float32 product."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from app.vision.down_projection import DownProjection

    dev = torch.device("cuda")
    dp = DownProjection(4304, 4352, 1152, torch.bfloat16, dev)
    ws = [torch.randn(1152, 4352, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(4)]
    for w in ws:
        w[:, 4304:] = 0
    dp.tune([784, 1024, 4096], ws)
    assert sorted(dp.choice) == [784, 1024, 4096] and all(dp.choice[n] == min(dp.timings[n], key=dp.timings[n].get)
                                                             for n in dp.choice)
    for n, times in dp.timings.items():  # every way timed, at a GEMM's time (µs), not a launch's or a sync's
        assert set(times) == set(dp.ways) and all(0 < t < 1000 for t in times.values()), (n, times)
    u = torch.randn(1024, 4352, device=dev, dtype=torch.bfloat16)
    u[:, 4304:] = 0
    for w in ws:
        want = u.float()[:, :4304] @ w.float()[:, :4304].T
        for way in dp.ways:
            assert rel(dp.run(way, u, w).float(), want) <= 1e-2, way


@pytest.mark.gpu
def test_down_projection_tuning_times_the_gpu_not_the_host():
    """A way that is slow only to launch (2 ms of host time per call, as a slow host's launches are
    for every way) is timed at its GPU time: the tuning replays CUDA graphs. Timed eagerly, as it
    was, it measured over 2,000 µs per call."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import time

    from app.vision.down_projection import CUBLAS, DownProjection

    dev = torch.device("cuda")
    dp = DownProjection(4304, 4352, 1152, torch.bfloat16, dev)
    ws = [torch.randn(1152, 4352, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(3)]
    run = dp.run

    def slow_to_launch(way, u, w):
        if way == CUBLAS:
            time.sleep(0.002)
        return run(way, u, w)

    dp.run = slow_to_launch
    dp.tune([1024], ws)
    assert dp.timings[1024][CUBLAS] < 500, dp.timings  # a 1024 x 4304 x 1152 GEMM: tens of µs


@pytest.mark.gpu
def test_down_projection_tunes_while_another_thread_uses_the_gpu():
    """The tuning captures CUDA graphs, at start-up and for each new uniform shape while serving, and
    other threads of the process may keep allocating, launching and waiting on their own streams
    meanwhile, which a global capture forbids (that thread or the capture fails); the tuning's captures
    are thread-local, as the graph manager's are."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import threading

    from app.vision.down_projection import DownProjection

    dev = torch.device("cuda")
    dp = DownProjection(4304, 4352, 1152, torch.bfloat16, dev)
    ws = [torch.randn(1152, 4352, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(3)]
    stop, running, errors, rounds = threading.Event(), threading.Event(), [], []

    def engine_like():
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                n = 256
                while not stop.is_set():
                    rounds.append(n)
                    running.set()
                    # new sizes, so the allocator has to reach the driver; no torch RNG (the engine's
                    # sampler draws none; a capture owns the generator's offsets, from any thread)
                    x = torch.full((n, n), 1.0 / n, device=dev)
                    (x @ x).sum().item()  # a synchronising read, as the engine's sampling is
                    torch.cuda.current_stream().synchronize()  # the engine waits on its streams, never the device
                    n = 256 + (n + 64) % 2048
        except Exception as e:  # noqa: BLE001 - the test reports whatever the thread hit
            errors.append(e)

    t = threading.Thread(target=engine_like)
    t.start()
    try:
        assert running.wait(30)
        before = len(rounds)
        dp.tune([784, 1024, 2048, 4096], ws)
        during = len(rounds) - before
    finally:
        stop.set()
        t.join()
    assert not errors, errors
    assert during > 0  # the other thread kept working while the tuning captured
    assert sorted(dp.choice) == [784, 1024, 2048, 4096]
