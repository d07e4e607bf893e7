"""app/checkpoints/tokenizer_loader.py against transformers' AutoTokenizer: for every class it loads
directly, the same class, token ids, decoded text and chat-template prompt; the rest goes to AutoTokenizer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from app.checkpoints.tokenizer_loader import DIRECT, direct_class, load_tokenizer

TEXTS = ["Hello, world!", "  spaces\tand\nnewlines  ", "数字 123 and émoji 🙂", "<|im_start|>user\nhi<|im_end|>"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


def _declaring(src, dst, tokenizer_class: str | None, **extra):
    shutil.copytree(src, dst)
    tok = json.loads((dst / "tokenizer_config.json").read_text())
    tok.pop("tokenizer_class", None)
    if tokenizer_class is not None:
        tok["tokenizer_class"] = tokenizer_class
    (dst / "tokenizer_config.json").write_text(json.dumps({**tok, **extra}))
    return dst


def _same(a, b):
    assert type(a) is type(b)
    for text in TEXTS:
        ids = b(text)["input_ids"]
        assert a(text)["input_ids"] == ids
        assert a.decode(ids) == b.decode(ids)
        assert a.decode(ids, skip_special_tokens=True) == b.decode(ids, skip_special_tokens=True)
    assert len(a) == len(b) and a.eos_token_id == b.eos_token_id and a.pad_token_id == b.pad_token_id
    assert a.all_special_ids == b.all_special_ids
    prompt = b.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert a.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == prompt


@pytest.mark.parametrize("declared", sorted(DIRECT))
def test_each_direct_class_loads_as_autotokenizer_does(tiny_checkpoint, tmp_path, declared):
    from transformers import AutoTokenizer

    path = _declaring(tiny_checkpoint, tmp_path / "ckpt", declared)
    assert direct_class(path) == DIRECT[declared]
    _same(load_tokenizer(path), AutoTokenizer.from_pretrained(path))


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3-vl-moe", "tiny-qwen2.5-vl"])
def test_each_familys_embedded_checkpoint_is_a_direct_case(model_cache, preset):
    """Every model type loaded directly (FAMILIES), through the checkpoint the project builds for it."""
    from transformers import AutoTokenizer

    from app.checkpoints.model_builder import ensure_embedded

    path = ensure_embedded(preset, model_cache)
    assert direct_class(path) is not None
    _same(load_tokenizer(path), AutoTokenizer.from_pretrained(path))


def test_other_cases_go_through_autotokenizer(tiny_checkpoint, tmp_path):
    """No declared class, an auto_map (remote code), another family, an unknown class: AutoTokenizer."""
    assert direct_class(_declaring(tiny_checkpoint, tmp_path / "none", None)) is None
    assert direct_class(_declaring(tiny_checkpoint, tmp_path / "remote", "TokenizersBackend",
                                   auto_map={"AutoTokenizer": ["x.Tok", None]})) is None
    assert direct_class(_declaring(tiny_checkpoint, tmp_path / "llama", "LlamaTokenizer")) is None
    other = _declaring(tiny_checkpoint, tmp_path / "family", "TokenizersBackend")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    assert direct_class(other) is None
    bare = _declaring(tiny_checkpoint, tmp_path / "no-json", "TokenizersBackend")
    (bare / "tokenizer.json").unlink()  # the class would build its tokenizer from other files: AutoTokenizer's call
    assert direct_class(bare) is None


def test_a_replica_loads_its_tokenizer_without_the_auto_classes(tiny_checkpoint):
    """In a fresh process: the auto classes' factory (and, in transformers 5.17, torch._dynamo and sympy
    with it) stays unimported."""
    code = (
        "import sys\n"
        "from app.checkpoints.tokenizer_loader import load_tokenizer\n"
        f"tok = load_tokenizer({str(tiny_checkpoint)!r})\n"
        "print(type(tok).__name__, sorted(m for m in sys.modules if m in ('transformers.models.auto.auto_factory',"
        " 'torch._dynamo', 'transformers.masking_utils', 'sympy')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split("\n")[0] == "TokenizersBackend []", out.stdout + out.stderr
