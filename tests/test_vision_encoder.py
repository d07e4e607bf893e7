"""The graph-friendly tower and graph manager against transformers' reference `model.visual`.

CPU: the tiny embedded tower in float32 (max relative error <= 1e-4), graphs off, so the padded
static-shape path is exercised. GPU (marker `gpu`): a Qwen3-VL-2B-shaped tower in bfloat16 with
captured CUDA graphs (<= 1e-2). Relative error = max |ours - ref| / max |ref| per output tensor.
"""

from __future__ import annotations

import pytest
import torch

from app.vision.graphs import GraphManager, GraphSettings, VisionItem
from app.vision.tower import VisionTower

BUDGETS = [64, 128, 256]  # patch tokens; the tiny tower packs small grids


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    assert torch.isfinite(a).all()
    return ((a - b).abs().max() / b.abs().max()).item()


class Harness:
    """`visual` is transformers' module (the reference forward), and the tower runs on our parameter tree
    (app/vision/qwen3_params.py) with `visual`'s weights unless `params` is given. `truth` is the reference
    judged against: `visual` itself on the CPU, an fp32 copy on GPU."""

    def __init__(self, visual, dtype, tol, scale=1, truth=None, dense_attention="sdpa", params=None):
        from app.vision.qwen3_params import Qwen3VisionParams

        self.visual, self.dtype, self.tol, self.scale = visual, dtype, tol, scale
        self.truth = truth
        self.tower = VisionTower(params if params is not None else Qwen3VisionParams.from_module(visual))
        self.tower.use_dense_attention(dense_attention)  # before capture, as the service does
        self.device = self.tower.device
        budgets = [b * scale for b in BUDGETS]
        self.mgr = GraphManager(self.tower, GraphSettings(budgets=budgets, max_items_per_batch=4,
                                                          max_frames_per_batch=8, autotune=False,
                                                          uniform_capture_after=2))
        self.mgr.capture()

    def items(self, grids, seed=0):
        g = torch.Generator().manual_seed(seed)
        return [VisionItem(torch.randn(t * h * w, self.tower.patch_dim, generator=g).to(self.device, self.dtype),
                           (t, h, w)) for t, h, w in grids]

    @torch.inference_mode()
    def check(self, items, expect_graph: bool | None = None):
        hits, eager = self.mgr.stats.graph_hits, self.mgr.stats.eager_batches
        out = self.mgr.encode(items)
        if expect_graph is not None:
            assert (self.mgr.stats.graph_hits - hits, self.mgr.stats.eager_batches - eager) == \
                ((1, 0) if expect_graph else (0, 1))
        grids = torch.tensor([it.grid for it in items], device=self.device)
        pixels = torch.cat([it.pixels for it in items])
        assert len(out) == len(items)
        for o, it in zip(out, items):
            t, h, w = it.grid
            assert o.main.shape[0] == t * h * w // 4
        ours = [torch.cat([o.main for o in out])] + [torch.cat([o.deepstack[j] for o in out])
                                                     for j in range(len(out[0].deepstack))]
        if self.truth is None:
            ref = self.visual(pixels, grid_thw=grids)
            refs = [ref.pooler_output, *ref.deepstack_features]
            for a, b in zip(ours, refs, strict=True):
                assert _rel(a, b) <= self.tol
            return out
        # GPU: transformers' reference in fp32 is the truth; ours in bf16 must be within tol of it
        # and no further from it than transformers' own bf16 forward is.
        t = self.truth(pixels.float(), grid_thw=grids)
        truth = [t.pooler_output, *t.deepstack_features]
        r = self.visual(pixels, grid_thw=grids)
        ref16 = [r.pooler_output, *r.deepstack_features]
        for a, b, c in zip(ours, truth, ref16, strict=True):
            assert _rel(a, b) <= self.tol, (_rel(a, b), _rel(c, b))
            assert _rel(a, b) <= 1.05 * _rel(c, b) + 1e-3, (_rel(a, b), _rel(c, b))
        return out


@pytest.fixture(scope="module")
def cpu_harness(tiny_checkpoint):
    from app.vision.loading import load_vision_model

    # the reference and the tower's tree each loaded from the checkpoint, as a replica loads it
    return Harness(load_vision_model(tiny_checkpoint, torch.float32, reference=True), torch.float32, 1e-4,
                   params=load_vision_model(tiny_checkpoint, torch.float32))


def _gpu_harness(dense_attention: str) -> Harness:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import copy

    from transformers import AutoConfig

    from app.checkpoints.model_builder import PRESET_DIR
    from app.vision.loading import vision_model_from_config

    cfg = AutoConfig.for_model(**__import__("json").loads((PRESET_DIR / "qwen3-vl-2b.json").read_text()))
    visual = vision_model_from_config(cfg.vision_config, torch.bfloat16, "cuda")
    return Harness(visual, torch.bfloat16, 1e-2, scale=16, truth=copy.deepcopy(visual).float(),
                   dense_attention=dense_attention)


@pytest.fixture(scope="module")
def gpu_harness():
    return _gpu_harness("sdpa")


@pytest.fixture(scope="module")
def gpu_flash4_harness():
    from app.vision import flash4

    if torch.cuda.is_available():
        reason = flash4.unsupported_reason(64, torch.device("cuda"), torch.bfloat16)
        if reason:
            pytest.skip(f"FlashAttention-4 cannot run: {reason}")
    return _gpu_harness("flash4")


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def h(request):
    return request.getfixturevalue(f"{request.param}_harness")


