"""Checks on text a client sends (message text, tool arguments, names): valid Unicode, and no vision
markers that could forge media placeholders. Shared by the request parser (schemas.py) and the tool
calls' checks (tools.py).
"""

from __future__ import annotations

from ..errors import ClientError
from .prompt import VISION_MARKERS, has_vision_marker


def _unicode(v: str, param: str) -> str:
    """The string, if it is valid Unicode text. JSON may escape lone UTF-16 surrogates ("\\ud800"), which
    the standard library's parser keeps; the tokenizer then raised a TypeError (a 500)."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise ClientError(f"{param} contains a lone UTF-16 surrogate", param=param, code="invalid_unicode") from None
    return v


def _message_text(v: str, param: str) -> str:
    """Message text, which must not contain the model's vision markers: the tokenizer reads them as
    special tokens, so a client could forge media placeholders that no media item backs (the prompt
    builder then failed with a 500) or vision markers that derail M-RoPE positions."""
    _unicode(v, param)
    if has_vision_marker(v):
        raise ClientError(f"{param} contains a reserved vision marker ({', '.join(VISION_MARKERS)}); send media as "
                          "image_url or video_url parts", param=param, code="reserved_token")
    return v
