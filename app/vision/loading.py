"""Load only the vision tower of a Qwen3-VL checkpoint (the encoder replicas need nothing else)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

_PREFIXES = ("model.visual.", "visual.")


def vision_model_from_config(vision_config, dtype: torch.dtype, device: str | torch.device = "cpu"):
    """A randomly initialised transformers vision tower (benchmarks: speed ignores weight values)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    vision_config._attn_implementation = "sdpa"
    with torch.device(device):
        model = Qwen3VLVisionModel._from_config(vision_config, dtype=dtype)
    return model.eval()


def _axial_inv_freq(cfg) -> torch.Tensor:
    """The rotary buffer is not stored in checkpoints; rebuild it as the reference does."""
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    dim = cfg.hidden_size // cfg.num_heads // 2
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def load_vision_model(path: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu"):
    """transformers' `Qwen3VLVisionModel` with the checkpoint's `model.visual.*` weights."""
    from safetensors import safe_open
    from transformers import AutoConfig

    path = Path(path)
    config = AutoConfig.from_pretrained(path)
    model = vision_model_from_config(config.vision_config, dtype, "meta")
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
        else ["model.safetensors"]
    state = {}
    for name in files:
        with safe_open(str(path / name), framework="pt", device="cpu") as f:
            for key in f.keys():
                for prefix in _PREFIXES:
                    if key.startswith(prefix):
                        state[key[len(prefix):]] = f.get_tensor(key)
    if not state:
        raise ValueError(f"no vision tower weights (model.visual.*) found in {path}")
    model = model.to_empty(device=device)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if "inv_freq" not in k]:
        raise ValueError(f"vision weights in {path} do not match the config: missing {missing}, unexpected {unexpected}")
    model.rotary_pos_emb.inv_freq.copy_(_axial_inv_freq(config.vision_config))
    return model.to(dtype).eval()
