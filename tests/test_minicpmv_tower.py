"""MiniCPM-V 4.5's vision path (SigLIP-NaViT + resampler) under the graph manager, against an
independent, straightforward reference written here from the published architecture.

The reference runs one slice at a time, with loops: transformers' `SiglipVisionModel` (the weights
loaded from the checkpoint's `vpm.*`) for the patch encoder, through its own pixel path where the
slice has the learned table's full size and through its encoder and post-layernorm after a
Conv2d + bucketed-position embedding otherwise; then the resampler as published: learned queries
through ln_q, keys ln_kv(kv_proj(x)) + a numpy 2-D sin-cos table, values ln_kv(kv_proj(x)), one
`nn.MultiheadAttention`, ln_post, @ proj. CPU: the tiny checkpoint in float32, ours (static padded
path and eager) within 1e-4 of it. GPU (marker `gpu`): MiniCPM-V-4.5-shaped random weights, ours in
bf16 with captured graphs against the reference in float32 (<= 2e-2, and no further from it than the
reference's own bf16 forward); and ours in float32 with captured graphs against the reference in float32
(<= FP32_TOL = 1e-3: float32 rounding in different kernels through 27 random-weight layers; a wrong
position id, slot or padding row errs by O(1) on its rows).
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from torch import nn
from tower_harness import TowerHarness, rel

from app.vision.minicpmv_tower import MiniCPMVision, MiniCPMVTower

BUDGETS = [64, 128, 256]
GPU_BUDGETS = [1024, 2048, 4096, 8192]  # a full-size 70 x 70 slice (4900 tokens) fits the largest
FP32_TOL = 1e-3  # GPU, float32 tower and reference (module docstring)


def router_slices(width: int, height: int) -> list[tuple[int, int, int]]:
    """Grids of the items the router sends for one source image: thumbnail, then the slices."""
    from app.media.slicing import SliceSpec, slice_image

    spec = SliceSpec()
    return [(1, im.shape[0] // spec.patch, im.shape[1] // spec.patch)
            for im in slice_image(np.zeros((height, width, 3), np.uint8), spec).images]


# ---------------------------------------------------------------------------- the independent reference
def published_positions(h: int, w: int, side: int) -> torch.Tensor:
    """SigLIP-NaViT's position ids for one slice, as the published embedding computes them from its
    tgt_sizes tensor (int32), one slice at a time."""
    tgt = torch.tensor([[h, w]], dtype=torch.int32)
    boundaries = torch.arange(1 / side, 1.0, 1 / side)
    nb_h, nb_w = tgt[0][0], tgt[0][1]
    frac_h = torch.arange(0, 1 - 1e-6, 1 / nb_h)
    frac_w = torch.arange(0, 1 - 1e-6, 1 / nb_w)
    bh = torch.bucketize(frac_h, boundaries, right=True)
    bw = torch.bucketize(frac_w, boundaries, right=True)
    return (bh[:, None] * side + bw).flatten()


def sincos_2d(embed_dim: int, h: int, w: int) -> np.ndarray:
    """The resampler's [h, w, E] table, numpy float32 as published: the meshgrid puts w first, so the
    first half of each vector encodes the column and the second the row."""
    def one_d(dim, pos):
        omega = np.arange(dim // 2, dtype=np.float32)
        omega /= dim / 2.0
        omega = 1.0 / 10000**omega
        out = np.einsum("hw,d->hwd", pos, omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=-1)
    grid = np.stack(np.meshgrid(np.arange(w, dtype=np.float32), np.arange(h, dtype=np.float32)), axis=0)
    return np.concatenate([one_d(embed_dim // 2, grid[0]), one_d(embed_dim // 2, grid[1])], axis=-1)


class Reference(nn.Module):
    """Per slice, loops allowed. Built from a MiniCPM-V config and a `vpm.*` / `resampler.*` state dict."""

    def __init__(self, config: dict, state: dict[str, torch.Tensor]):
        super().__init__()
        from transformers import SiglipVisionConfig, SiglipVisionModel

        v = dict(config["vision_config"])
        v.pop("model_type", None)
        layers = v["num_hidden_layers"] - (1 if config.get("drop_vision_last_layer") else 0)
        vcfg = SiglipVisionConfig(**{**v, "num_hidden_layers": layers}, vision_use_head=False)
        vcfg._attn_implementation = "eager"
        self.siglip = SiglipVisionModel(vcfg).eval()
        self.siglip.load_state_dict({k[4:]: t for k, t in state.items()
                                     if k.startswith("vpm.") and not k.startswith(f"vpm.encoder.layers.{layers}.")})
        self.side = v["image_size"] // v["patch_size"]
        self.patch = v["patch_size"]
        e = config["hidden_size"]
        self.embed_dim = e
        self.mha = nn.MultiheadAttention(e, e // 128)
        self.mha.load_state_dict({k[len("resampler.attn."):]: t for k, t in state.items()
                                  if k.startswith("resampler.attn.")})
        self.query = nn.Parameter(state["resampler.query"].clone())
        self.kv_proj = nn.Linear(v["hidden_size"], e, bias=False)
        self.kv_proj.weight.data.copy_(state["resampler.kv_proj.weight"])
        self.ln_q, self.ln_kv, self.ln_post = (nn.LayerNorm(e, eps=1e-6) for _ in range(3))
        for name in ("ln_q", "ln_kv", "ln_post"):
            getattr(self, name).load_state_dict({"weight": state[f"resampler.{name}.weight"],
                                                 "bias": state[f"resampler.{name}.bias"]})
        self.proj = nn.Parameter(state["resampler.proj"].clone())

    def patches(self, rows: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """Patch rows (C, P, P each, row-major over the slice) back to the slice image [1, 3, H, W]."""
        p = self.patch
        return rows.view(h, w, 3, p, p).permute(2, 0, 3, 1, 4).reshape(1, 3, h * p, w * p)

    def encode(self, image: torch.Tensor, h: int, w: int) -> torch.Tensor:
        vm = self.siglip
        if (h, w) == (self.side, self.side):  # transformers' own pixel path fits exactly
            return vm(pixel_values=image).last_hidden_state[0]
        emb = vm.embeddings.patch_embedding(image.to(vm.embeddings.patch_embedding.weight.dtype)).flatten(2)
        emb = emb.transpose(1, 2) + vm.embeddings.position_embedding(published_positions(h, w, self.side).to(image.device))
        return vm.post_layernorm(vm.encoder(inputs_embeds=emb).last_hidden_state)[0]

    def resample(self, feats: torch.Tensor, h: int, w: int) -> torch.Tensor:
        x = self.ln_kv(self.kv_proj(feats))[:, None]  # L x 1 x E
        pos = torch.from_numpy(sincos_2d(self.embed_dim, h, w).reshape(h * w, -1)).to(x)
        out = self.mha(self.ln_q(self.query)[:, None], x + pos[:, None], x)[0][:, 0]
        return self.ln_post(out) @ self.proj

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor, grids) -> list[torch.Tensor]:
        outs, off = [], 0
        for _, h, w in grids:
            image = self.patches(pixels[off:off + h * w], h, w)
            outs.append(self.resample(self.encode(image, h, w), h, w))
            off += h * w
        return [torch.cat(outs)]


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tiny_minicpmv(model_cache):
    from app.checkpoints.model_builder import ensure_embedded

    return ensure_embedded("tiny-minicpm-v-4.5", model_cache)


@pytest.fixture(scope="module")
def cpu_harness(tiny_minicpmv):
    from safetensors.torch import load_file

    from app.vision.loading import build_tower

    config = json.loads((tiny_minicpmv / "config.json").read_text())
    ref = Reference(config, load_file(str(tiny_minicpmv / "model.safetensors")))
    tower = build_tower(tiny_minicpmv, torch.float32)
    assert isinstance(tower, MiniCPMVTower)
    h = TowerHarness(tower, ref, BUDGETS, 1e-4, max_items=6, max_frames=6)
    h.side, h.reference_model = ref.side, ref
    return h


def _gpu_vision():
    """MiniCPM-V-4.5's vision side with random weights on the GPU, and its config (skips without CUDA)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from app.checkpoints.minicpmv_builder import _random_vision
    from app.checkpoints.model_builder import load_preset

    config = load_preset("minicpm-v-4.5")
    return config, _random_vision(config, seed=0).cuda()


