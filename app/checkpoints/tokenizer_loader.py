"""A checkpoint's tokenizer, loaded through the class it declares when that class is one of a known few.

Why: `transformers.AutoTokenizer` imports the auto classes' factory, which in transformers 5.17 (the
GPU image's) imports the generation stack and `transformers.masking_utils`, and with it `torch._dynamo`
and sympy: its import took 5.1 s in a fresh process on the CPU machine against 2.2 s for
`PreTrainedTokenizerFast`. Every LLM replica and Router loads a tokenizer on the path to ready.

For a Qwen-family checkpoint whose `tokenizer_config.json` names one of `DIRECT`'s classes and no
`auto_map`, `AutoTokenizer` ends at that class's `from_pretrained` (transformers 5.x,
`tokenization_auto.py`), so this calls it directly; anything else still goes through `AutoTokenizer`.
tests/test_tokenizer_loader.py holds each direct case against `AutoTokenizer`'s result: the same
class, encodings, decodings and chat template.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

# the class a tokenizer_config.json names -> (module, attribute) to import it from, without the auto classes
DIRECT = {
    "PreTrainedTokenizerFast": ("transformers.tokenization_utils_tokenizers", "TokenizersBackend"),
    "TokenizersBackend": ("transformers.tokenization_utils_tokenizers", "TokenizersBackend"),
    "Qwen2Tokenizer": ("transformers.models.qwen2.tokenization_qwen2", "Qwen2Tokenizer"),
    "Qwen2TokenizerFast": ("transformers.models.qwen2.tokenization_qwen2", "Qwen2Tokenizer"),
}
# the model types whose AutoTokenizer path has no special case for these classes
FAMILIES = ("qwen3_vl", "qwen3_vl_moe", "qwen2_5_vl")


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def direct_class(path: str | Path) -> tuple[str, str] | None:
    """(module, class) that `AutoTokenizer` would end at for this checkpoint, when it is one of `DIRECT`'s;
    None: ask `AutoTokenizer`."""
    path = Path(path)
    if _json(path / "config.json").get("model_type") not in FAMILIES:
        return None
    tok = _json(path / "tokenizer_config.json")
    if "auto_map" in tok or not (path / "tokenizer.json").is_file():
        return None
    return DIRECT.get(tok.get("tokenizer_class"))


def load_tokenizer(path: str | Path):
    """The checkpoint's tokenizer, as `AutoTokenizer.from_pretrained(path)` gives it."""
    target = direct_class(path)
    if target is None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    module, name = target
    return getattr(importlib.import_module(module), name).from_pretrained(path)