def _grid_for(tokens: int) -> tuple[int, int, int]:
    return (1, 2, tokens // 2)


def test_one_image(h):
    h.check(h.items([(1, 4 * h.scale, 6)]), expect_graph=True)


def test_images_of_different_sizes(h):
    h.check(h.items([(1, 4, 6), (1, 8, 8), (1, 2, 2), (1, 6, 4)]), expect_graph=True)


def test_one_video(h):
    h.check(h.items([(3, 4, 4 * h.scale)]), expect_graph=True)


def test_images_and_videos_mixed(h):
    h.check(h.items([(1, 4, 6), (2, 4, 4), (1, 8, 8 * h.scale)]), expect_graph=True)


def test_batch_exactly_filling_largest_budget(h):
    top = h.mgr.max_budget
    h.check(h.items([_grid_for(top // 2), _grid_for(top // 2)]), expect_graph=True)
    assert h.mgr.stats.per_budget[top] >= 1


def test_one_token_group_over_a_budget_takes_the_next(h):
    b = h.mgr.budgets[0]
    before = h.mgr.stats.per_budget[h.mgr.budgets[1]]
    h.check(h.items([_grid_for(b + 4)]), expect_graph=True)  # 4 patches = one merged token
    assert h.mgr.stats.per_budget[h.mgr.budgets[1]] == before + 1


def test_over_the_largest_budget_falls_back_to_eager(h):
    before = h.mgr.stats.eager_reasons["tokens"]
    h.check(h.items([_grid_for(h.mgr.max_budget + 4)]), expect_graph=False)
    assert h.mgr.stats.eager_reasons["tokens"] == before + 1


def test_video_with_more_frames_than_any_graph_holds_falls_back(h):
    before = h.mgr.stats.eager_reasons["frames"]
    h.check(h.items([(h.mgr.settings.max_frames_per_batch + 1, 2, 2)]), expect_graph=False)
    assert h.mgr.stats.eager_reasons["frames"] == before + 1


def test_too_many_items_falls_back(h):
    before = h.mgr.stats.eager_reasons["items"]
    h.check(h.items([(1, 2, 2)] * (h.mgr.settings.max_items_per_batch + 1)), expect_graph=False)
    assert h.mgr.stats.eager_reasons["items"] == before + 1


def test_replay_after_replay_has_no_stale_data(h):
    big = h.check(h.items([(1, 8, 8), (2, 4, 4)], seed=1), expect_graph=True)
    kept = big[0].main.clone()
    # A smaller batch in the same budget next: stale rows of the first must not leak in.
    h.check(h.items([(1, 4, 4)], seed=2), expect_graph=True)
    h.check(h.items([(1, 8, 8), (2, 4, 4)], seed=3), expect_graph=True)
    assert torch.equal(big[0].main, kept), "results must outlive later replays"


def test_padding_rows_are_finite_and_do_not_touch_real_rows(h):
    items = h.items([(1, 2, 6)])  # 12 tokens padded up to the smallest budget
    padded = h.mgr.encode(items)[0]
    budget = h.mgr.budgets[0]
    main, deep = h.mgr._graph_out[budget] if h.mgr.graphs else h.mgr.tower(h.mgr._static_inputs(budget))
    assert torch.isfinite(main).all() and all(torch.isfinite(d).all() for d in deep)
    eager = h.mgr.encode(items, force_eager=True)[0]
    assert _rel(padded.main, eager.main) <= h.tol


def test_layout_metadata_is_cached_and_copied_only_when_the_layout_changes(h):
    """Device metadata per layout comes from an LRU; the static buffers are re-filled only when the
    layout changes, and then hold exactly the padded metadata built from scratch."""
    from app.vision.device_metadata import DeviceMetadataCache
    from app.vision.metadata import layout

    mgr = h.mgr
    a, b = [(1, 6, 10)], [(2, 4, 6)]  # 60 and 48 tokens: both in the smallest budget
    h.check(h.items(a, seed=4), expect_graph=True)
    hits, misses = mgr.metadata.hits, mgr.metadata.misses
    h.check(h.items(a, seed=5), expect_graph=True)  # same layout: nothing looked up or copied
    assert (mgr.metadata.hits, mgr.metadata.misses) == (hits, misses)
    h.check(h.items(b, seed=6), expect_graph=True)
    h.check(h.items(a, seed=7), expect_graph=True)
    assert (mgr.metadata.hits, mgr.metadata.misses) == (hits + 1, misses + 1)
    budget = mgr.budgets[0]
    fresh = DeviceMetadataCache(lambda lay, b, u: mgr.tower.metadata(lay, b, u, mgr.seq_slots), mgr.device).get(
        layout(a, 2), budget, None)
    held = mgr._meta_views(budget)
    assert held.keys() == fresh.keys() and all(torch.equal(held[k], fresh[k]) for k in fresh)
    assert not mgr._pixels[60:budget].any() and not fresh["taps"][60:].any()


def test_raw_uint8_rows_give_the_embeddings_of_the_processors_float_rows(h):
    """The router sends uint8 patch rows and the tower normalises them: that must reproduce the
    processor's float rows exactly, and so the embeddings of the float path (the reference's input)."""
    import numpy as np

    from app.media.preprocess import PatchSpec, patchify

    spec = PatchSpec()
    frames = np.random.default_rng(5).integers(0, 256, (4, 128, 64, 3), dtype=np.uint8)
    raw, norm = patchify(frames, spec, normalize=False), patchify(frames, spec)
    scale, offset = (torch.as_tensor(t) for t in spec.column_norm())
    assert raw.pixel_values.dtype == np.uint8
    assert torch.equal(torch.from_numpy(raw.pixel_values).float() * scale + offset, torch.from_numpy(norm.pixel_values))
    mgr = GraphManager(VisionTower(h.tower.visual, pixel_norm=spec.column_norm()),
                       GraphSettings(budgets=h.mgr.budgets, max_items_per_batch=4, max_frames_per_batch=8,
                                     autotune=False, uint8_pixels=True))
    mgr.capture()
    with torch.inference_mode():
        ours = mgr.encode([VisionItem(torch.from_numpy(raw.pixel_values).to(h.device), raw.grid)])[0]
        assert mgr.stats.graph_hits == 1  # the padded static-shape path (a captured graph on the GPU)
        if h.truth is None:  # CPU: the float path through the same budget, exactly
            ref = h.mgr.encode([VisionItem(torch.from_numpy(norm.pixel_values).to(h.device, h.dtype), norm.grid)])[0]
            refs, tol = [ref.main, *ref.deepstack], 0.0
        else:  # GPU: transformers' fp32 forward on the processor's rows, as every GPU check
            t = h.truth(torch.from_numpy(norm.pixel_values).to(h.device), grid_thw=torch.tensor([norm.grid],
                                                                                               device=h.device))
            refs, tol = [t.pooler_output, *t.deepstack_features], h.tol
    for a, b in zip([ours.main, *ours.deepstack], refs, strict=True):
        assert _rel(a, b) <= tol
    with pytest.raises(ValueError, match="uint8"):  # a manager refuses rows of the other format
        mgr.encode([VisionItem(torch.from_numpy(norm.pixel_values).to(h.device), norm.grid)])


@pytest.mark.gpu
def test_pinned_staging_gives_the_same_embeddings_as_pageable_copies(gpu_harness):
    """`encoder.pinned_pixel_copy`: host uint8 rows through the pinned buffers and the copy stream, in
    graphs and eagerly, give exactly what the direct copies give. The staged batches are queued one
    after the other behind a long kernel, without waiting: a copy that overwrote the static pixel
    buffer before the previous batch's replay read it would show."""
    from app.media.preprocess import PatchSpec

    h = gpu_harness

    spec = PatchSpec()
    mgrs = [GraphManager(VisionTower(h.tower.visual, pixel_norm=spec.column_norm()),
                         GraphSettings(budgets=h.mgr.budgets, max_items_per_batch=4, max_frames_per_batch=8,
                                       autotune=False, uint8_pixels=True, pinned_staging=pinned))
            for pinned in (False, True)]
    mgrs[0].capture()
    if mgrs[0].tower.down is not None:  # the same GEMM ways in both (cuBLAS and cuBLASLt round differently),
        for rows, way in mgrs[0].tower.down.choice.items():  # so that equal inputs give equal bits
            mgrs[1].tower.down.keep(rows, way)
    mgrs[1].capture()
    assert mgrs[0]._staging is None and mgrs[1]._staging is not None
    g = torch.Generator().manual_seed(9)
    grids = [[(1, 8, 12)], [(1, 8, 12), (2, 4, 8)], [(1, 16, 16)], [(2, 8, 8), (1, 4, 4)], [(1, 8, 12)]]
    batches = [[VisionItem(torch.randint(0, 256, (t * hh * w, h.tower.patch_dim), generator=g, dtype=torch.uint8),
                           (t, hh, w)) for t, hh, w in gr] for gr in grids]
    with torch.inference_mode():
        for eager in (False, True):
            want = [mgrs[0].encode(items, force_eager=eager) for items in batches]
            torch.cuda.synchronize()
            torch.cuda._sleep(200_000_000)  # about 0.1 s of one busy kernel ahead of every staged batch
            got = [mgrs[1].encode(items, force_eager=eager) for items in batches]
            torch.cuda.synchronize()
            for a, b in zip(want, got, strict=True):
                for x, y in zip(a, b, strict=True):
                    assert torch.equal(x.main, y.main)
                    assert all(torch.equal(p, q) for p, q in zip(x.deepstack, y.deepstack, strict=True))
    assert mgrs[1]._staging.staged == 2 * len(batches)


def test_power_of_two_budgets_include_the_maximum():
    assert GraphSettings.power_of_two_budgets(256, 8192) == [256, 512, 1024, 2048, 4096, 8192]
    assert GraphSettings.power_of_two_budgets(200, 3000) == [256, 512, 1024, 2048, 3000]
    assert GraphSettings.power_of_two_budgets(256, 1024, 4) == [256, 320, 384, 448, 512, 640, 768, 896, 1024]


def test_cu_seqlens_padding_is_monotonic():
    from app.vision.metadata import cu_seqlens

    cu = cu_seqlens([4, 8, 8], pad_to_tokens=32, pad_to_seqs=6).tolist()
    assert cu == [0, 4, 12, 20, 32, 32, 32]
    assert all(a <= b for a, b in zip(cu, cu[1:]))
    with pytest.raises(ValueError):
        cu_seqlens([4] * 7, pad_to_seqs=6)


def test_fused_layer_structure_equals_reference_on_cpu(tiny_checkpoint):
    """The fused path (bias folded into the residual add, next layer's norm chained) with torch kernels."""
    from app.vision.loading import load_vision_model

    visual = load_vision_model(tiny_checkpoint, torch.float32, reference=True)
    tower = VisionTower(load_vision_model(tiny_checkpoint, torch.float32), fused=True)
    mgr = GraphManager(tower, GraphSettings(budgets=[256], autotune=False))
    items = Harness.items(type("H", (), {"tower": tower, "device": tower.device, "dtype": torch.float32})(),
                          [(1, 4, 6), (2, 4, 4)])
    out = mgr.encode(items)
    ref = visual(torch.cat([it.pixels for it in items]), grid_thw=torch.tensor([it.grid for it in items]))
    assert _rel(torch.cat([o.main for o in out]), ref.pooler_output) <= 1e-4
    for j, feat in enumerate(ref.deepstack_features):
        assert _rel(torch.cat([o.deepstack[j] for o in out]), feat) <= 1e-4


@pytest.mark.gpu
def test_triton_kernels_equal_torch_fallbacks():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from app.vision import kernels as K

    g = torch.Generator(device="cuda").manual_seed(0)
    n, heads, d = 777, 16, 72
    qkv = torch.randn(n, 3 * heads * d, device="cuda", dtype=torch.bfloat16, generator=g)
    ang = torch.randn(n, d // 2, device="cuda", generator=g)
    q, k = K.rotary_qk(qkv, ang.cos(), ang.sin(), heads)
    q0, k0 = K.rotary_qk_torch(qkv, ang.cos(), ang.sin(), heads)
    assert (q.float() - q0.float()).abs().max() <= 1e-2 * q0.float().abs().max()
    assert (k.float() - k0.float()).abs().max() <= 1e-2 * k0.float().abs().max()
    c = 1152
    x, y = (torch.randn(n, c, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    b, w, lb = (torch.randn(c, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    xs, hs = K.add_bias_layernorm(x, y, b, w, lb, 1e-6)
    x0, h0 = K.add_bias_layernorm_torch(x, y, b, w, lb, 1e-6)
    assert (xs.float() - x0.float()).abs().max() <= 2e-2 * x0.float().abs().max()
    assert (hs.float() - h0.float()).abs().max() <= 2e-2 * h0.float().abs().max()
    only, none = K.add_bias_layernorm(x, y, None, None, None, 1e-6)
    assert none is None and torch.equal(only, x + y)


def test_dispatch_prefers_eager_where_autotune_says_it_is_faster(cpu_harness):
    """A batch goes eager when the tuned eager time at its real size beats its budget graph's time
    (by the settings' margin): equal lengths are judged on the equal-length eager column, others on
    the unequal one."""
    from app.vision.metadata import layout

    mgr = cpu_harness.mgr
    saved, margin = dict(mgr._tuned), mgr.settings.eager_margin
    try:  # budget: (eager unequal, eager equal, graph)
        mgr.settings.eager_margin = 0.0
        mgr._tuned = {64: (3.0, 1.0, 2.0), 128: (3.0, 2.0, 1.5), 256: (3.5, 4.0, 3.0)}
        assert mgr.choose_budget(layout([(1, 2, 20)], 2)) == (None, "faster_eager")  # 40 tok: 1.0 < 2.0
        assert mgr.choose_budget(layout([(1, 2, 50)], 2)) == (128, None)  # 100 tok: eager 1.6 > 1.5
        assert mgr.choose_budget(layout([(1, 2, 20), (1, 2, 30)], 2)) == (128, None)  # unequal: 3.0 > 1.5
        assert mgr.choose_budget(layout([(1, 2, 80), (1, 2, 20)], 2)) == (256, None)  # 200 tok: 3.28 > 3.0
        mgr._tuned[256] = (3.5, 4.0, 3.4)
        assert mgr.choose_budget(layout([(1, 2, 80), (1, 2, 20)], 2)) == (None, "faster_eager")  # 3.28 < 3.4
        assert mgr._eager_estimate(192, True) == 3.0 and mgr._eager_estimate(512, True) == 8.0
        assert mgr._eager_estimate(192, False) == 3.25
        # With a margin, eager must win by it: 3.28 * 1.1 = 3.61 > 3.4 keeps the graph; 1.0 * 1.1 < 2.0 not.
        mgr.settings.eager_margin = 0.1
        assert mgr.choose_budget(layout([(1, 2, 80), (1, 2, 20)], 2)) == (256, None)
        assert mgr.choose_budget(layout([(1, 2, 20)], 2)) == (None, "faster_eager")
        # Without eager where a graph fits (the fused placement's default), the same batches replay graphs,
        # with the graph's tuned time as the prediction; one that fits no graph is still eager.
        mgr.settings.eager_when_faster = False
        d = mgr.dispatch(layout([(1, 2, 20)], 2))
        assert (d.budget, d.reason, d.bucket, d.predicted_ms) == (64, None, "64 equal", 2.0)
        assert mgr.choose_budget(layout([(1, 2, 80), (1, 2, 20)], 2)) == (256, None)
        assert mgr.choose_budget(layout([(1, 2, mgr.max_budget)], 2))[0] is None
    finally:
        mgr._tuned, mgr.settings.eager_margin = saved, margin
        mgr.settings.eager_when_faster = True


def test_autotune_keeps_every_graph_without_eager_where_a_graph_fits(cpu_harness, monkeypatch):
    """Auto-tune drops a budget graph that timed slower than eager, so that larger batches go to a larger
    graph or eager; with `eager_when_faster` off (the fused default) it keeps every graph it captured, both
    when it times them and when it applies another replica's table, whose drops followed that replica's
    setting. The batch only the dropped budget held runs eagerly ("no_graph") in the first case only."""
    from app.vision.metadata import layout

    mgr = cpu_harness.mgr
    saved = dict(mgr._tuned), dict(mgr.graphs), dict(mgr._graph_out), mgr.autotune_table
    top = mgr.max_budget
    times = {"eager": 1.0, "graph": 2.0}  # graph slower than eager at every budget

    def fake_time(fn, reps=None):
        return times[next(calls)]

    monkeypatch.setattr(mgr, "_time_ms", fake_time)
    monkeypatch.setattr(mgr, "capture_enabled", True)
    lay = layout([(1, 2, top // 2)], 2)  # only the largest budget holds it
    try:
        for eager_when_faster, kept in ((True, False), (False, True)):
            mgr.settings.eager_when_faster = eager_when_faster
            mgr.graphs, mgr._graph_out = {top: object()}, {top: object()}
            calls = iter(["eager", "graph", "eager"])  # unequal eager, graph, equal eager
            row = mgr._tune_budget(top)
            assert row["kept"] is kept and (top in mgr.graphs) is kept
            assert mgr.dispatch(lay).reason == (None if kept else "no_graph")
            # the same times from a cached table measured under the other setting
            mgr.graphs, mgr._graph_out, mgr.autotune_table = {top: object()}, {top: object()}, []
            assert mgr._apply([{**row, "kept": not kept}])
            assert (top in mgr.graphs) is kept and mgr.autotune_table[0]["kept"] is kept
    finally:
        mgr._tuned, mgr.graphs, mgr._graph_out, mgr.autotune_table = saved
        mgr.settings.eager_when_faster = True


def test_dispatch_follows_the_observed_times_once_enough_batches_were_seen(cpu_harness):
    """Observed ratios (observed / tuned) replace the margin once a path has min_samples of them in a
    budget: a graph the table favours loses to eager that ran faster than its estimate, and eager the
    table favours loses to a graph when eager ran slower."""
    from app.vision.metadata import layout
    from app.vision.observed import EAGER, GRAPH, ObservedTimes

    mgr = cpu_harness.mgr
    saved, margin, observed = dict(mgr._tuned), mgr.settings.eager_margin, mgr.observed
    lay = layout([(1, 2, 80), (1, 2, 20)], 2)  # 200 tokens, unequal: eager estimate 3.28 ms at budget 256
    try:
        mgr.settings.eager_margin, mgr.observed = 0.1, ObservedTimes(cuda=False)
        mgr._tuned = {64: (3.0, 1.0, 2.0), 128: (3.0, 2.0, 1.5), 256: (3.5, 4.0, 3.4)}
        assert mgr.choose_budget(lay) == (256, None)  # 3.28 * 1.1 = 3.61 > 3.4
        for _ in range(3):
            mgr.observed.add(256, EAGER, 0.9)
        assert mgr.choose_budget(lay) == (256, None)  # 3 observations: the margin still stands
        mgr.observed.add(256, EAGER, 0.9)
        assert mgr.choose_budget(lay) == (None, "faster_eager")  # 3.28 * 0.9 = 2.95 < 3.4
        for _ in range(4):
            mgr.observed.add(256, GRAPH, 0.85)
        assert mgr.choose_budget(lay) == (256, None)  # 2.95 > 3.4 * 0.85 = 2.89
        d = mgr.dispatch(lay)
        assert (d.bucket, d.predicted_ms) == (256, 3.4)
        # 200 tokens of equal lengths: their own bucket, which the unequal batches' ratios do not reach.
        # Eager there is 2.0 + 2.0 * 72 / 128 = 3.125 on the equal column, * 1.1 = 3.44 > 3.4: the graph.
        same = layout([(1, 2, 50)] * 2, 2)
        d = mgr.dispatch(same)
        assert (d.budget, d.bucket, d.predicted_ms) == (256, "256 equal", 3.4)
        mgr.observed.add("256 equal", EAGER, 1.0)  # one observation: too few to replace the margin
        assert mgr.dispatch(same).budget == 256
        mgr._tuned[256] = (2.0, 4.0, 3.4)  # the table now says eager, by far (2.0 * 1.1 < 3.4) ...
        mgr.observed = ObservedTimes(cuda=False)
        assert mgr.choose_budget(lay) == (None, "faster_eager")
        assert mgr.dispatch(lay).predicted_ms == 3.0 - 1.0 * 72 / 128  # eager at 200 tokens, interpolated
        for _ in range(4):
            mgr.observed.add(256, EAGER, 2.0)  # ... but eager ran twice as slow as that
        assert mgr.choose_budget(lay) == (256, None)
    finally:
        mgr._tuned, mgr.settings.eager_margin, mgr.observed = saved, margin, observed


def test_served_batches_are_timed_and_one_near_a_tie_takes_the_other_path(cpu_harness):
    """Through encode: each batch that had the choice adds its time to (budget, path); near a tie the
    fourth batch runs eagerly to time it (reason `explore`), with the same rows out."""
    from app.vision.observed import EAGER, GRAPH, ObservedTimes

    h = cpu_harness
    mgr = h.mgr
    saved, margin, observed = dict(mgr._tuned), mgr.settings.eager_margin, mgr.observed
    items = h.items([(1, 8, 10), (1, 6, 6)], seed=3)  # 116 tokens: budget 128, unequal lengths
    try:
        mgr.settings.eager_margin, mgr.observed = 0.1, ObservedTimes(cuda=False)
        mgr._tuned = {64: (1.5, 1.0, 2.0), 128: (1.5, 1.5, 1.5)}  # eager 1.5 * 1.1 vs graph 1.5: a near tie
        graphs, explored = mgr.stats.per_budget[128], mgr.stats.eager_reasons["explore"]
        for _ in range(3):
            h.check(items, expect_graph=True)
        h.check(items, expect_graph=False)
        assert mgr.stats.per_budget[128] - graphs == 3 and mgr.stats.eager_reasons["explore"] - explored == 1
        assert {k: len(v) for k, v in mgr.observed._ratios.items()} == {(128, GRAPH): 3, (128, EAGER): 1}
        assert all(r > 0 for v in mgr.observed._ratios.values() for r in v)
        mgr._tuned = {}  # untuned (the CPU default): no choice, nothing timed
        h.check(items, expect_graph=True)
        assert sum(len(v) for v in mgr.observed._ratios.values()) == 4
    finally:
        mgr._tuned, mgr.settings.eager_margin, mgr.observed = saved, margin, observed


def test_equal_length_shapes_are_queued_for_capture_at_the_threshold(tiny_checkpoint):
    """Bookkeeping of on-demand uniform graphs (capture itself needs CUDA; see the GPU tests)."""
    from app.vision.loading import load_vision_model
    from app.vision.metadata import layout

    tower = VisionTower(load_vision_model(tiny_checkpoint, torch.float32))
    mgr = GraphManager(tower, GraphSettings(budgets=[256], uniform_capture_after=2, max_uniform_graphs=2))
    image, video, odd = layout([(1, 4, 6)], 2), layout([(3, 4, 4)], 2), layout([(1, 4, 6), (1, 4, 4)], 2)
    assert odd.uniform is None  # unequal lengths: no uniform shape to count
    mgr._note_uniform(image.uniform)
    assert mgr._uniform_pending == []
    mgr._note_uniform(image.uniform)
    mgr._note_uniform(image.uniform)  # queued once only
    assert mgr._uniform_pending == [(1, 24)]
    for _ in range(2):
        mgr._note_uniform(video.uniform)
    assert mgr._uniform_pending == [(1, 24), (3, 16)]
    for _ in range(3):
        mgr._note_uniform(layout([(1, 8, 8)], 2).uniform)  # the limit of two graphs is reached
    assert mgr._uniform_pending == [(1, 24), (3, 16)]
    assert not mgr.uniform_fits((1, 260)) and not mgr.uniform_fits((33, 4))  # over the budget / frames


@pytest.mark.gpu
def test_uniform_graphs_equal_the_reference_and_hold_no_stale_data(gpu_harness):
    """Equal-length batches replay an exact-shape graph (dense attention, no padding) once seen twice."""
    h = gpu_harness
    mgr = h.mgr
    mgr.capture_pending()  # shapes other tests queued
    n0 = len(mgr.uniform_graphs)
    for grids in ([(1, 32, 24)], [(4, 16, 16)], [(1, 16, 16)] * 3):  # image, video, same-size images
        for seed in (0, 1):  # the budget graphs serve the first two sightings
            h.check(h.items(grids, seed=seed), expect_graph=True)
        assert mgr.capture_pending() == 1
        hits = mgr.stats.uniform_hits
        first = h.check(h.items(grids, seed=2), expect_graph=True)
        kept = first[0].main.clone()
        h.check(h.items(grids, seed=3), expect_graph=True)  # different pixels, same graph
        assert mgr.stats.uniform_hits == hits + 2
        assert torch.equal(first[0].main, kept), "results must outlive later replays"
        eager = mgr.encode(h.items(grids, seed=3), force_eager=True)
        again = mgr.encode(h.items(grids, seed=3))
        for a, b in zip(again, eager, strict=True):  # same kernels as eager: equal up to launch order
            assert _rel(a.main, b.main) <= 1e-2
    assert len(mgr.uniform_graphs) == n0 + 3


@pytest.mark.gpu
def test_eager_batches_build_no_cudnn_attention_plans(gpu_harness):
    """cuDNN's attention builds an execution plan per new shape (up to 1 s on an H200), so only
    graphs, whose shapes are fixed at capture, may use it. An eager batch of long equal-length images
    (the dense path) must run another kernel, and still match the reference."""
    from helpers import attention_calls, skip_unless_cudnn_is_the_default

    h = gpu_harness
    skip_unless_cudnn_is_the_default(h.tower.heads, h.tower.head_dim)
    items = h.items([(1, 32, 32)] * 5)  # 5 x 1024 tokens: over the largest budget, so eager
    eager = h.mgr.stats.eager_batches
    with torch.inference_mode():
        sdpa, cudnn = attention_calls(lambda: h.mgr.encode(items))
    assert sdpa > 0 and cudnn == 0  # the dense path ran, on another kernel
    assert h.mgr.stats.eager_batches == eager + 1
    h.check(items, expect_graph=False)


@pytest.mark.gpu
def test_dispatch_times_batches_with_cuda_events_and_leaves_a_path_slower_than_its_estimate(gpu_harness):
    """On the GPU a batch's time comes from CUDA events read once they have passed. With the table
    claiming eager takes 1 µs, dispatch runs eager until its observed time (thousands of times the
    estimate) counts after min_samples batches; then it replays the budget graph, timed by the same
    events, and the rows stay right on both paths."""
    from app.vision.observed import EAGER, GRAPH, ObservedTimes

    h = gpu_harness
    mgr = h.mgr
    saved, observed = dict(mgr._tuned), mgr.observed
    items = h.items([(1, 16, 24), (1, 20, 20)], seed=5)  # 784 tokens, unequal: the 1024 budget
    lay = mgr._layout(items)
    try:
        mgr.observed = ObservedTimes(cuda=True)
        with torch.inference_mode():
            graph_ms = mgr._time_ms(lambda: mgr._run_graph(items, lay, 1024))
        mgr._tuned = {1024: (1e-3, 1e-3, graph_ms)}
        paths = []
        for _ in range(6):
            eager = mgr.stats.eager_batches
            h.check(items)
            torch.cuda.synchronize()  # the events have passed: the next dispatch reads them
            paths.append(EAGER if mgr.stats.eager_batches > eager else GRAPH)
        assert paths == [EAGER] * 4 + [GRAPH] * 2, paths
        mgr.observed.poll()  # the last batch's events (each batch's dispatch reads the ones before it)
        assert mgr.observed.factor(1024, EAGER) > 100  # observed eager / 1 µs
        assert mgr.observed.factor(1024, GRAPH) is None and len(mgr.observed._ratios[(1024, GRAPH)]) == 2
        assert 0.3 < min(mgr.observed._ratios[(1024, GRAPH)]) < 3  # a replay's events: near the tuned time
    finally:
        mgr._tuned, mgr.observed = saved, observed


def test_attention_block_table_lists_every_query_block_once():
    from app.vision.attention import block_table, split, table_rows

    tab = block_table([300, 0, 5, 128], rows=table_rows(433, 4), block_m=128).tolist()
    assert tab[:5] == [[0, 0, 300], [128, 0, 300], [256, 0, 300], [300, 300, 305], [305, 305, 433]]
    assert tab[5:] == [[433, 433, 433]] * (table_rows(433, 4) - 5)  # empty blocks: start == end
    for seqs in ([128] * 4, [1] * 33, [8192], [129, 127, 1]):  # the bound holds for any split of the tokens
        assert len(block_table(seqs)) <= table_rows(sum(seqs), len(seqs))
    with pytest.raises(ValueError):
        block_table([300], rows=2)
    assert split(72) == (64, 16) and split(64) == (64, 0) and split(80) == (64, 16)
    assert split(96) is None and split(48) is None


@pytest.mark.gpu
def test_split_head_varlen_attention_equals_per_sequence_attention():
    """Our Triton kernel against SDPA per sequence in fp32: packed batches, graph-style padded tables
    (empty slots, a padding sequence), strided q/k/v as the tower passes them, heads of 72 and 64."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import torch.nn.functional as F

    from app.vision.attention import block_table, table_rows, varlen_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    for d, seqs, slots in [(72, [784], 1), (72, [784, 112], 33), (72, [196] * 4 + [112], 33), (64, [300, 7, 1], 3),
                           (72, [4096], 1), (72, [1, 64, 65, 129, 500], 9)]:
        n = sum(seqs)
        q, k, v = torch.randn(n, 3, 16, d, device="cuda", dtype=torch.bfloat16, generator=g).unbind(1)
        for bm in (128, 64):
            out = varlen_attention(q, k, v, block_table(seqs, table_rows(n, slots, bm), bm).cuda(), bm)
            start = 0
            for s in seqs:
                ref = F.scaled_dot_product_attention(*(t[start:start + s].transpose(0, 1).float() for t in (q, k, v)))
                got = out[start:start + s].transpose(0, 1).float()
                assert torch.isfinite(got).all()
                assert (got - ref).abs().max() <= 1e-2 * ref.abs().max(), (d, seqs, s, bm)
                start += s


@pytest.mark.gpu
def test_idle_hook_captures_one_queued_shape_at_a_time(gpu_harness):
    """A request arriving while the replica captures waits for one capture at most; the time is counted."""
    mgr = gpu_harness.mgr
    mgr.capture_pending()
    shapes = [(2, 400), (3, 300)]
    for s in shapes:
        for _ in range(mgr.settings.uniform_capture_after):
            mgr._note_uniform(s)
    assert mgr._uniform_pending == shapes
    n, ms = mgr.stats.idle_captures, mgr.stats.idle_capture_ms
    assert mgr.pending_captures()() == 1
    assert mgr._uniform_pending == shapes[1:] and shapes[0] in mgr.uniform_graphs
    assert mgr.stats.idle_captures == n + 1 and mgr.stats.idle_capture_ms > ms
    mgr.pending_captures()()
    assert mgr.pending_captures() is None and shapes[1] in mgr.uniform_graphs


def test_dense_attention_choice_is_resolved_per_device():
    """encoder.dense_attention: 'sdpa' never takes FlashAttention-4; 'flash4' where it cannot run is an error
    at start that says why, not a silent fallback."""
    from app.config import AppConfig
    from app.vision import flash4

    cpu = torch.device("cpu")
    assert flash4.resolve("sdpa", 64, cpu, torch.float32) is False
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        flash4.resolve("flash4", 64, cpu, torch.bfloat16)
    with pytest.raises(ValueError):
        flash4.resolve("fast", 64, cpu, torch.bfloat16)
    if torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="bfloat16 or float16"):
            flash4.resolve("flash4", 64, torch.device("cuda"), torch.float32)
    assert AppConfig.model_validate({"encoder": {"dense_attention": "flash4"}}).encoder.dense_attention == "flash4"
    assert AppConfig().encoder.dense_attention == "sdpa"
    for bad in ("cudnn", "auto"):
        with pytest.raises(ValueError):
            AppConfig.model_validate({"encoder": {"dense_attention": bad}})


@pytest.mark.gpu
def test_flash4_dense_attention_equals_per_sequence_attention(gpu_flash4_harness):
    """FlashAttention-4 as the dense path calls it: [sequences, length, heads, head] views of the packed
    rows, v strided inside the qkv rows; against SDPA per sequence in fp32, heads of 64 (Qwen3-VL-2B), 72 (8B,
    MiniCPM-V) and 80 (Qwen2.5-VL)."""
    import torch.nn.functional as F

    from app.vision.attention import packed_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    for d, s, length in [(64, 1, 4096), (64, 2, 1024), (72, 2, 784), (72, 3, 512), (80, 2, 1024)]:
        n = s * length
        q, k, v = torch.randn(n, 3, 16, d, device="cuda", dtype=torch.bfloat16, generator=g).unbind(1)
        q, k = q.contiguous(), k.contiguous()  # as rotary_qk returns them; v stays a strided view
        cu = torch.arange(0, n + 1, length, device="cuda", dtype=torch.int32)
        out = packed_attention(q, k, v, cu, length, uniform=(s, length), static=True, use_flash4=True)
        assert out.shape == q.shape
        for i in range(s):
            rows = slice(i * length, (i + 1) * length)
            ref = F.scaled_dot_product_attention(*(t[rows].transpose(0, 1).float() for t in (q, k, v)))
            got = out[rows].transpose(0, 1).float()
            assert torch.isfinite(got).all()
            assert (got - ref).abs().max() <= 1e-2 * ref.abs().max(), (d, s, length, i)


@pytest.mark.gpu
def test_flash4_uniform_graphs_equal_the_reference(gpu_flash4_harness, monkeypatch):
    """The tower with encoder.dense_attention 'flash4': exact-shape graphs of one 4096-token image and of
    two 1024-token images run FlashAttention-4 (counted at capture) and match the fp32 reference as
    closely as transformers' own bf16 forward does; replays keep no stale data; eager batches of the same
    shape keep SDPA (FA4's launcher is too slow outside graphs)."""
    from app.vision import flash4

    h = gpu_flash4_harness
    assert h.tower.flash4
    calls = []
    real = flash4.dense
    monkeypatch.setattr(flash4, "dense", lambda *a: calls.append(a[0].shape) or real(*a))
    for grids in ([(1, 64, 64)], [(1, 32, 32)] * 2):
        for seed in (0, 1):
            h.check(h.items(grids, seed=seed), expect_graph=True)
        n_calls = len(calls)
        assert h.mgr.capture_pending() == 1
        assert len(calls) > n_calls, "the captured graph must call FlashAttention-4"
        assert {tuple(c) for c in calls[n_calls:]} == {(len(grids), grids[0][1] * grids[0][2], 16, 64)}
        hits = h.mgr.stats.uniform_hits
        first = h.check(h.items(grids, seed=2), expect_graph=True)
        kept = first[0].main.clone()
        h.check(h.items(grids, seed=3), expect_graph=True)
        assert h.mgr.stats.uniform_hits == hits + 2
        assert torch.equal(first[0].main, kept), "results must outlive later replays"
        n_calls = len(calls)
        with torch.inference_mode():
            h.mgr.encode(h.items(grids, seed=4), force_eager=True)
        assert len(calls) == n_calls


def test_the_fused_tower_replays_a_graph_wherever_one_fits_unless_told(tiny_checkpoint):
    """`encoder.eager_when_faster` unset: eager where faster for a tower of its own, never under `fused`
    (keep_on_device), whose eager launches share the GIL with the engine's thread; set, it wins."""
    from app.config import AppConfig
    from app.vision.service import EncoderService

    def setting(keep_on_device: bool, **enc) -> bool:
        cfg = AppConfig(model=str(tiny_checkpoint), encoder=enc)
        return EncoderService(cfg, str(tiny_checkpoint), keep_on_device).manager.settings.eager_when_faster

    assert setting(False) is True and setting(True) is False
    assert setting(True, eager_when_faster=True) is True and setting(False, eager_when_faster=False) is False
