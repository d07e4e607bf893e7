"""Router-side behaviour per model family: processor settings, placeholder expansion, video timing.

Qwen2.5-VL against transformers' image processor as the embedded checkpoint configures it (its
`Qwen2_5_VLProcessor` and video processor need torchvision, which this machine cannot import, so the
placeholder expansion is checked against the documented format: one pad per merged token, a video in
one block without timestamps).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.api.prompt import IMAGE_TYPE, VIDEO_TYPE, MediaSlot, PromptBuilder, video_timestamps_for
from app.media.preprocess import preprocess_image, seconds_per_group
from app.media.spec import patch_spec_for


@pytest.fixture(scope="module")
def tiny_qwen25(model_cache):
    from app.checkpoints.model_builder import ensure_embedded

    return ensure_embedded("tiny-qwen2.5-vl", model_cache)


def test_video_format_follows_the_checkpoint_family(tiny_checkpoint, tiny_qwen25, tmp_path):
    assert video_timestamps_for(tiny_checkpoint) and not video_timestamps_for(tiny_qwen25)
    assert video_timestamps_for(tmp_path)  # unknown: Qwen3-VL's format


def test_qwen25_image_rows_equal_the_image_processor_and_the_prompt_expands_them(tiny_qwen25):
    """Our rows (smart resize to multiples of 28, CLIP normalisation, patch 14 layout) equal transformers'
    Qwen2-VL image processor's as the checkpoint configures it, and the prompt holds one pad per merged
    token between vision start and end (the processor's expansion of the template's placeholder)."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = AutoTokenizer.from_pretrained(tiny_qwen25)
    image_proc = Qwen2VLImageProcessorPil.from_pretrained(tiny_qwen25)
    image = (np.random.default_rng(0).random((150, 230, 3)) * 255).astype(np.uint8)
    spec = patch_spec_for(tiny_qwen25)
    ours = preprocess_image(image, spec, image_proc.size["shortest_edge"], image_proc.size["longest_edge"])
    ref = image_proc(images=[image], return_tensors="pt")
    assert list(ours.grid) == ref["image_grid_thw"][0].tolist()
    assert np.abs(ours.pixel_values - ref["pixel_values"].numpy()).max() <= 1e-2  # PIL bicubic on both sides

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    prompt = PromptBuilder(tok).build(messages, [MediaSlot("image", ours.grid)])
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    n = ours.grid[1] * ours.grid[2] // 4
    assert prompt.input_ids == tok.encode(text.replace("<|image_pad|>", "<|image_pad|>" * n), add_special_tokens=False)
    assert prompt.mm_token_type_ids == [IMAGE_TYPE if t == tok.convert_tokens_to_ids("<|image_pad|>") else 0
                                        for t in prompt.input_ids]


def test_qwen25_video_is_one_block_without_timestamps(tiny_qwen25):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen25)
    ids = tok.convert_tokens_to_ids
    grid = (3, 4, 6)  # 3 temporal groups of 2 x 3 merged tokens
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "x"}]}]
    prompt = PromptBuilder(tok).build(messages, [MediaSlot("video", grid, timestamps=[0.5, 1.5, 2.5])])
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expanded = text.replace("<|video_pad|>", "<|video_pad|>" * 18)
    assert prompt.input_ids == tok.encode(expanded, add_special_tokens=False)
    assert prompt.count(VIDEO_TYPE) == 18 and prompt.count(IMAGE_TYPE) == 0
    assert prompt.input_ids.count(ids("<|vision_start|>")) == 1 and "seconds" not in tok.decode(prompt.input_ids)


def test_seconds_per_group_is_the_processors_second_per_grid_ts():
    from transformers.video_utils import VideoMetadata

    for total, fps, sampled in [(300, 30.0, 20), (97, 24.0, 8), (10, 5.0, 10)]:
        meta = VideoMetadata(total_num_frames=total, fps=fps, frames_indices=list(range(sampled)))
        assert seconds_per_group(sampled, total, fps, 2) == pytest.approx(2 / meta.sampled_fps, rel=1e-12)
    assert seconds_per_group(0, 0, 0.0, 2) == pytest.approx(2 / VideoMetadata(total_num_frames=0, fps=None).sampled_fps)


def test_qwen25_positions_reference_uses_second_per_grid_ts(tiny_qwen25):
    """What the LLM engine must reproduce (documented in the README): transformers' get_rope_index for
    a Qwen2.5-VL video spaces temporal positions by tokens_per_second x second_per_grid_ts."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_qwen25).eval()
    types = torch.tensor([[0, 0] + [2] * 12 + [0, 0]])  # a (3, 4, 4) video: 3 groups of 2 x 2 tokens
    pos, _ = model.model.get_rope_index(torch.zeros_like(types), types, video_grid_thw=torch.tensor([[3, 4, 4]]),
                                        second_per_grid_ts=torch.tensor([1.0]))
    tps = model.config.vision_config.tokens_per_second
    assert pos[0, 0, 2:14].tolist() == [2 + g * tps for g in range(3) for _ in range(4)]
