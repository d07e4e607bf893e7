"""The towers `benchmarks/encoder.py` compares, one `Family` per model family: our tower, the reference it
is judged against (in the run's dtype, and in float32 as the truth), a FLOP count and the workloads.

- Qwen3-VL (`qwen3-vl-2b`, `qwen3-vl-8b`, `tiny`): reference = transformers' `Qwen3VLVisionModel`;
- Qwen2.5-VL (`qwen2.5-vl-3b`, `qwen2.5-vl-7b`, `tiny-qwen2.5-vl`): reference = transformers'
  `Qwen2_5_VisionTransformerPretrainedModel` (window attention);
- MiniCPM-V 4.5 (`minicpm-v-4.5`, `tiny-minicpm-v-4.5`): reference = the published forward's batching
  on our modules' weights, its flash_attention_2 path; its default path (eager attention) is timed
  beside it (benchmarks/minicpmv_reference.py); MiniCPM-V is not in transformers.

Weights are random (speed does not depend on their values). Workloads are grids (t, h, w) in patches of
what the router sends for a given source image: Qwen sides are the smart-resized ones (patch x merge
multiples), MiniCPM-V images are cut by the router's slicing scheme (app/media/slicing.py), each slice
an item. The tiny presets take the same grids: their towers accept any grid, which keeps the CPU smoke
run's batches shaped like the real ones.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from app.checkpoints.model_builder import CLIP_MEAN, CLIP_STD, load_preset
from app.media.preprocess import PatchSpec
from app.vision.loading import vision_model_from_config

# Qwen3-VL: 16-px patches, sides multiples of 32 (448 -> 28 x 28 patches; a 224^2 8-frame video is
# 4 temporal groups of 14 x 14; 1024 -> 64).
WORKLOADS_QWEN3 = {
    "1x448^2": [(1, 28, 28)],
    "4x448^2": [(1, 28, 28)] * 4,
    "8x224^2": [(1, 14, 14)] * 8,
    "video 224^2 x8f": [(4, 14, 14)],
    "4 videos 224^2 x8f": [(4, 14, 14)] * 4,
    "1x1024^2": [(1, 64, 64)],
    "mixed 2x448^2+video+2x224^2": [(1, 28, 28), (4, 14, 14), (1, 28, 28), (1, 14, 14), (1, 14, 14)],
}
# Qwen2.5-VL: 14-px patches, sides multiples of 28 (448 -> 32 x 32 patches, 224 -> 16). A 1024^2 image
# becomes 1008^2 (72 x 72) under the router's default image_max_pixels (1024^2).
WORKLOADS_QWEN25 = {
    "1x448^2": [(1, 32, 32)],
    "4x448^2": [(1, 32, 32)] * 4,
    "8x224^2": [(1, 16, 16)] * 8,
    "video 224^2 x8f": [(4, 16, 16)],
    "4 videos 224^2 x8f": [(4, 16, 16)] * 4,
    "1x1024^2 (1008^2)": [(1, 72, 72)],
    "mixed 2x448^2+video+2x224^2": [(1, 32, 32), (4, 16, 16), (1, 32, 32), (1, 16, 16), (1, 16, 16)],
}
# MiniCPM-V: source images (width, height), cut as the router cuts them (448^2 is one slice; 1024^2 a
# 448^2 thumbnail and 2 x 3 slices of 546 x 364; 640 x 480 a thumbnail and 2 x 1 slices).
IMAGES_MINICPMV = {
    "1x448^2": [(448, 448)],
    "4x448^2": [(448, 448)] * 4,
    "1x1024^2 (sliced)": [(1024, 1024)],
    "1x1344x896 (sliced)": [(1344, 896)],
    "mixed 2x448^2+640x480 (sliced)": [(448, 448), (640, 480), (448, 448)],
}


@dataclass
class Family:
    """One tower under test. `reference` (the run's dtype) and `truth` (float32) take normalised float rows
    and grids and return [main, *extras], rows in item order, as our manager's outputs concatenate."""

    name: str  # qwen3_vl, qwen2_5_vl, minicpmv
    tower: object
    reference: object
    truth: object
    flops: object  # grids -> matmul FLOPs of one forward
    workloads: dict[str, list[tuple[int, int, int]]]
    # Other paths of the same published forward, timed beside `reference` (which the ratio uses)
    extra_references: dict[str, object] = field(default_factory=dict)


def qwen3_flops(cfg, grids) -> float:
    """Qwen3-VL: matmul FLOPs of one forward (linear layers + attention), the dominant work."""
    d, i, L = cfg.hidden_size, cfg.intermediate_size, cfg.depth
    m2 = cfg.spatial_merge_size**2
    n = sum(t * h * w for t, h, w in grids)
    patch = 2 * n * d * cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    per_layer = 2 * n * (3 * d * d + d * d + 2 * d * i)
    attn = sum(t * 4 * (h * w) ** 2 * d for t, h, w in grids)
    mergers = (1 + len(cfg.deepstack_visual_indexes)) * 2 * (n // m2) * (d * m2 * d * m2 + d * m2 * cfg.out_hidden_size)
    return patch + L * (per_layer + attn) + mergers


def qwen25_flops(cfg, grids) -> float:
    """Qwen2.5-VL: SwiGLU MLP (three matrices); attention over windows (at most 64 patches) except at
    the full-attention layers."""
    d, i, L = cfg.hidden_size, cfg.intermediate_size, cfg.depth
    m2 = cfg.spatial_merge_size**2
    n = sum(t * h * w for t, h, w in grids)
    patch = 2 * n * d * cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    per_layer = 2 * n * (4 * d * d + 3 * d * i)
    full = sum(t * 4 * (h * w) ** 2 * d for t, h, w in grids)
    window = 4 * n * 64 * d
    nf = len(cfg.fullatt_block_indexes)
    merger = 2 * (n // m2) * (d * m2 * d * m2 + d * m2 * cfg.out_hidden_size)
    return patch + L * per_layer + nf * full + (L - nf) * window + merger


def minicpmv_grids(images: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """The tower's items for source images of (width, height), thumbnail then slices per image, as the
    router cuts them with the published default slicing settings."""
    import numpy as np

    from app.media.slicing import SliceSpec, slice_image

    spec = SliceSpec()
    grids = []
    for w, h in images:
        for im in slice_image(np.zeros((h, w, 3), np.uint8), spec).images:
            grids.append((1, im.shape[0] // spec.patch, im.shape[1] // spec.patch))
    return grids


def _truth_copy(module, dtype: torch.dtype):
    """The float32 judge: the module itself when the run is already float32."""
    return module if dtype == torch.float32 else copy.deepcopy(module).float()


def _reference_copy(module, dtype: torch.dtype):
    """The reference's own modules: our fused tower re-lays its weights out (one fused qkv or gate/up
    tensor, MLP widths padded), leaving the modules' parameters as views that the reference would then
    read with other strides. In float32 the reference is the judge itself (`_truth_copy`)."""
    return module if dtype == torch.float32 else copy.deepcopy(module)


def qwen_family(preset: str, dtype: torch.dtype, device: str) -> Family:
    from transformers import AutoConfig

    config = load_preset(preset)
    cfg = AutoConfig.for_model(**config).vision_config
    torch.manual_seed(0)
    visual = vision_model_from_config(cfg, dtype, device)
    truth, reference = _truth_copy(visual, dtype), _reference_copy(visual, dtype)
    if config["model_type"] == "qwen2_5_vl":
        from app.vision.qwen25_tower import Qwen25Tower as tower_cls

        mean, std, flops, workloads = tuple(CLIP_MEAN), tuple(CLIP_STD), qwen25_flops, WORKLOADS_QWEN25
    else:
        from app.vision.tower import VisionTower as tower_cls

        mean, std, flops, workloads = (0.5,) * 3, (0.5,) * 3, qwen3_flops, WORKLOADS_QWEN3
    spec = PatchSpec(patch=cfg.patch_size, temporal=cfg.temporal_patch_size, merge=cfg.spatial_merge_size,
                     mean=mean, std=std)

    def run(model):
        def f(px, grids):
            out = model(px, grid_thw=torch.tensor(grids, device=px.device))
            return [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]
        return f

    if config["model_type"] != "qwen2_5_vl":  # the tree a replica's tower runs on, with the same weights
        from app.vision.qwen3_params import Qwen3VisionParams

        visual = Qwen3VisionParams.from_module(visual)
    return Family(config["model_type"], tower_cls(visual, pixel_norm=spec.column_norm()), run(reference), run(truth),
                  lambda grids: flops(cfg, grids), workloads)


def minicpmv_family(preset: str, dtype: torch.dtype, device: str) -> Family:
    from app.checkpoints.minicpmv_builder import _random_vision
    from app.vision.minicpmv_tower import MiniCPMVTower
    from benchmarks.minicpmv_reference import PublishedStyleMiniCPMV, minicpmv_flops

    model = _random_vision(load_preset(preset), seed=0).to(device)
    truth_model = _truth_copy(model, dtype)
    truth = PublishedStyleMiniCPMV(truth_model)
    model = model.to(dtype)
    ref_model = truth_model if dtype == torch.float32 else _reference_copy(model, dtype)
    # The headline reference is the published code's fast path (flash_attention_2); its default path
    # (eager attention, what `attn_implementation="sdpa"` gives the vision tower) is timed beside it.
    reference = truth if dtype == torch.float32 else PublishedStyleMiniCPMV(ref_model)
    extra = {"published default (eager attention)": PublishedStyleMiniCPMV(ref_model, attention="eager")}
    spec = PatchSpec(patch=14, temporal=1, merge=1)  # MiniCPM-V normalises with mean = std = 0.5
    workloads = {name: minicpmv_grids(images) for name, images in IMAGES_MINICPMV.items()}
    return Family("minicpmv", MiniCPMVTower(model, pixel_norm=spec.column_norm()), reference, truth,
                  lambda grids: minicpmv_flops(model, grids), workloads, extra)


def family_for(preset: str, dtype: torch.dtype, device: str) -> Family:
    if load_preset(preset).get("model_type") == "minicpmv":
        return minicpmv_family(preset, dtype, device)
    return qwen_family(preset, dtype, device)
