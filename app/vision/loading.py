"""Load only the vision tower of a checkpoint (the encoder replicas need nothing else).

Supported families (the checkpoint's `model_type`): Qwen3-VL (`qwen3_vl`) into our parameter modules
(qwen3_params.py: transformers' names, without its modeling imports), Qwen2.5-VL (`qwen2_5_vl`) into
transformers' own tower modules, and MiniCPM-V 4.5 (`minicpmv`) into our modules with the published
parameter names (minicpmv_tower.py). `build_tower` wraps the loaded module in the matching graph-friendly
tower. `reference=True` loads transformers' module for any Qwen family: the tests' reference forward.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from .qwen3_config import FAMILIES as QWEN3_FAMILIES
from .qwen3_config import Qwen3VisionConfig
from .tensors import checkpoint_files, read_tensors  # noqa: F401 - read_tensors re-exported

_PREFIXES = ("model.visual.", "visual.")
QWEN_FAMILIES = ("qwen3_vl", "qwen2_5_vl")


def _tower_class(model_type: str):
    if model_type == "qwen3_vl":
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        return Qwen3VLVisionModel
    if model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
        )

        return Qwen2_5_VisionTransformerPretrainedModel
    raise ValueError(f"unsupported vision tower family {model_type!r}; known: {', '.join(QWEN_FAMILIES)}")


def _model_type(vision_config) -> str:
    mt = getattr(vision_config, "model_type", "")
    return "qwen2_5_vl" if mt.startswith("qwen2_5_vl") else "qwen3_vl" if mt.startswith("qwen3_vl") else mt


def vision_model_from_config(vision_config, dtype: torch.dtype, device: str | torch.device = "cpu"):
    """A randomly initialised transformers vision tower: the reference, with its forward (the tests, and
    benchmarks/encoder_families.py's reference rows; speed ignores weight values)."""
    cls = _tower_class(_model_type(vision_config))
    vision_config._attn_implementation = "sdpa"
    with torch.device(device):
        model = cls._from_config(vision_config, dtype=dtype)
    return model.eval()


def _our_tree(vision_config, reference: bool) -> bool:
    """Whether the tower's module is ours (qwen3_params.py: Qwen3-VL, unless the reference is asked for)."""
    return _model_type(vision_config) == "qwen3_vl" and not reference


def vision_params(vision_config, dtype: torch.dtype, device: str | torch.device = "cpu", reference: bool = False):
    """The module a tower runs on, random weights: Qwen3-VL's our own (qwen3_params.py) unless `reference`,
    the rotary frequencies set (float32)."""
    if _our_tree(vision_config, reference):
        from .qwen3_params import Qwen3VisionParams

        model = Qwen3VisionParams.random(vision_config, dtype, device)
    else:
        model = vision_model_from_config(vision_config, dtype, device)
    _set_inv_freq(model, vision_config)
    return model


def _axial_inv_freq(cfg) -> torch.Tensor:
    """The rotary buffer is not stored in checkpoints; rebuild it as the reference does."""
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    dim = cfg.hidden_size // cfg.num_heads // 2
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def checkpoint_family(path: str | Path) -> str:
    """The checkpoint's model_type (config.json)."""
    return json.loads((Path(path) / "config.json").read_text()).get("model_type", "")


def load_vision_model(path: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu",
                      random_weights: bool = False, phases: list | None = None, reference: bool = False):
    """The Qwen3-VL / Qwen2.5-VL vision tower's module (`vision_params`) with the checkpoint's
    `model.visual.*` weights, or (`random_weights`, `load_format: dummy`) random ones made on the device:
    a config-only folder serves. `phases` (a list) gets (name, start, end) of its steps, wall clock: the
    replica's start-up timeline. `reference`: transformers' module, with its forward."""
    t = time.time()
    path = Path(path)
    if checkpoint_family(path) in QWEN3_FAMILIES and not reference:  # our tree, from config.json alone
        vision_config = Qwen3VisionConfig.from_checkpoint(path)
    else:  # transformers' module: its config class
        from transformers import AutoConfig

        vision_config = AutoConfig.from_pretrained(path).vision_config
    if random_weights:
        return vision_params(vision_config, dtype, device, reference)
    if _our_tree(vision_config, reference):
        from .qwen3_params import Qwen3VisionParams

        model = Qwen3VisionParams.empty(vision_config, dtype, device)
    else:
        model = vision_model_from_config(vision_config, dtype, "meta")
    t = _mark(phases, "module and config", t)
    state = read_tensors(path, _PREFIXES)
    if not state:
        raise ValueError(f"no vision tower weights (model.visual.*) found in {path}")
    t = _mark(phases, "read", t)
    if model.patch_embed.proj.weight.is_meta:
        model = model.to_empty(device=device)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if "inv_freq" not in k]:
        raise ValueError(f"vision weights in {path} do not match the config: missing {missing}, unexpected {unexpected}")
    model = model.to(dtype).eval()
    _set_inv_freq(model, vision_config)
    _mark(phases, "to the device", t)
    return model


def _mark(phases: list | None, name: str, since: float) -> float:
    now = time.time()
    if phases is not None:
        phases.append((name, since, now))
    return now


def _set_inv_freq(model, vision_config) -> None:
    """The rotary frequencies in float32 whatever the weights' dtype, as transformers' `from_pretrained`
    keeps them. Rounded to bf16, as a module's `.to(dtype)` leaves its buffers, 0.1 reads 0.1001 and an
    angle at row 100 moves by up to 0.02 rad (2B tower's heads) or 0.18 rad (8B's)."""
    rot = model.rotary_pos_emb
    inv_freq = _axial_inv_freq(vision_config).to(rot.inv_freq.device)
    rot.inv_freq = inv_freq  # a registered buffer: this replaces it, dtype included
    if hasattr(rot, "original_inv_freq"):
        rot.original_inv_freq = inv_freq.clone()


def build_tower(path: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu",
                pixel_norm: tuple | None = None, fused: bool | None = None, random_weights: bool = False,
                phases: list | None = None):
    """The graph-friendly tower for a checkpoint of any supported family; `fused` as the towers take it
    (default: the fused body on CUDA with Triton). `phases`: as load_vision_model's (Qwen families)."""
    family = checkpoint_family(path)
    if family == "minicpmv":
        from .minicpmv_tower import MiniCPMVTower, load_minicpmv_vision

        if random_weights:
            raise ValueError("load_format 'dummy' makes Qwen-family towers only, not MiniCPM-V's")
        return MiniCPMVTower(load_minicpmv_vision(path, dtype, device), pixel_norm, fused)
    visual = load_vision_model(path, dtype, device, random_weights, phases)
    t = time.time()
    if family == "qwen2_5_vl":
        from .qwen25_tower import Qwen25Tower

        tower = Qwen25Tower(visual, pixel_norm, fused)
    else:
        from .tower import VisionTower

        tower = VisionTower(visual, pixel_norm, fused)
    _mark(phases, "graph-friendly tower", t)
    return tower
