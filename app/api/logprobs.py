"""Log-probabilities in OpenAI's form: token ids become `{"token", "logprob", "bytes", "top_logprobs"}`.

The engine sends ids and numbers (app/llm/stream.py: one `(logprob, top ids, top logprobs)` per
token); text is made here, on the Router, only for requests that asked.

`bytes` is the token's exact UTF-8 bytes, `token` their text: a token holding part of a character
shows U+FFFD for the missing part, and consecutive tokens' `bytes` concatenate to the exact text.
Byte-level BPE (Qwen's, GPT-2's) writes each byte as one printable character; `_byte_level_alphabet`
is that mapping, so bytes come from the vocabulary string without a decode. Added tokens and other
tokenizers' pieces (SentencePiece) are decoded alone. vLLM's `return_tokens_as_token_ids` writes a
token as `token_id:<id>` (its `bytes` those of that text), which maps back to the vocabulary.
"""

from __future__ import annotations

import functools


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """Character -> byte of byte-level BPE: the printable Latin-1 bytes stand for themselves, and the
    other 68 (controls, space, soft hyphen...) for the characters from U+0100 on, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


class TokenText:
    """Token id -> (text, UTF-8 bytes), cached per id (a Router replica sees the same tokens again)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.alphabet = _byte_level_alphabet()
        # added tokens (special or not) are literal text, not written in the byte-level alphabet
        self.added = set(getattr(tokenizer, "added_tokens_decoder", None) or ())
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        got = self._cache.get(token_id)
        if got is None:
            got = self._cache[token_id] = self._text(token_id)
        return got

    def _text(self, token_id: int) -> tuple[str, list[int]]:
        piece = self.tok.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and token_id not in self.added and all(c in self.alphabet for c in piece):
            raw = bytes(self.alphabet[c] for c in piece)
            return raw.decode("utf-8", errors="replace"), list(raw)
        text = self.tok.decode([token_id], skip_special_tokens=False)
        return text, list(text.encode("utf-8"))

    def entry(self, token_id: int, logprob: float, as_ids: bool = False) -> dict:
        if as_ids:
            text = f"token_id:{token_id}"
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
        text, raw = self(token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}

    def content(self, token_ids: list[int], logprobs: list, as_ids: bool = False) -> list[dict]:
        """OpenAI's `logprobs.content` for tokens and their engine entries (`as_ids`: tokens written
        `token_id:<id>`)."""
        out = []
        for tid, (lp, top_ids, top_vals) in zip(token_ids, logprobs, strict=True):
            e = self.entry(tid, lp, as_ids)
            e["top_logprobs"] = [self.entry(i, v, as_ids) for i, v in zip(top_ids, top_vals)]
            out.append(e)
        return out
