"""The Qwen3-VL tower's settings read from config.json (app/vision/qwen3_config.py) against transformers'
own config classes: the defaults, every preset's checkpoint, and what a file may leave out."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from app.vision.qwen3_config import ALIASES, Qwen3VisionConfig

QWEN3_PRESETS = ["tiny", "tiny-qwen3-vl-moe", "qwen3-vl-2b", "qwen3-vl-8b", "qwen3-vl-32b", "qwen3-vl-30b-a3b",
                 "qwen3-vl-235b-a22b"]
FIELDS = [f.name for f in dataclasses.fields(Qwen3VisionConfig) if f.name not in ("rope_parameters", "model_type")]


def _theirs(vision_config, name):
    value = getattr(vision_config, name)
    return tuple(value) if isinstance(value, list) else value


def test_defaults_equal_transformers_vision_config():
    """A `config.json` written by transformers leaves out the values equal to its defaults: ours must be
    the same, and the rotary table built from either the same."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig

    from app.vision.loading import _axial_inv_freq

    ref = Qwen3VLVisionConfig()
    ours = Qwen3VisionConfig()
    assert {n: getattr(ours, n) for n in FIELDS} == {n: _theirs(ref, n) for n in FIELDS}
    assert torch.equal(_axial_inv_freq(ours), _axial_inv_freq(ref))
    assert Qwen3VisionConfig.from_dict({}) == ours


@pytest.mark.parametrize("preset", QWEN3_PRESETS)
def test_every_preset_reads_as_transformers_reads_it(preset, tmp_path):
    """The checkpoint the project builds (config only), read by us and by `AutoConfig.from_pretrained`."""
    from transformers import AutoConfig

    from app.checkpoints.model_builder import build_checkpoint
    from app.vision.loading import _axial_inv_freq

    build_checkpoint(tmp_path, preset=preset, with_weights=False)
    ref = AutoConfig.from_pretrained(tmp_path).vision_config
    ours = Qwen3VisionConfig.from_checkpoint(tmp_path)
    assert {n: getattr(ours, n) for n in FIELDS} == {n: _theirs(ref, n) for n in FIELDS}
    assert torch.equal(_axial_inv_freq(ours), _axial_inv_freq(ref))
    assert ours.model_type.startswith("qwen3_vl")


def test_values_left_out_take_transformers_defaults(tmp_path):
    """A vision_config with only some keys (as a hand-written or trimmed file may be), and a pair of
    equal patch sizes: what transformers makes of the same file."""
    from transformers import AutoConfig

    from app.checkpoints.model_builder import build_checkpoint

    build_checkpoint(tmp_path, preset="tiny", with_weights=False)
    top = json.loads((tmp_path / "config.json").read_text())
    kept = {k: top["vision_config"][k] for k in ("depth", "hidden_size", "num_heads", "intermediate_size",
                                                   "out_hidden_size", "deepstack_visual_indexes")}
    top["vision_config"] = {**kept, "some_future_key": 1}
    (tmp_path / "config.json").write_text(json.dumps(top))
    ref = AutoConfig.from_pretrained(tmp_path).vision_config
    ours = Qwen3VisionConfig.from_checkpoint(tmp_path)
    assert {n: getattr(ours, n) for n in FIELDS} == {n: _theirs(ref, n) for n in FIELDS}
    assert Qwen3VisionConfig.from_dict({**kept, "patch_size": [14, 14]}).patch_size == 14


def test_what_the_tower_cannot_take_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="the tower takes one size"):
        Qwen3VisionConfig.from_dict({"patch_size": [14, 16]})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": {}}))
    with pytest.raises(ValueError, match="not a Qwen3-VL checkpoint"):
        Qwen3VisionConfig.from_checkpoint(tmp_path)


def test_a_checkpoint_loads_through_our_config_and_the_reference_through_transformers(tiny_checkpoint):
    """The served path reads config.json itself; `reference=True` keeps transformers' config and module.
    Both hold the same weights (the towers' outputs on them: test_qwen3_params.py, bit for bit)."""
    from app.vision.loading import load_vision_model

    ours = load_vision_model(tiny_checkpoint, torch.float32)
    ref = load_vision_model(tiny_checkpoint, torch.float32, reference=True)
    assert isinstance(ours.config, Qwen3VisionConfig)
    assert type(ref.config).__name__ == "Qwen3VLVisionConfig"
    a, b = ours.state_dict(), ref.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("vision", [{"num_attention_heads": 2, "num_hidden_layers": 3},  # transformers' aliases
                                    {"rope_theta": 5000.0},  # the older flat key for the rotary base
                                    {"rope_parameters": {"rope_type": "axial", "rope_theta": 20.0}}])
def test_other_spellings_read_as_transformers_reads_them(tiny_checkpoint, tmp_path, vision):
    from transformers import AutoConfig

    from app.vision.loading import _axial_inv_freq

    shutil.copytree(tiny_checkpoint, tmp_path / "ckpt")
    top = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    top["vision_config"] = {k: v for k, v in top["vision_config"].items()
                            if k not in ("num_heads", "depth", "rope_parameters", "rope_theta")} | vision
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(top))
    ref = AutoConfig.from_pretrained(tmp_path / "ckpt").vision_config
    ours = Qwen3VisionConfig.from_checkpoint(tmp_path / "ckpt")
    want = {n: _theirs(ref, n) for n in FIELDS}
    # an alias means what it names (transformers 5.24 reads both; 5.17, the GPU image's, ignores
    # num_hidden_layers and would then expect 27 layers the file does not hold)
    want |= {ALIASES[k]: v for k, v in vision.items() if k in ALIASES}
    assert {n: getattr(ours, n) for n in FIELDS} == want
    assert torch.equal(_axial_inv_freq(ours), _axial_inv_freq(ref))


def test_a_value_of_the_wrong_type_is_a_clear_error():
    for bad in ({"depth": "24"}, {"hidden_size": 64.0}, {"num_heads": True}):
        with pytest.raises(ValueError, match="expected int"):
            Qwen3VisionConfig.from_dict(bad)
    assert Qwen3VisionConfig.from_dict({"initializer_range": 1}).initializer_range == 1  # an int is a float
    hash(Qwen3VisionConfig(rope_parameters={"rope_theta": 1.0}))  # frozen, and hashable with its dict