@pytest.fixture(scope="module")
def gpu_harness():
    config, model = _gpu_vision()
    ref32 = Reference(config, {k: t.float() for k, t in model.state_dict().items()}).cuda()
    ref16 = copy.deepcopy(ref32).to(torch.bfloat16)

    def in_dtype(ref, dtype):
        return lambda pixels, grids: ref(pixels.to(dtype), grids)

    tower = MiniCPMVTower(model.to(torch.bfloat16))
    h = TowerHarness(tower, in_dtype(ref16, torch.bfloat16), GPU_BUDGETS, 2e-2,
                     truth=in_dtype(ref32, torch.float32), max_items=12, max_frames=12, uniform_capture_after=2)
    h.side = ref32.side
    return h


@pytest.fixture(scope="module")
def gpu32_harness():
    """MiniCPM-V-4.5-shaped, float32 with captured graphs, judged directly by the reference in float32."""
    config, model = _gpu_vision()
    ref = Reference(config, model.state_dict()).cuda()
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # the reference's Conv2d patch embedding would round to TF32
    try:
        h = TowerHarness(MiniCPMVTower(model), ref, [1024, 4096, 8192], FP32_TOL, max_items=12, max_frames=12,
                         uniform_capture_after=2)
        h.side = ref.side
        yield h
    finally:
        torch.backends.cudnn.allow_tf32 = tf32


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def h(request):
    return request.getfixturevalue(f"{request.param}_harness")


