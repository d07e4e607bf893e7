import json

import pytest
import torch

from app.checkpoints.model_builder import (
    SPECIAL_TOKENS,
    build_checkpoint,
    load_preset,
    preset_names,
    resolve_model,
)


def test_tiny_checkpoint_loads_through_from_pretrained(tiny_checkpoint):
    from transformers import AutoConfig, AutoTokenizer, Qwen3VLForConditionalGeneration

    cfg = AutoConfig.from_pretrained(tiny_checkpoint)
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    v = cfg.vision_config
    assert (v.patch_size, v.temporal_patch_size, v.spatial_merge_size) == (16, 2, 2)
    assert len(v.deepstack_visual_indexes) >= 1 and v.out_hidden_size == cfg.text_config.hidden_size
    assert cfg.text_config.rope_parameters["mrope_section"] == [4, 2, 2]
    # special token ids in the tokenizer match the config
    assert tok.convert_tokens_to_ids("<|image_pad|>") == cfg.image_token_id
    assert tok.convert_tokens_to_ids("<|video_pad|>") == cfg.video_token_id
    assert tok.convert_tokens_to_ids("<|vision_start|>") == cfg.vision_start_token_id
    assert tok.convert_tokens_to_ids("<|vision_end|>") == cfg.vision_end_token_id
    for t in SPECIAL_TOKENS:
        assert tok.encode(t, add_special_tokens=False) == [tok.convert_tokens_to_ids(t)]
    assert cfg.text_config.vocab_size == len(tok)
    text = "Hello, world! ünïcödé 0.5 seconds"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text  # byte-level: lossless
    model = Qwen3VLForConditionalGeneration.from_pretrained(tiny_checkpoint)
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    rendered = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}],
                                       tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>x<|im_end|>\n<|im_start|>assistant\n"


def test_weights_are_reproducible_from_the_seed(tmp_path, tiny_checkpoint):
    from safetensors.torch import load_file

    again = build_checkpoint(tmp_path / "again", "tiny", seed=0)
    a, b = load_file(str(tiny_checkpoint / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_real_shape_presets(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    assert {"tiny", "qwen3-vl-2b", "qwen3-vl-8b"} <= set(preset_names())
    out = build_checkpoint(tmp_path / "8b", "qwen3-vl-8b", with_weights=False)
    cfg = AutoConfig.from_pretrained(out)
    assert (cfg.vision_config.depth, cfg.vision_config.hidden_size, cfg.vision_config.out_hidden_size) == (27, 1152, 4096)
    assert cfg.vision_config.deepstack_visual_indexes == [8, 16, 24]
    assert cfg.text_config.num_hidden_layers == 36
    tok = AutoTokenizer.from_pretrained(out)  # the prompt's placeholder ids are the config's
    for key, token in [("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                       ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")]:
        assert getattr(cfg, key) == tok.convert_tokens_to_ids(token) < cfg.text_config.vocab_size
    assert load_preset("qwen3-vl-2b")["vision_config"]["depth"] == 24


def test_unknown_preset_and_bad_paths_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown embedded model preset"):
        resolve_model("embedded:nope", tmp_path)
    with pytest.raises(ValueError, match=str(tmp_path / "missing")):
        resolve_model(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path / "empty"))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{")
    with pytest.raises(ValueError, match="unreadable"):
        resolve_model(str(tmp_path / "broken"))


def test_a_path_model_resolves_to_itself(tiny_checkpoint):
    assert resolve_model(str(tiny_checkpoint)) == tiny_checkpoint
    assert json.loads((tiny_checkpoint / "vlm_serve_builder.json").read_text())["preset"] == "tiny"


def test_qwen25_presets_have_the_published_shapes(tmp_path):
    from transformers import AutoConfig

    for preset, out, text_hidden, layers, kv, tie in [("qwen2.5-vl-3b", 2048, 2048, 36, 2, True),
                                                       ("qwen2.5-vl-7b", 3584, 3584, 28, 4, False)]:
        cfg = AutoConfig.from_pretrained(build_checkpoint(tmp_path / preset, preset, with_weights=False))
        v, t = cfg.vision_config, cfg.text_config
        assert cfg.model_type == "qwen2_5_vl"
        assert (v.depth, v.hidden_size, v.num_heads, v.intermediate_size, v.out_hidden_size) == (32, 1280, 16, 3420, out)
        assert (v.patch_size, v.spatial_merge_size, v.temporal_patch_size, v.window_size) == (14, 2, 2, 112)
        assert list(v.fullatt_block_indexes) == [7, 15, 23, 31] and v.tokens_per_second == 2
        assert (t.hidden_size, t.num_hidden_layers, t.num_key_value_heads, cfg.tie_word_embeddings) == \
            (text_hidden, layers, kv, tie)
        assert t.rope_parameters["mrope_section"] == [16, 24, 24]


def test_tiny_qwen25_checkpoint_loads_with_its_processor_settings_and_template(model_cache):
    from transformers import AutoConfig, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from app.checkpoints.model_builder import CLIP_MEAN, CLIP_STD, ensure_embedded
    from app.media.preprocess import PatchSpec
    from app.media.spec import patch_spec_for

    path = ensure_embedded("tiny-qwen2.5-vl", model_cache)
    cfg, tok = AutoConfig.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    for key, token in [("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                       ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")]:
        assert getattr(cfg, key) == tok.convert_tokens_to_ids(token)
    assert cfg.text_config.vocab_size == len(tok)
    assert patch_spec_for(path) == PatchSpec(14, 2, 2, tuple(CLIP_MEAN), tuple(CLIP_STD))
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path)
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    rendered = tok.apply_chat_template([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "x"}]}],
                                       tokenize=False, add_generation_prompt=True)
    assert rendered == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                        "<|vision_start|><|video_pad|><|vision_end|>x<|im_end|>\n<|im_start|>assistant\n")


