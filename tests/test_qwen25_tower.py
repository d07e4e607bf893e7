"""The Qwen2.5-VL tower (window attention) and the graph manager against transformers' reference.

CPU: the tiny embedded Qwen2.5-VL tower in float32, graphs off, so the padded static-shape path runs
(max relative error <= 1e-4 against `Qwen2_5_VisionTransformerPretrainedModel`). GPU (marker `gpu`):
a Qwen2.5-VL-3B-shaped tower in bfloat16 with captured CUDA graphs against the reference in float32
(<= BF16_TOL = 2e-2, and no further from it than transformers' own bf16 forward: on the H200 ours
measured 1.1-1.3e-2 from float32 and transformers' bf16 1.9-2.6e-2); and the same tower in float32
with captured graphs against the reference in float32 (<= FP32_TOL = 1e-3: both round in float32, with
GEMM algorithms that differ between padded and exact shapes, through 32 random-weight layers; a wrong
window, position or padding row errs by O(1) on its rows). The tiny tower's windows are
the real ones (112 px = 8 x 8 patches), so grids of more than 8 patches a side have several windows,
partial ones at the right and bottom edges.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from tower_harness import TowerHarness, rel

from app.vision.graphs import GraphManager, GraphSettings, VisionItem
from app.vision.qwen25_tower import Qwen25Tower

BUDGETS = [128, 256, 512]
FP32_TOL = 1e-3  # GPU, float32 tower and reference (module docstring)
BF16_TOL = 2e-2  # GPU, bfloat16 tower against the float32 reference (module docstring)


@pytest.fixture(scope="module")
def tiny_qwen25(model_cache):
    from app.checkpoints.model_builder import ensure_embedded

    return ensure_embedded("tiny-qwen2.5-vl", model_cache)


def _reference(visual):
    def run(pixels, grids):
        return [visual(pixels, grid_thw=torch.tensor(grids, device=pixels.device)).pooler_output]
    return run


@pytest.fixture(scope="module")
def cpu_harness(tiny_qwen25):
    from app.vision.loading import load_vision_model

    visual = load_vision_model(tiny_qwen25, torch.float32)
    h = TowerHarness(Qwen25Tower(visual), _reference(visual), BUDGETS, 1e-4)
    h.k, h.visual = 1, visual
    return h


@pytest.fixture(scope="module")
def gpu_harness():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from transformers import AutoConfig

    from app.checkpoints.model_builder import PRESET_DIR
    from app.vision.loading import vision_model_from_config

    cfg = AutoConfig.for_model(**json.loads((PRESET_DIR / "qwen2.5-vl-3b.json").read_text()))
    torch.manual_seed(0)
    visual = vision_model_from_config(cfg.vision_config, torch.bfloat16, "cuda")
    truth = copy.deepcopy(visual).float()
    h = TowerHarness(Qwen25Tower(visual), _reference(visual), [b * 16 for b in BUDGETS], BF16_TOL,
                     truth=_reference(truth), max_frames=16, uniform_capture_after=2)
    h.k, h.visual = 3, visual
    return h


@pytest.fixture(scope="module")
def gpu32_harness():
    """The 3B-shaped tower in float32 with captured graphs, judged directly by the reference in float32."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from transformers import AutoConfig

    from app.checkpoints.model_builder import PRESET_DIR
    from app.vision.loading import vision_model_from_config

    cfg = AutoConfig.for_model(**json.loads((PRESET_DIR / "qwen2.5-vl-3b.json").read_text()))
    torch.manual_seed(0)
    visual = vision_model_from_config(cfg.vision_config, torch.float32, "cuda")
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # the reference's Conv3d patch embedding would round to TF32
    try:
        yield TowerHarness(Qwen25Tower(visual), _reference(visual), [1024, 2048, 4096], FP32_TOL, max_frames=16,
                           uniform_capture_after=2)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def h(request):
    return request.getfixturevalue(f"{request.param}_harness")