# ---------------------------------------------------------------------------- tests
def test_bucketed_positions_are_the_published_ones():
    """Including the sizes where a float64 step 1 / h would put a coordinate in another bucket than the
    published float32 step (h = 3, 6, 7, ... with side 70)."""
    from app.vision.minicpmv_metadata import bucketed_positions

    differ = 0
    for h in range(1, 100):
        w = 101 - h
        assert torch.equal(bucketed_positions(h, w, 70), published_positions(h, w, 70)), (h, w)
        naive = torch.bucketize(torch.arange(0, 1 - 1e-6, 1 / h), torch.arange(1 / 70, 1.0, 1 / 70), right=True)
        differ += not torch.equal(naive, published_positions(h, 1, 70)[::1])
    assert differ > 0  # the float32 detail matters


def test_resampler_key_positions_equal_the_published_table(cpu_harness):
    from app.vision.minicpmv_metadata import row_cols
    from app.vision.minicpmv_resampler import key_positions

    tower = cpu_harness.tower
    for h, w in [(5, 9), (8, 8), (1, 13)]:
        ours = key_positions(row_cols(h, w), tower.omega)
        ref = torch.from_numpy(sincos_2d(tower.embed_dim, h, w).reshape(h * w, -1))
        assert (ours - ref).abs().max() <= 1e-5


def test_one_full_size_slice_equals_siglip_and_the_resampler(h):
    h.check(h.items([(1, h.side, h.side)]), expect_graph=True)


def test_a_thumbnail_and_its_slices(h):
    """An image as the router sends it: a thumbnail and slices of other sizes, each its own item."""
    h.check(h.items([(1, 5, 9), (1, 6, 7), (1, 6, 7), (1, 6, 7), (1, 6, 6)]), expect_graph=True)


def test_odd_slices_of_several_images(h):
    h.check(h.items([(1, 1, 13), (1, 8, 3), (1, 4, 4)], seed=3), expect_graph=True)


def test_equal_slices_eager_take_the_dense_path(h):
    h.check(h.items([(1, 6, 7)] * 3, seed=4), expect_graph=False, force_eager=True)


def test_over_the_largest_budget_falls_back_to_eager(h):
    before = h.mgr.stats.eager_reasons["tokens"]
    side = h.side
    n = h.mgr.max_budget // (side * side) + 1
    h.check(h.items([(1, side, side)] * n), expect_graph=False)
    assert h.mgr.stats.eager_reasons["tokens"] == before + 1


