"""Build random-weight checkpoints offline.

No weights or tokenizers can be downloaded here, so the project makes its own: tiny models for CPU
tests and `make serve`, and checkpoints with real shapes for GPU benchmarks (speed does not depend on
weight values). A preset's `model_type` picks the family:

- `qwen3_vl` (`tiny`, `qwen3-vl-2b`, `qwen3-vl-8b`), `qwen3_vl_moe` (`tiny-qwen3-vl-moe`,
  `qwen3-vl-30b-a3b`, `qwen3-vl-235b-a22b`) and `qwen2_5_vl` (`tiny-qwen2.5-vl`, `qwen2.5-vl-3b`,
  `qwen2.5-vl-7b`): transformers' own classes save the weights, loadable by `from_pretrained`; the
  large MoE shapes are `--config-only`, served with `llm.load_format: dummy` (weights made on the GPU);
- `minicpmv` (`tiny-minicpm-v-4.5`, `minicpm-v-4.5`): MiniCPM-V is remote code on the Hub, not in
  transformers, so `minicpmv_builder.py` writes its published config keys and parameter names itself.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from .checkpoint_tokenizer import (  # noqa: F401 - re-exported: the builders' public names
    CHAT_TEMPLATE,
    QWEN25_CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    build_tokenizer,
    chatml_template,
    mute_unspoken_rows,
    write_generation_config,
)

log = logging.getLogger(__name__)

CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]

PRESET_DIR = Path(__file__).resolve().parent.parent.parent / "configs" / "models"
DEFAULT_CACHE = Path(os.environ.get("VLM_SERVE_CACHE", Path.home() / ".cache" / "vlm-serve"))
BUILDER_VERSION = 5  # bump when the built files change, so stale caches are rebuilt

def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def load_preset(name: str) -> dict:
    path = PRESET_DIR / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"unknown embedded model preset {name!r}; known: {', '.join(preset_names())}")
    return json.loads(path.read_text())


# Per Qwen family: transformers' config and model classes, processor classes and the chat template.
QWEN_FAMILIES = {
    "qwen3_vl": {"config": "Qwen3VLConfig", "model": "Qwen3VLForConditionalGeneration", "processor": "Qwen3VLProcessor",
                 "video_processor": "Qwen3VLVideoProcessor", "template": CHAT_TEMPLATE, "mean": [0.5] * 3,
                 "std": [0.5] * 3, "image_size": {"shortest_edge": 65536, "longest_edge": 16777216},
                 "video_size": {"shortest_edge": 4096, "longest_edge": 25165824}},
    "qwen3_vl_moe": {"config": "Qwen3VLMoeConfig", "model": "Qwen3VLMoeForConditionalGeneration",
                     "processor": "Qwen3VLProcessor", "video_processor": "Qwen3VLVideoProcessor",
                     "template": CHAT_TEMPLATE, "mean": [0.5] * 3, "std": [0.5] * 3,
                     "image_size": {"shortest_edge": 65536, "longest_edge": 16777216},
                     "video_size": {"shortest_edge": 4096, "longest_edge": 25165824}},
    "qwen2_5_vl": {"config": "Qwen2_5_VLConfig", "model": "Qwen2_5_VLForConditionalGeneration",
                   "processor": "Qwen2_5_VLProcessor", "video_processor": "Qwen2VLVideoProcessor",
                   "template": QWEN25_CHAT_TEMPLATE, "mean": CLIP_MEAN, "std": CLIP_STD,
                   "image_size": {"shortest_edge": 3136, "longest_edge": 12845056},
                   "video_size": {"shortest_edge": 3136, "longest_edge": 12845056}},
}


def _processor_configs(vision: dict, family: str) -> tuple[dict, dict]:
    fam = QWEN_FAMILIES[family]
    common = {
        "patch_size": vision["patch_size"],
        "temporal_patch_size": vision["temporal_patch_size"],
        "merge_size": vision["spatial_merge_size"],
        "image_mean": fam["mean"],
        "image_std": fam["std"],
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_resize": True,
        "do_convert_rgb": True,
    }
    image = {**common, "image_processor_type": "Qwen2VLImageProcessor", "processor_class": fam["processor"],
             "size": fam["image_size"]}
    video = {**common, "video_processor_type": fam["video_processor"], "processor_class": fam["processor"],
             "size": fam["video_size"], "fps": 2, "min_frames": 4, "max_frames": 768, "do_sample_frames": True}
    return image, video


def _write_qwen(tmp: Path, spec: dict, preset: str, seed: int, with_weights: bool, dtype: str) -> None:
    import torch
    import transformers

    family = spec.get("model_type", "qwen3_vl")
    fam = QWEN_FAMILIES[family]
    tokenizer = build_tokenizer(template=fam["template"])
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    # The config's special ids must be the tokenizer's (the prompt is built with the tokenizer). Real
    # shapes keep their vocabulary size, which the small tokenizer's ids fit into; tiny presets leave
    # it out and get the tokenizer's.
    spec["text_config"].setdefault("vocab_size", len(tokenizer))
    spec.update(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    text = spec["text_config"]
    text.setdefault("bos_token_id", ids["<|endoftext|>"])
    text.setdefault("eos_token_id", ids["<|im_end|>"])
    text.setdefault("pad_token_id", ids["<|endoftext|>"])
    config = getattr(transformers, fam["config"])(**spec)
    if with_weights:
        torch.manual_seed(seed)
        torch_dtype = torch.float32 if preset.startswith("tiny") else getattr(torch, dtype)
        model = getattr(transformers, fam["model"])(config).to(torch_dtype)
        mute_unspoken_rows([model.get_input_embeddings().weight, model.get_output_embeddings().weight],
                           len(tokenizer))
        model.generation_config.eos_token_id = ids["<|im_end|>"]
        model.generation_config.pad_token_id = ids["<|endoftext|>"]
        model.save_pretrained(tmp)
    else:
        config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    # after the model's own (which holds transformers' defaults only): Qwen3-VL-Instruct's sampling
    write_generation_config(tmp, text["bos_token_id"], ids["<|im_end|>"], ids["<|endoftext|>"])
    image_cfg, video_cfg = _processor_configs(spec["vision_config"], family)
    (tmp / "preprocessor_config.json").write_text(json.dumps(image_cfg, indent=2))
    (tmp / "video_preprocessor_config.json").write_text(json.dumps(video_cfg, indent=2))
    (tmp / "chat_template.jinja").write_text(fam["template"])


def build_checkpoint(out_dir: str | Path, preset: str = "tiny", seed: int = 0, with_weights: bool = True,
                     dtype: str = "bfloat16") -> Path:
    """Write a complete checkpoint folder for `preset` into `out_dir` (atomically)."""
    out_dir = Path(out_dir)
    spec = load_preset(preset)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent if out_dir.parent.exists() else None))
    try:
        if spec.get("model_type") == "minicpmv":
            from .minicpmv_builder import write_minicpmv

            write_minicpmv(tmp, spec, preset, seed, with_weights, dtype)
        else:
            _write_qwen(tmp, spec, preset, seed, with_weights, dtype)
        (tmp / "vlm_serve_builder.json").write_text(json.dumps({"preset": preset, "seed": seed,
                                                                 "version": BUILDER_VERSION}))
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        if out_dir.exists() and not (out_dir / "vlm_serve_builder.json").is_file():
            shutil.rmtree(out_dir)  # an incomplete earlier build
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not (out_dir / "vlm_serve_builder.json").is_file():
                raise  # else another process finished the same build first
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("built %s checkpoint at %s", preset, out_dir)
    return out_dir


def cache_root(cache_dir: str | Path | None) -> Path:
    """The app's `cache_dir`, or the default: embedded checkpoints, the tower's auto-tune table and the
    compiled Triton kernels live under it."""
    return Path(cache_dir) if cache_dir else DEFAULT_CACHE


def ensure_embedded(preset: str = "tiny", cache_dir: str | Path | None = None, seed: int = 0) -> Path:
    """Path of the cached embedded checkpoint for `preset`, building it on first use."""
    cache = cache_root(cache_dir)
    out = cache / f"{preset}-seed{seed}-v{BUILDER_VERSION}"
    marker = out / "vlm_serve_builder.json"
    if not marker.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        build_checkpoint(out, preset=preset, seed=seed)
    return out


def resolve_model(model: str, cache_dir: str | Path | None = None) -> Path:
    """'embedded:<preset>' -> built checkpoint; anything else must be a readable checkpoint folder."""
    if model.startswith("embedded:"):
        return ensure_embedded(model.split(":", 1)[1], cache_dir)
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(f"model path {path} does not exist or is not a directory (no hub downloads are made)")
    if not (path / "config.json").is_file():
        raise ValueError(f"model path {path} has no config.json: not a transformers checkpoint")
    try:
        json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"model path {path}: config.json is unreadable: {e}") from e
    return path


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("preset", choices=preset_names())
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config-only", action="store_true", help="config, tokenizer and processor files, no weights")
    a = p.parse_args()
    print(build_checkpoint(a.out_dir, a.preset, a.seed, with_weights=not a.config_only))


if __name__ == "__main__":
    main()
