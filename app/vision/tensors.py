"""Reading named tensors out of a checkpoint folder's safetensors files (one or sharded with an index)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def checkpoint_files(path: Path) -> list[str]:
    index = path / "model.safetensors.index.json"
    return sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
        else ["model.safetensors"]


def read_tensors(path: str | Path, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Tensors whose names start with one of `prefixes`, keyed by the rest of the name."""
    from safetensors import safe_open

    path, state = Path(path), {}
    for name in checkpoint_files(path):
        with safe_open(str(path / name), framework="pt", device="cpu") as f:
            for key in f.keys():
                for prefix in prefixes:
                    if key.startswith(prefix):
                        state[key[len(prefix):]] = f.get_tensor(key)
    return state
