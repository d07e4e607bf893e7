"""Our Qwen3-VL vision parameter tree (app/vision/qwen3_params.py) against transformers' `Qwen3VLVisionModel`.

The same parameter names and shapes for every Qwen3-VL preset (dense and MoE), the same sub-module
outputs bit for bit, the same tower outputs bit for bit on the same weights, the rotary table in float32
as transformers' `from_pretrained` keeps it, and a replica's tower built without transformers' modeling
code imported (the point of the tree: seconds of every replica's start).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch

from app.checkpoints.model_builder import PRESET_DIR

QWEN3_PRESETS = ["tiny", "tiny-qwen3-vl-moe", "qwen3-vl-2b", "qwen3-vl-8b", "qwen3-vl-32b", "qwen3-vl-30b-a3b",
                 "qwen3-vl-235b-a22b"]


def _vision_config(preset: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(**json.loads((PRESET_DIR / f"{preset}.json").read_text())).vision_config


def _reference(cfg, device="cpu"):
    from app.vision.loading import vision_model_from_config

    torch.manual_seed(0)
    return vision_model_from_config(cfg, torch.float32, device)


@pytest.mark.parametrize("preset", QWEN3_PRESETS)
def test_names_and_shapes_equal_transformers_module(preset):
    from app.vision.qwen3_params import Qwen3VisionParams

    cfg = _vision_config(preset)
    ref = _reference(cfg, "meta")
    with torch.device("meta"):
        ours = Qwen3VisionParams(cfg)
    want = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert got == want
    assert ours.blocks[0].norm1.eps == ref.blocks[0].norm1.eps and ours.merger.norm.eps == ref.merger.norm.eps


def test_sub_modules_equal_transformers_bit_for_bit():
    """The calls the tower makes on its module: each block's norms and MLP, the main and deepstack mergers."""
    from app.vision.qwen3_params import Qwen3VisionParams

    ref = _reference(_vision_config("tiny"))
    ours = Qwen3VisionParams.from_module(ref)
    x = torch.randn(32, ref.config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for a, b in zip(ours.blocks, ref.blocks, strict=True):
            assert torch.equal(a.norm1(x), b.norm1(x)) and torch.equal(a.norm2(x), b.norm2(x))
            assert torch.equal(a.mlp(x), b.mlp(x))
            assert torch.equal(a.mlp.act_fn(x), b.mlp.act_fn(x))
            assert torch.equal(a.attn.qkv(x), b.attn.qkv(x)) and torch.equal(a.attn.proj(x), b.attn.proj(x))
        assert torch.equal(ours.merger(x), ref.merger(x))
        for a, b in zip(ours.deepstack_merger_list, ref.deepstack_merger_list, strict=True):
            assert torch.equal(a(x), b(x))


def test_the_rebuilt_rotary_table_equals_transformers_own():
    """Checkpoints do not store it: loading._axial_inv_freq rebuilds it, for every Qwen3-VL preset."""
    from app.vision.loading import _axial_inv_freq

    for preset in QWEN3_PRESETS:
        cfg = _vision_config(preset)
        # the table depends on the width and heads only: the reference tower built one block deep (the
        # full-size towers took 40 s of CI to build on the CPU)
        shallow = copy.deepcopy(cfg)
        shallow.depth, shallow.deepstack_visual_indexes = 1, []
        assert torch.equal(_axial_inv_freq(cfg), _reference(shallow).rotary_pos_emb.inv_freq), preset


@pytest.mark.parametrize("name", ["gelu_pytorch_tanh", "gelu", "silu", "quick_gelu"])
def test_each_activation_equals_transformers(name):
    from transformers.activations import ACT2FN

    from app.vision.qwen3_params import Activation

    x = torch.randn(4096, generator=torch.Generator().manual_seed(4)) * 4
    assert torch.equal(Activation(name)(x), ACT2FN[name](x))


def test_the_rotary_table_stays_float32_through_casts():
    """A replica's later `.to(bf16)` (a test's, a benchmark's) keeps it exact, on the cast's device."""
    from app.vision.loading import vision_params

    visual = vision_params(_vision_config("tiny"), torch.float32)
    table = visual.rotary_pos_emb.inv_freq.clone()
    visual = visual.to(torch.bfloat16)
    assert visual.blocks[0].attn.qkv.weight.dtype == torch.bfloat16
    assert visual.rotary_pos_emb.inv_freq.dtype == torch.float32 and torch.equal(visual.rotary_pos_emb.inv_freq, table)


@pytest.mark.parametrize("fused", [False, True])
def test_the_tower_on_our_tree_equals_the_tower_on_transformers_module(tiny_checkpoint, fused):
    """Same checkpoint, both trees loaded from it: every output of the tower equal, bit for bit."""
    from app.vision.graphs import GraphManager, GraphSettings, VisionItem
    from app.vision.loading import load_vision_model
    from app.vision.qwen3_params import Qwen3VisionParams
    from app.vision.tower import VisionTower

    ours, ref = load_vision_model(tiny_checkpoint, torch.float32), load_vision_model(
        tiny_checkpoint, torch.float32, reference=True)
    assert isinstance(ours, Qwen3VisionParams) and not isinstance(ref, Qwen3VisionParams)
    g = torch.Generator().manual_seed(3)
    grids = [(1, 4, 6), (2, 4, 4), (1, 8, 8)]
    outs = []
    for visual in (ours, ref):
        tower = VisionTower(visual, fused=fused)
        items = [VisionItem(torch.randn(t * h * w, tower.patch_dim, generator=g.manual_seed(i)), (t, h, w))
                 for i, (t, h, w) in enumerate(grids)]
        outs.append(GraphManager(tower, GraphSettings(budgets=[256], autotune=False)).encode(items))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a.main, b.main)
        assert all(torch.equal(x, y) for x, y in zip(a.deepstack, b.deepstack, strict=True))


