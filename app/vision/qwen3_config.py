"""The Qwen3-VL vision tower's settings, read from a checkpoint's `config.json` without transformers.

Why: on the 16-core GPU hosts (transformers 5.17), `AutoConfig.from_pretrained` took 6.9-7.5 s in a
fresh process, with or without `HF_HUB_OFFLINE`, and imported `torch._dynamo` and sympy on the way: the
"module and config" phase of every LLM replica's start, on the path to ready (2026-12-02,
benchmarks/results/2026-12-02-vision-config-without-autoconfig-h200.md). The tower needs a dozen
numbers from the file: this reads them.

The defaults are transformers' `Qwen3VLVisionConfig` defaults, for keys a `config.json` leaves out
(transformers writes only the values that differ from them); tests/test_qwen3_config.py holds both the
defaults and every preset's values against transformers' own config. The MoE models' towers
(`qwen3_vl_moe`) have the same settings.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

FAMILIES = ("qwen3_vl", "qwen3_vl_moe")
# transformers' `attribute_map` for this config: a file may use either name
ALIASES = {"num_attention_heads": "num_heads", "num_hidden_layers": "depth"}


@dataclass(frozen=True)
class Qwen3VisionConfig:
    """The fields of transformers' `Qwen3VLVisionConfig` the tower reads, under the same names."""

    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    initializer_range: float = 0.02
    rope_parameters: dict | None = field(default=None, hash=False)
    model_type: str = "qwen3_vl_vision"

    @classmethod
    def from_dict(cls, values: dict) -> Qwen3VisionConfig:
        """The tower's fields from a `vision_config` dict; other keys (transformers' bookkeeping) are
        ignored, as the tower does not read them."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kept = {ALIASES.get(k, k): v for k, v in values.items() if ALIASES.get(k, k) in fields}
        if "rope_parameters" not in kept and "rope_theta" in values:  # the older flat key, as transformers reads it
            kept["rope_parameters"] = {"rope_type": "axial", "rope_theta": values["rope_theta"]}
        if "deepstack_visual_indexes" in kept:
            kept["deepstack_visual_indexes"] = tuple(kept["deepstack_visual_indexes"])
        for name in ("patch_size", "temporal_patch_size"):  # transformers allows a pair; the tower one size
            if isinstance(kept.get(name), (list, tuple)):
                sizes = set(kept[name])
                if len(sizes) != 1:
                    raise ValueError(f"vision_config.{name} {kept[name]}: the tower takes one size")
                kept[name] = sizes.pop()
        for name, value in kept.items():  # transformers' config checks types too: a wrong one fails here, not later
            want = int if fields[name].type == "int" else float if fields[name].type == "float" else None
            if want is not None and not (isinstance(value, (int, float) if want is float else int)
                                         and not isinstance(value, bool)):
                raise ValueError(f"vision_config.{name} = {value!r}: expected {want.__name__}")
        return cls(**kept)

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> Qwen3VisionConfig:
        """The `vision_config` of a Qwen3-VL checkpoint folder (dense or MoE)."""
        top = json.loads((Path(path) / "config.json").read_text())
        family = top.get("model_type", "")
        if family not in FAMILIES:
            raise ValueError(f"{path}: model_type {family!r} is not a Qwen3-VL checkpoint ({', '.join(FAMILIES)})")
        return cls.from_dict(top.get("vision_config") or {})
