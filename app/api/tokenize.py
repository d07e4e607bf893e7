"""vLLM's `POST /tokenize` and `POST /detokenize`.

`/tokenize` takes a text `prompt` (encoded as /v1/completions encodes it, `add_special_tokens` true by
default) or chat `messages` (rendered by the chat template exactly as /v1/chat/completions renders
them: the same parser and prompt builder, `add_generation_prompt` true by default, with
`continue_final_message`, `chat_template_kwargs`, `documents` and `tools`), and answers
`{"count", "max_model_len", "tokens", "token_strs"}` (`token_strs`, the vocabulary's pieces, with
`return_token_strs: true`; else null). Images and videos are refused: their placeholder tokens depend on
each item's size, known only once it is fetched and decoded (a chat completion's
`usage.prompt_tokens` counts them). `/detokenize` takes `{"tokens": [...]}` and answers `{"prompt"}`,
the ids decoded with their special tokens. Ids outside the vocabulary are a 400.
"""

from __future__ import annotations

from ..errors import ClientError
from .chat import ChatService
from .params import LABELS
from .schemas import _bool, model_name, parse_chat_request
from .text_checks import _unicode

PROMPT_KEYS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
# passed to the chat path's parser as they are
CHAT_KEYS = ("messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "documents",
             "tools", "tool_choice", "add_special_tokens", "model")
MESSAGES_KEYS = frozenset({*CHAT_KEYS, "return_token_strs", "mm_processor_kwargs"})


class TokenizeService:
    def __init__(self, chat: ChatService):
        self.chat = chat
        self.tok = chat.tokenizer
        self.vocab = len(self.tok)

    def _report_unknown(self, body: dict, known: frozenset) -> None:
        for name in body:
            if name not in known and name not in LABELS:
                self.chat.server.unknown.report(name)

    def tokenize(self, body) -> dict:
        if not isinstance(body, dict):
            raise ClientError("request body must be a JSON object")
        if body.get("prompt") is not None and body.get("messages") is not None:
            raise ClientError("give 'prompt' or 'messages', not both", param="messages")
        if body.get("messages") is not None:
            self._report_unknown(body, MESSAGES_KEYS)
            ids = self._messages(body)
        else:
            self._report_unknown(body, PROMPT_KEYS)
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise ClientError("'prompt' must be a string (or send 'messages')", param="prompt")
            model_name(body)
            ids = self.tok.encode(_unicode(prompt, "prompt"), add_special_tokens=_bool(body, "add_special_tokens", True))
        strs = self.tok.convert_ids_to_tokens(ids) if _bool(body, "return_token_strs", False) else None
        return {"count": len(ids), "max_model_len": self.chat.cfg.llm.max_model_len, "tokens": ids, "token_strs": strs}

    def _messages(self, body: dict) -> list[int]:
        """The prompt /v1/chat/completions would build for these messages, without media."""
        chat_body = {k: body[k] for k in CHAT_KEYS if k in body}
        chat_body["max_tokens"] = 1  # nothing is generated
        cfg = self.chat.cfg
        req = parse_chat_request(chat_body, cfg.llm.default_max_tokens, cfg.media.max_items_per_request,
                                 self.chat.tool_tags, self.chat.server)
        if req.media:
            raise ClientError("/tokenize counts text only: an image's or video's placeholder tokens depend on its "
                              "size, known once it is fetched and decoded (a chat completion's usage.prompt_tokens "
                              "counts them)", param=req.media[0].param, code="unsupported_content_type")
        if body.get("mm_processor_kwargs") is not None:
            raise ClientError("'mm_processor_kwargs' applies to media, which /tokenize does not take",
                              param="mm_processor_kwargs", code="unsupported_parameter")
        return self.chat.prompts.build(req.messages, [], req.tools.tools if req.tools else None,
                                       req.template).input_ids

    def detokenize(self, body) -> dict:
        if not isinstance(body, dict):
            raise ClientError("request body must be a JSON object")
        self._report_unknown(body, frozenset({"model", "tokens"}))
        model_name(body)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ClientError("'tokens' must be a list of token ids", param="tokens")
        bad = next((t for t in ids if not 0 <= t < self.vocab), None)
        if bad is not None:
            raise ClientError(f"token id {bad} is outside the vocabulary (0 to {self.vocab - 1})", param="tokens",
                              code="invalid_token_id")
        return {"prompt": self.tok.decode(ids, skip_special_tokens=False)}
