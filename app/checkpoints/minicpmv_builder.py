"""Random-weight MiniCPM-V 4.5 checkpoints, written without the Hub's remote code.

MiniCPM-V is not in transformers, so the checkpoint is written file by file in its published format:

- `config.json`: `model_type` "minicpmv", `version` 4.5, the Qwen3 text keys at the top level, the
  vision and slicing keys (`query_num`, `slice_config`, `slice_mode`, ...) and a SigLIP `vision_config`;
- `model.safetensors`: `vpm.*` (SigLIP), `resampler.*` and `llm.*` (a Qwen3 causal LM's own names);
- `preprocessor_config.json`: the processor's slicing and normalisation settings, placeholder tokens;
- a byte-level BPE tokenizer with ChatML's and MiniCPM-V's special tokens (`<unk>` is the placeholder
  the LLM's embeddings replace) and a chat template that renders each image as `(<image>./</image>)`.
"""

from __future__ import annotations

import json
from pathlib import Path

from .checkpoint_tokenizer import chatml_template, mute_unspoken_rows

# MiniCPM-V's placeholder and boundary tokens, after ChatML's.
MINICPMV_TOKENS = ["<unk>", "<image>", "</image>", "<slice>", "</slice>", "<image_id>", "</image_id>",
                   "<think>", "</think>"]
IMAGE_PLACEHOLDER = "(<image>./</image>)"

# A message's content: a string as it is, or its parts one per line, each image as the placeholder (a
# video part renders nothing: MiniCPMVPromptBuilder sends videos as image parts).
_CONTENT_MACRO = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}{{- '(<image>./</image>)' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
)

# ChatML as MiniCPM-V 4.5 (a Qwen3 LLM) writes it, with Qwen's tool calling (model_builder's).
MINICPMV_CHAT_TEMPLATE = chatml_template(_CONTENT_MACRO, "\\n")


def processor_config(spec: dict) -> dict:
    slice_cfg = spec["slice_config"]
    return {"image_processor_type": "MiniCPMVImageProcessor", "processor_class": "MiniCPMVProcessor",
            "max_slice_nums": slice_cfg["max_slice_nums"], "scale_resolution": slice_cfg["scale_resolution"],
            "patch_size": spec["patch_size"], "use_image_id": spec["use_image_id"],
            "image_feature_size": spec["query_num"], "slice_mode": spec.get("slice_mode", True),
            "im_start": "<image>", "im_end": "</image>", "slice_start": "<slice>", "slice_end": "</slice>",
            "unk": "<unk>", "im_id_start": "<image_id>", "im_id_end": "</image_id>",
            "norm_mean": [0.5, 0.5, 0.5], "norm_std": [0.5, 0.5, 0.5], "version": spec["version"]}


def _random_vision(config: dict, seed: int):
    import torch

    from ..vision.minicpmv_tower import MiniCPMVision

    torch.manual_seed(seed)
    model = MiniCPMVision(config)
    res = model.resampler
    with torch.no_grad():  # the published initialisation of the learned parts
        res.query.normal_(std=0.02)
        res.proj.copy_(res.proj.shape[0] ** -0.5 * torch.randn_like(res.proj))
        model.vpm.embeddings.position_embedding.weight.normal_(std=0.02)
    return model


def _text_model(config: dict, seed: int):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
            "tie_word_embeddings", "hidden_act", "bos_token_id", "eos_token_id", "pad_token_id")
    text = Qwen3Config(**{k: config[k] for k in keys if k in config})
    torch.manual_seed(seed + 1)
    return Qwen3ForCausalLM(text)


def write_minicpmv(tmp: Path, spec: dict, preset: str, seed: int, with_weights: bool, dtype: str) -> None:
    import torch
    from safetensors.torch import save_file

    from .checkpoint_tokenizer import SPECIAL_TOKENS, build_tokenizer, write_generation_config

    tokenizer = build_tokenizer(template=MINICPMV_CHAT_TEMPLATE, specials=SPECIAL_TOKENS + MINICPMV_TOKENS)
    tokenizer.unk_token = "<unk>"
    ids = tokenizer.convert_tokens_to_ids
    config = dict(spec)
    config.setdefault("vocab_size", len(tokenizer))
    config.update(bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"),
                  architectures=["MiniCPMV"])
    if with_weights:
        torch_dtype = torch.float32 if preset.startswith("tiny") else getattr(torch, dtype)
        state = {k: v for k, v in _random_vision(config, seed).state_dict().items()}
        text = _text_model(config, seed)
        mute_unspoken_rows([text.get_input_embeddings().weight, text.get_output_embeddings().weight], len(tokenizer))
        state.update({f"llm.{k}": v for k, v in text.state_dict().items()
                      if not (config.get("tie_word_embeddings") and k == "lm_head.weight")})
        save_file({k: v.to(torch_dtype).contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        config["torch_dtype"] = str(torch_dtype).removeprefix("torch.")
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(tmp)
    write_generation_config(tmp, config["bos_token_id"], config["eos_token_id"], config["pad_token_id"])
    (tmp / "preprocessor_config.json").write_text(json.dumps(processor_config(config), indent=2))
    (tmp / "chat_template.jinja").write_text(MINICPMV_CHAT_TEMPLATE)