def test_window_order_and_boundaries_equal_the_reference():
    """Our host-side window permutation and window cu_seqlens equal transformers' get_vision_window_index
    on odd grids (partial windows, videos, several items)."""
    from transformers.vision_utils import get_vision_window_index

    from app.vision.qwen25_metadata import WindowGeometry, window_metadata, window_sizes

    geo = WindowGeometry(merge=2, window=4)
    for grids in ([(1, 10, 14)], [(1, 8, 8)], [(1, 16, 24)], [(3, 12, 20), (1, 2, 2), (2, 18, 6)], [(1, 34, 2)]):
        index, cu_ref = get_vision_window_index(torch.tensor(grids), 2, 112, 14)
        perm, rot, unperm = window_metadata(grids, geo)
        assert torch.equal(torch.argsort(unperm), index)  # unperm inverts the reference's window_index
        assert torch.equal(perm.view(-1, 4)[:, 0] // 4, index)
        windows = window_sizes(grids, geo)
        assert torch.equal(torch.tensor([0] + windows).cumsum(0).to(torch.int32), cu_ref)


def test_padded_metadata_keeps_padding_apart():
    """Padding keeps the identity order at the end, is one frame sequence of its own and windows of at
    most a window's size; cu_seqlens stay monotonic and fill their static slots."""
    from app.vision.metadata import layout
    from app.vision.qwen25_metadata import WindowGeometry, qwen25_metadata, window_slots

    geo = WindowGeometry(merge=2, window=4)
    lay = layout([(1, 10, 14), (2, 4, 4)], 2)  # 140 + 32 tokens
    meta = qwen25_metadata(lay, geo, 512, seq_slots=9)
    assert torch.equal(meta["perm"][172:], torch.arange(172, 512))
    assert torch.equal(meta["unperm"][43:], torch.arange(43, 128))
    assert meta["cu"].tolist() == [0, 140, 156, 172, 512] + [512] * 5
    win = meta["cu_win"]
    assert win.shape[0] == window_slots(512, geo) + 1 and bool((win[1:] >= win[:-1]).all())
    sizes = torch.diff(win)
    assert int(sizes.sum()) == 512 and sizes[sizes > 0][-6:].tolist() == [64] * 5 + [20]  # 340 = 5 x 64 + 20


def test_one_non_square_image(h):
    h.check(h.items([(1, 10 * h.k, 14 * h.k)]), expect_graph=True)


def test_images_of_different_sizes(h):
    h.check(h.items([(1, 10, 14), (1, 8, 8), (1, 2, 2), (1, 18, 6)]), expect_graph=True)


def test_video_with_several_temporal_groups(h):
    h.check(h.items([(3, 12, 10 * h.k)]), expect_graph=True)


def test_images_and_videos_mixed(h):
    h.check(h.items([(1, 10, 14), (2, 6, 10), (1, 16, 14 * h.k)]), expect_graph=True)


def test_over_the_largest_budget_falls_back_to_eager(h):
    before = h.mgr.stats.eager_reasons["tokens"]
    top = h.mgr.max_budget
    h.check(h.items([(1, 2 * (top // 32 + 1), 16)]), expect_graph=False)
    assert h.mgr.stats.eager_reasons["tokens"] == before + 1


def test_too_many_frames_falls_back(h):
    before = h.mgr.stats.eager_reasons["frames"]
    h.check(h.items([(h.mgr.settings.max_frames_per_batch + 1, 2, 4)]), expect_graph=False)
    assert h.mgr.stats.eager_reasons["frames"] == before + 1


def test_batch_exactly_filling_the_largest_budget(h):
    top = h.mgr.max_budget
    before = h.mgr.stats.per_budget[top]
    h.check(h.items([(1, 16, top // 16 - 8), (1, 16, 8)], seed=10), expect_graph=True)
    assert h.mgr.stats.per_budget[top] == before + 1


def test_one_merge_unit_over_a_budget_takes_the_next(h):
    b0, b1 = h.mgr.budgets[:2]
    before = h.mgr.stats.per_budget[b1]
    h.check(h.items([(1, 2, b0 // 2 + 2)], seed=11), expect_graph=True)  # b0 + 4 tokens
    assert h.mgr.stats.per_budget[b1] == before + 1


def test_as_many_attention_sequences_as_a_graph_holds(h):
    """A video of max_frames_per_batch - 1 temporal groups and an image: every sequence slot used."""
    frames = h.mgr.settings.max_frames_per_batch
    lay = h.tower.layout([(frames - 1, 4, 6), (1, 6, 6)])
    assert lay.num_seqs == frames and lay.uniform is None
    h.check(h.items([(frames - 1, 4, 6), (1, 6, 6)], seed=12), expect_graph=True)


def test_too_many_items_fall_back(h):
    before = h.mgr.stats.eager_reasons["items"]
    h.check(h.items([(1, 2, 2 + 2 * i) for i in range(h.mgr.settings.max_items_per_batch + 1)], seed=13),
            expect_graph=False)
    assert h.mgr.stats.eager_reasons["items"] == before + 1


def test_forced_eager_equals_the_reference(h):
    h.check(h.items([(1, 10, 14), (2, 6, 10)], seed=9), expect_graph=False, force_eager=True)


def test_replay_after_replay_has_no_stale_data(h):
    big = h.check(h.items([(1, 16, 18), (2, 6, 10)], seed=1), expect_graph=True)
    kept = big[0].main.clone()
    h.check(h.items([(1, 4, 4)], seed=2), expect_graph=True)  # a smaller batch in the same budget
    h.check(h.items([(1, 16, 18), (2, 6, 10)], seed=3), expect_graph=True)
    h.check(h.items([(1, 10, 14)], seed=4), expect_graph=True)
    assert torch.equal(big[0].main, kept), "results must outlive later replays"


def test_padding_rows_are_finite_and_do_not_touch_real_rows(h):
    items = h.items([(1, 6, 10)], seed=5)  # 60 tokens padded up to the smallest budget
    padded = h.mgr.encode(items)[0]
    budget = h.mgr.budgets[0]
    main, _ = h.mgr._graph_out[budget] if h.mgr.graphs else h.mgr.tower(h.mgr._static_inputs(budget))
    assert torch.isfinite(main).all()
    eager = h.mgr.encode(items, force_eager=True)[0]
    assert rel(padded.main, eager.main) <= (1e-5 if h.truth is None else BF16_TOL)  # bf16: two kernel paths


def test_raw_uint8_rows_give_the_embeddings_of_the_processors_float_rows(tiny_qwen25, cpu_harness):
    """uint8 patch rows normalised in the tower (CLIP mean/std, patch 14) equal the processor's float rows."""
    import numpy as np

    from app.media.preprocess import patchify
    from app.media.spec import patch_spec_for

    spec = patch_spec_for(tiny_qwen25)
    assert (spec.patch, spec.temporal, spec.merge) == (14, 2, 2) and spec.mean[0] == pytest.approx(0.48145466)
    frames = np.random.default_rng(5).integers(0, 256, (4, 140, 112, 3), dtype=np.uint8)
    raw, norm = patchify(frames, spec, normalize=False), patchify(frames, spec)
    mgr = GraphManager(Qwen25Tower(cpu_harness.visual, pixel_norm=spec.column_norm()),
                       GraphSettings(budgets=BUDGETS, max_items_per_batch=4, max_frames_per_batch=8,
                                     autotune=False, uint8_pixels=True))
    with torch.inference_mode():
        ours = mgr.encode([VisionItem(torch.from_numpy(raw.pixel_values), raw.grid)])[0]
        ref = cpu_harness.mgr.encode([VisionItem(torch.from_numpy(norm.pixel_values), norm.grid)])[0]
    assert mgr.stats.graph_hits == 1 and torch.equal(ours.main, ref.main)


def test_weights_load_by_name_from_the_checkpoint(tiny_qwen25, cpu_harness):
    """build_tower loads `visual.*` by name: the tower equals the one inside from_pretrained's model."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from app.vision.loading import build_tower

    tower = build_tower(tiny_qwen25, torch.float32)
    assert isinstance(tower, Qwen25Tower)
    full = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_qwen25).eval()
    ours, theirs = tower.visual.state_dict(), full.model.visual.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert torch.equal(tower.inv_freq, full.model.visual.rotary_pos_emb.inv_freq)


def test_fused_layer_structure_equals_reference_on_cpu(tiny_qwen25):
    """The fused path (float32 residual, add+RMSNorm chained into the next layer or the merger, one
    gate/up GEMM) with the kernels' torch fallbacks."""
    from app.vision.loading import load_vision_model

    visual = load_vision_model(tiny_qwen25, torch.float32)
    h = TowerHarness(Qwen25Tower(visual, fused=True), _reference(visual), BUDGETS, 1e-4)
    h.check(h.items([(1, 10, 14), (2, 6, 10)]), expect_graph=True)
    h.check(h.items([(1, 20, 22)]), expect_graph=True)


@pytest.mark.gpu
def test_uniform_graphs_equal_the_reference(gpu_harness):
    """Equal-length batches (an image, a video, same-size images) replay exact-shape graphs once seen
    twice: dense attention in the full layers, windows in the others."""
    gpu_harness.check_uniform_graphs(([(1, 32, 32)], [(4, 16, 16)], [(1, 16, 24)] * 3))


@pytest.mark.gpu
def test_eager_batches_build_no_cudnn_attention_plans(gpu_harness):
    """Eager batches (ever-new shapes) leave cuDNN's attention out: it builds a plan per new shape. Two
    equal 1600-token images take the dense path in the full-attention layers, a mixed batch the
    varlen one; both must match the reference."""
    h = gpu_harness
    batches = [h.items([(1, 40, 40)] * 2, seed=20), h.items([(1, 40, 40), (2, 20, 12)], seed=21)]
    h.check_eager_without_cudnn(batches)


@pytest.mark.gpu
def test_float32_graphs_equal_the_reference_in_float32(gpu32_harness):
    """The odd shapes in float32, graph against reference within FP32_TOL: non-square, mixed images and
    a video, every sequence slot used, over the largest budget (eager), an exact-shape graph, and
    results that outlive later replays."""
    h, mgr = gpu32_harness, gpu32_harness.mgr
    first = h.check(h.items([(1, 30, 42)]), expect_graph=True)
    kept = first[0].main.clone()
    h.check(h.items([(1, 10, 14), (2, 6, 10), (1, 16, 42)], seed=1), expect_graph=True)
    h.check(h.items([(15, 4, 6), (1, 6, 6)], seed=2), expect_graph=True)
    h.check(h.items([(1, 2, mgr.max_budget // 2 + 2)], seed=3), expect_graph=False)
    for seed in (4, 5):
        h.check(h.items([(1, 32, 32)], seed=seed), expect_graph=True)
    assert mgr.capture_pending() == 1
    h.check(h.items([(1, 32, 32)], seed=6), expect_graph=True)
    assert mgr.stats.uniform_hits == 1 and mgr.stats.eager_reasons["tokens"] == 1
    assert torch.equal(first[0].main, kept), "results must outlive later replays"


@pytest.mark.gpu
def test_fused_kernels_equal_torch_fallbacks():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from app.vision import kernels as K

    g = torch.Generator(device="cuda").manual_seed(0)
    n, c, inter = 777, 1280, 3420
    x = torch.randn(n, c, device="cuda", generator=g)
    y = torch.randn(n, c, device="cuda", dtype=torch.bfloat16, generator=g)
    b, w = (torch.randn(c, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    xs, hs = K.add_bias_rmsnorm(x, y, b, w, 1e-6)
    x0, h0 = K.add_bias_rmsnorm_torch(x, y, b, w, 1e-6)
    assert torch.allclose(xs, x0, atol=1e-5) and rel(hs, h0) <= 1e-2
    only, none = K.add_bias_rmsnorm(x, None, None, None, 1e-6)
    assert none is None and torch.equal(only, x)
    gu = torch.randn(n, 2 * inter, device="cuda", dtype=torch.bfloat16, generator=g)
    assert rel(K.silu_mul(gu), K.silu_mul_torch(gu)) <= 1e-2