def test_batch_exactly_filling_the_largest_budget(h):
    top = h.mgr.max_budget
    q = top // 4
    grids = [h.tower.synthetic_grid(n) for n in (q + q // 4, q - q // 4, q, q)]
    assert sum(t * a * b for t, a, b in grids) == top
    before = h.mgr.stats.per_budget[top]
    h.check(h.items(grids, seed=10), expect_graph=True)
    assert h.mgr.stats.per_budget[top] == before + 1


def test_one_token_over_a_budget_takes_the_next(h):
    b0, b1 = h.mgr.budgets[:2]
    before = h.mgr.stats.per_budget[b1]
    h.check(h.items([h.tower.synthetic_grid(b0 + 1)], seed=11), expect_graph=True)
    assert h.mgr.stats.per_budget[b1] == before + 1


def test_as_many_slices_as_a_graph_holds(h):
    n = h.mgr.settings.max_items_per_batch
    h.check(h.items([(1, 3 + i % 3, 5 + i % 4) for i in range(n)], seed=12), expect_graph=True)


def test_a_1024_image_as_the_router_slices_it(h):
    """A thumbnail and 2 x 3 non-square slices (7108 tokens): a graph on the GPU, over the tiny
    harness's budget (eager) on the CPU; equal to the reference either way."""
    grids = router_slices(1024, 1024)
    assert len(grids) == 7 and sum(a * b for _, a, b in grids) == 7108
    h.check(h.items(grids, seed=13), expect_graph=h.truth is not None)


def test_too_many_slices_fall_back(h):
    before = h.mgr.stats.eager_reasons["items"]
    h.check(h.items([(1, 2, 2)] * (h.mgr.settings.max_items_per_batch + 1)), expect_graph=False)
    assert h.mgr.stats.eager_reasons["items"] == before + 1


def test_replay_after_replay_has_no_stale_data(h):
    big = h.check(h.items([(1, 7, 8), (1, 5, 5)], seed=5), expect_graph=True)
    kept = big[0].main.clone()
    h.check(h.items([(1, 2, 3)], seed=6), expect_graph=True)
    h.check(h.items([(1, 7, 8), (1, 5, 5)], seed=7), expect_graph=True)
    assert torch.equal(big[0].main, kept), "results must outlive later replays"


def test_static_padded_path_equals_eager_and_padding_stays_finite(h):
    items = h.items([(1, 3, 5), (1, 4, 2)], seed=8)
    graph = h.mgr.encode(items)
    budget = h.mgr.budgets[0]
    main, _ = h.mgr._graph_out[budget] if h.mgr.graphs else h.mgr.tower(h.mgr._static_inputs(budget))
    assert torch.isfinite(main).all() and main.shape[0] == h.mgr.seq_slots * h.tower.queries
    eager = h.mgr.encode(items, force_eager=True)
    for a, b in zip(graph, eager, strict=True):
        assert rel(a.main, b.main) <= (1e-5 if h.truth is None else 2e-2)


def test_fused_layer_structure_equals_reference_on_cpu(tiny_minicpmv, cpu_harness):
    """The fused SigLIP path (float32 residual, add+LN chained into the next layer or post_layernorm,
    fc1 with GELU) through the kernels' torch fallbacks."""
    from app.vision.loading import build_tower

    tower = build_tower(tiny_minicpmv, torch.float32, fused=True)
    h = TowerHarness(tower, cpu_harness.reference_model, BUDGETS, 1e-4, max_items=6, max_frames=6)
    h.check(h.items([(1, 5, 9), (1, 8, 8)]), expect_graph=True)


def test_weights_load_by_published_names(tiny_minicpmv, tmp_path):
    """Every vpm.* / resampler.* tensor lands in the parameter of the same name; a checkpoint that keeps
    the dropped last SigLIP layer loads too, one that lacks a tensor is refused."""
    from safetensors.torch import load_file, save_file

    from app.vision.minicpmv_tower import load_minicpmv_vision

    state = load_file(str(tiny_minicpmv / "model.safetensors"))
    model = load_minicpmv_vision(tiny_minicpmv, torch.float32)
    ours = model.state_dict()
    assert all(torch.equal(ours[k], state[k]) for k in ours) and len(model.vpm.encoder.layers) == 2
    import shutil

    for variant, change in [("extra", lambda s: s.update({k.replace("layers.1.", "layers.2."): v.clone() for k, v in s.items()
                                                          if k.startswith("vpm.encoder.layers.1.")})),
                            ("missing", lambda s: s.pop("resampler.proj"))]:
        d = tmp_path / variant
        shutil.copytree(tiny_minicpmv, d)
        s = dict(state)
        change(s)
        save_file(s, str(d / "model.safetensors"))
        if variant == "extra":
            assert torch.equal(load_minicpmv_vision(d, torch.float32).resampler.proj, state["resampler.proj"])
        else:
            with pytest.raises(ValueError, match="resampler.proj"):
                load_minicpmv_vision(d, torch.float32)


def test_a_random_model_has_the_published_parameter_names():
    from app.checkpoints.model_builder import load_preset

    names = set(MiniCPMVision(load_preset("tiny-minicpm-v-4.5")).state_dict())
    for n in ("vpm.embeddings.patch_embedding.weight", "vpm.embeddings.position_embedding.weight",
              "vpm.encoder.layers.0.self_attn.q_proj.weight", "vpm.encoder.layers.0.mlp.fc1.bias",
              "vpm.encoder.layers.0.layer_norm1.weight", "vpm.post_layernorm.bias", "resampler.query",
              "resampler.kv_proj.weight", "resampler.attn.in_proj_weight", "resampler.attn.out_proj.bias",
              "resampler.ln_q.weight", "resampler.ln_kv.bias", "resampler.ln_post.weight", "resampler.proj"):
        assert n in names


@pytest.mark.gpu
def test_uniform_graph_for_equal_slices(gpu_harness):
    """A 448^2-class image (one 32 x 32 slice) and equal-size slices replay exact-shape graphs once seen
    twice: dense SigLIP attention and the folded resampler attention."""
    gpu_harness.check_uniform_graphs(([(1, 32, 32)], [(1, 24, 20)] * 4))


@pytest.mark.gpu
def test_eager_batches_build_no_cudnn_attention_plans(gpu_harness):
    """Eager batches leave cuDNN's attention out (a plan per new shape): equal slices take the dense
    SigLIP call and the folded resampler (GEMMs and a softmax), unequal ones the varlen SigLIP kernel and
    the variable-length resampler call."""
    h = gpu_harness
    batches = [h.items([(1, 32, 40)] * 2, seed=20), h.items([(1, 32, 40), (1, 20, 30)], seed=21)]
    h.check_eager_without_cudnn(batches)


@pytest.mark.gpu
def test_float32_graphs_equal_the_reference_in_float32(gpu32_harness):
    """In float32, graph against reference within FP32_TOL: a full-size slice, a 1024^2 image as the
    router slices it, odd slices of several images, over the largest budget (eager), an exact-shape
    graph for equal slices, and results that outlive later replays."""
    h, mgr = gpu32_harness, gpu32_harness.mgr
    first = h.check(h.items([(1, h.side, h.side)]), expect_graph=True)
    kept = first[0].main.clone()
    h.check(h.items(router_slices(1024, 1024), seed=1), expect_graph=True)
    h.check(h.items([(1, 1, 13), (1, 8, 3), (1, 4, 4), (1, 26, 39)], seed=2), expect_graph=True)
    h.check(h.items([(1, h.side, h.side)] * 2, seed=3), expect_graph=False)  # 9800 tokens
    for seed in (4, 5):
        h.check(h.items([(1, 24, 20)] * 3, seed=seed), expect_graph=True)
    assert mgr.capture_pending() == 1
    h.check(h.items([(1, 24, 20)] * 3, seed=6), expect_graph=True)
    assert mgr.stats.uniform_hits == 1 and mgr.stats.eager_reasons["tokens"] == 1
    assert torch.equal(first[0].main, kept), "results must outlive later replays"


@pytest.mark.gpu
def test_variable_length_resampler_attention_equals_the_masked_one(gpu_harness, monkeypatch):
    """In bf16 on CUDA, slices of unequal sizes meet the resampler in one variable-length call (each
    slot's queries against its own slice's keys). Padded to a budget with empty slots, its live rows equal
    the masked call's (every slot against every key under a slot-id mask) within bf16 rounding, and the
    unused rows are finite."""
    from app.vision import attention
    from app.vision.tower_api import TowerBatch

    tower = gpu_harness.tower
    grids = [(1, 7, 9), (1, 20, 31), (1, 3, 4)]
    lay = tower.layout(grids)
    budget, slots = 1024, 6
    meta = {k: t.cuda() for k, t in tower.metadata(lay, budget, None, slots).items()}
    g = torch.Generator(device="cuda").manual_seed(0)
    heads, d = tower.res_heads, tower.embed_dim // tower.res_heads
    # [H, N, d] views of [N, H, d] rows, as the resampler's projections give them
    k, v = (torch.randn(budget, heads, d, generator=g, device="cuda", dtype=torch.bfloat16).transpose(0, 1)
            for _ in range(2))
    batch = TowerBatch(torch.empty(0), meta, max_seqlen=budget, static=True)
    varlen = tower._cross_attention(tower.res_q, k, v, batch)
    monkeypatch.setattr(attention, "uses_torch_varlen", lambda *a: False)
    masked = tower._cross_attention(tower.res_q, k, v, batch)
    live = len(grids)
    assert varlen.shape == masked.shape == (slots, tower.queries, tower.embed_dim)
    assert torch.isfinite(varlen).all()
    assert rel(varlen[:live].float(), masked[:live].float()) <= 1e-2
