"""From a checkpoint folder (or a transformers model in memory) to what the engine runs: the text
model with its weights, and the facts the engine reads from the config and the generation config
(end-of-sequence ids, the vision placeholder ids, how far positions may run).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from .model import TextModel
from .parallel import SINGLE, TensorParallel
from .spec import TextSpec
from .weights import checkpoint_sources, init_random, load_weights, state_dict_sources

LoadFormat = Literal["auto", "dummy"]


@dataclass
class LoadedModel:
    model: TextModel
    config: dict  # the checkpoint's config.json
    tokenizer: object
    eos_ids: set[int]


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def load_checkpoint(path: str | Path, dtype: torch.dtype, device: torch.device, max_model_len: int,
                    tp: TensorParallel = SINGLE, load_format: LoadFormat = "auto") -> LoadedModel:
    """The text model of a checkpoint folder, this rank's share; `dummy`: random weights made on the
    device, the folder's safetensors never read (config and tokenizer only)."""
    from ..checkpoints.tokenizer_loader import load_tokenizer

    config = json.loads((Path(path) / "config.json").read_text())
    model = TextModel(TextSpec.from_config(config), dtype, device, rope_rows(config, max_model_len), tp)
    tokenizer = load_tokenizer(path)
    if load_format == "dummy":
        init_random(model, spoken=len(tokenizer))
    else:
        s = model.spec
        load_weights(model, checkpoint_sources(path, device, (*s.prefixes, s.head_name)))
    return LoadedModel(model.eval(), config, tokenizer, generation_eos(path) | _tokenizer_eos(tokenizer))


def load_in_memory(hf_model, tokenizer, dtype: torch.dtype, device: torch.device, max_model_len: int,
                   tp: TensorParallel = SINGLE) -> LoadedModel:
    """A transformers model in memory: our modules take its tensors by name."""
    config = hf_model.config.to_dict()
    model = TextModel(TextSpec.from_config(config), dtype, device, rope_rows(config, max_model_len), tp)
    load_weights(model, state_dict_sources(hf_model.state_dict().items()), module_layout=True)
    eos = hf_model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return LoadedModel(model.eval(), config, tokenizer, eos_ids | _tokenizer_eos(tokenizer))


def rope_rows(config: dict, max_model_len: int) -> int:
    """Rows of the rotary tables. Positions can run ahead of token counts (Qwen2.5-VL's video time axis
    counts seconds), so the tables go up to the model's own max_position_embeddings, at most four times
    max_model_len (the engine keeps every request inside them)."""
    text = config.get("text_config") or config
    return max(max_model_len + 16, min(int(text.get("max_position_embeddings") or 0), 4 * max_model_len))


def vision_token_ids(config: dict, tokenizer) -> tuple[int, ...]:
    """Token ids whose embeddings the encoder's rows replace: Qwen's image and video pads, or
    MiniCPM-V's `<unk>` placeholder (its config names no id; the tokenizer does)."""
    if config.get("model_type") == "minicpmv":
        return (tokenizer.convert_tokens_to_ids("<unk>"),)
    return config.get("image_token_id", -1), config.get("video_token_id", -1)


def generation_eos(path: str | Path) -> set[int]:
    f = Path(path) / "generation_config.json"
    if not f.is_file():
        return set()
    eos = json.loads(f.read_text()).get("eos_token_id")
    return set(eos if isinstance(eos, list) else [eos] if eos is not None else [])


def _tokenizer_eos(tokenizer) -> set[int]:
    return {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