@pytest.mark.parametrize("family", ["tiny", "tiny-qwen2.5-vl"])
@pytest.mark.parametrize("random_weights", [False, True])
def test_the_rotary_table_stays_float32_in_bf16_as_transformers_keeps_it(model_cache, family, random_weights):
    """Both Qwen families (Qwen2.5-VL on transformers' module, through the meta path)."""
    from transformers import AutoModelForImageTextToText

    from app.checkpoints.model_builder import ensure_embedded
    from app.vision.loading import load_vision_model

    checkpoint = ensure_embedded(family, model_cache)
    want = AutoModelForImageTextToText.from_pretrained(
        checkpoint, dtype=torch.bfloat16).model.visual.rotary_pos_emb.inv_freq
    assert want.dtype == torch.float32
    for reference in (False, True):
        visual = load_vision_model(checkpoint, torch.bfloat16, random_weights=random_weights, reference=reference)
        assert visual.blocks[0].attn.qkv.weight.dtype == torch.bfloat16
        assert torch.equal(visual.rotary_pos_emb.inv_freq, want)


def test_random_weights_are_initialised_as_transformers_does():
    """Normal weights of the config's initializer range, zero biases, unit layer norms: nothing left as
    `torch.empty` left it, and the spread within 5% of transformers' own random module."""
    from app.vision.qwen3_params import Qwen3VisionParams

    cfg = _vision_config("tiny")
    torch.manual_seed(0)
    ours = Qwen3VisionParams.random(cfg, torch.float32)
    ref = _reference(cfg)
    want = ref.state_dict()
    assert set(ours.state_dict()) == set(want)
    for name, a in ours.state_dict().items():
        b = want[name]
        assert torch.isfinite(a).all(), name
        if name.endswith("bias"):
            assert torch.equal(a, torch.zeros_like(a)) and torch.equal(b, torch.zeros_like(b)), name
        elif "norm" in name:
            assert torch.equal(a, torch.ones_like(a)), name
        elif a.numel() > 1000:
            assert a.std().item() == pytest.approx(b.std().item(), rel=0.05), name


def test_an_unknown_activation_is_a_clear_error():
    from app.vision.qwen3_params import Qwen3VisionParams

    cfg = _vision_config("tiny")
    cfg.hidden_act = "swiglu_of_the_future"
    with pytest.raises(ValueError, match="unsupported vision activation 'swiglu_of_the_future'"):
        Qwen3VisionParams(cfg)


def test_a_replica_builds_its_tower_without_transformers_modeling_code(tiny_checkpoint):
    """In a fresh process, as an LLM or encoder replica builds it: the tower from the checkpoint, with none
    of transformers' model code imported (what this tree saves), nor its config classes and torch's
    compiler stack: `AutoConfig.from_pretrained` imported `torch._dynamo` and sympy and took 6.9-7.5 s on
    a GPU host (app/vision/qwen3_config.py)."""
    code = (
        "import sys, torch\n"
        "from app.vision.loading import build_tower\n"
        f"tower = build_tower({str(tiny_checkpoint)!r}, torch.float32)\n"
        "heavy = sorted(m for m in sys.modules if m in ('transformers.modeling_utils', 'transformers.activations',"
        " 'transformers.generation.utils', 'transformers.configuration_utils', 'torch._dynamo', 'sympy')"
        " or (m.startswith('transformers.models.') and ('.modeling_' in m or '.configuration_' in m)))\n"
        "print(type(tower.visual).__name__, type(tower.visual.config).__name__, heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split("\n")[0] == "Qwen3VisionParams Qwen3VisionConfig []", out.stdout + out.stderr
