"""A checkpoint's processor settings (preprocessor_config.json) as the PatchSpec its tower reads:
Qwen's patch, merge and normalisation, or MiniCPM-V's slicing (slicing.py), which sets its own.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from .preprocess import PatchSpec
from .slicing import SliceSpec


def patch_spec_for(path: str | Path) -> PatchSpec:
    cfg_path = Path(path) / "preprocessor_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    if cfg.get("image_processor_type") == "MiniCPMVImageProcessor":
        slicing = SliceSpec.from_checkpoint(path)
        return dataclasses.replace(slicing.patch_spec, slicing=slicing)
    return PatchSpec(patch=cfg.get("patch_size", 16), temporal=cfg.get("temporal_patch_size", 2),
                     merge=cfg.get("merge_size", 2), mean=tuple(cfg.get("image_mean", (0.5,) * 3)),
                     std=tuple(cfg.get("image_std", (0.5,) * 3)))