def test_ids_the_tokenizer_lacks_are_never_generated_so_random_answers_stream_text(tmp_path):
    """A real shape keeps its vocabulary (151,936 ids) beside the builder's small tokenizer. With random
    weights nearly every sampled id was one the tokenizer lacks, decoding to "": streamed answers carried
    no text (GuideLLM timed no first token, 2026-11-28). Those ids' embedding and LM-head rows are now
    zeros, so greedy decoding picks spoken ids, and the engine's `dummy` weights do the same on each rank."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

    from app.checkpoints.model_builder import _write_qwen
    from app.llm.loader import rope_rows
    from app.llm.model import TextModel
    from app.llm.parallel import TensorParallel
    from app.llm.spec import TextSpec
    from app.llm.weights import init_random

    spec = load_preset("tiny")
    spec["text_config"]["vocab_size"] = 2048
    spec["text_config"]["tie_word_embeddings"] = False
    out = tmp_path / "wide"
    out.mkdir()
    _write_qwen(out, spec, "tiny", 0, True, "float32")
    tok = AutoTokenizer.from_pretrained(out)
    spoken = len(tok)
    assert spoken < 2048
    weights = load_file(str(out / "model.safetensors"))
    rows = [v for k, v in weights.items() if k.endswith("embed_tokens.weight") or k == "lm_head.weight"]
    assert len(rows) == 2
    for w in rows:
        # (the embedding's padding row is transformers' zeros)
        assert w.shape[0] == 2048 and not w[spoken:].any() and w[:spoken].abs().sum(1).gt(0).sum() >= spoken - 1
    model = Qwen3VLForConditionalGeneration.from_pretrained(out)
    ids = tok("Tell me about the picture.", return_tensors="pt").input_ids
    new = model.generate(ids, max_new_tokens=24, do_sample=False, min_new_tokens=24)[0, ids.shape[1]:]
    assert new.lt(spoken).all() and tok.decode(new).strip()

    config = json.loads((out / "config.json").read_text())
    for rank in (0, 1):  # each rank its share of the rows: rank 1's first row is id 1024
        tp = TensorParallel(rank=rank, size=2)
        m = TextModel(TextSpec.from_config(config), torch.float32, torch.device("cpu"), rope_rows(config, 64), tp)
        init_random(m, spoken=spoken)
        for w in (m.embed, m.head_weight):
            local = max(0, spoken - m.vocab_start)
            assert not w[local:].any() and (local == 0 or w[:local].abs().sum(1).gt(0).all())
