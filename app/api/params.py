"""Every top-level parameter of a chat-completions request (OpenAI's and vLLM's extensions), and what
this server does with it. Nothing is silently dropped:

- HONOURED: parsed and applied (app/api/schemas.py, tools.py, app/llm/grammar.py);
- LABELS: accepted; they label or route a request (`user`, `metadata`, ...) and change no answer;
- REFUSED: a behaviour this server does not have; a 400 `unsupported_parameter` naming the parameter,
  unless the request gives its off value (null, an empty list, `"text"` only...), which asks for nothing;
- anything else is unknown: logged once per name and counted (`vlm_unknown_parameters_total`), or a
  400 `unsupported_parameter` with `reject_unknown_parameters`. Names a chat template does not read
  (`chat_template_kwargs.<name>`) count as unknown the same way.

docs/guides/vllm-compatibility.md lists them for users.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ..errors import ClientError

log = logging.getLogger(__name__)

HONOURED = frozenset({
    # OpenAI
    "messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "frequency_penalty",
    "presence_penalty", "seed", "stop", "n", "stream", "stream_options", "logprobs", "top_logprobs",
    "response_format", "tools", "tool_choice", "parallel_tool_calls",
    # vLLM's sampling extensions
    "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "include_stop_str_in_output",
    # vLLM's prompt and output extensions
    "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "add_special_tokens", "documents",
    "mm_processor_kwargs", "echo", "request_id", "return_tokens_as_token_ids",
    # vLLM's structured output (and its older `guided_*` names)
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
})

LABELS = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"})


def _none(v) -> bool:
    return v is None


def _empty(v) -> bool:
    return v is None or v == [] or v == {}


def _false(v) -> bool:
    return v is None or v is False


# name -> (whether a value asks for nothing, why the rest are refused)
REFUSED: dict[str, tuple[Callable[[object], bool], str]] = {
    "logit_bias": (_empty, "no per-token biases"),
    "modalities": (lambda v: v is None or v == ["text"], "text output only"),
    "audio": (_none, "text output only"),
    "prediction": (_none, "no predicted outputs"),
    "functions": (_empty, "send 'tools' and 'tool_choice'"),
    "function_call": (lambda v: v is None or v == "none", "send 'tools' and 'tool_choice'"),
    "reasoning_effort": (_none, "no reasoning controls (a chat template's own switches go in chat_template_kwargs)"),
    "verbosity": (_none, "no verbosity control"),
    "web_search_options": (_none, "no built-in tools"),
    "prompt_cache_retention": (lambda v: v is None or v == "in_memory",
                               "prefixes are cached in memory only ('in_memory')"),
    "best_of": (None, "no best-of-n selection (send n)"),  # its off value is n itself: schemas.py
    "use_beam_search": (_false, "no beam search"),
    "length_penalty": (lambda v: v is None or v == 1 or v == 1.0, "no beam search (length_penalty is its)"),
    "priority": (lambda v: v is None or v == 0, "requests are served first come, first served"),
    "truncate_prompt_tokens": (_none, "prompts are never truncated"),
    "prompt_logprobs": (_none, "no prompt log-probabilities"),
    "logits_processors": (_empty, "no custom logits processors"),
    "allowed_token_ids": (_none, "no allowed-token lists"),
    "bad_words": (_empty, "no bad-word lists"),
    "chat_template": (_none, "the checkpoint's chat template renders every request"),
    "return_token_ids": (_false, "no token ids in answers"),
    "cache_salt": (_none, "no prefix-cache salts"),
    "kv_transfer_params": (_none, "no KV transfer"),
    "vllm_xargs": (_none, "no custom sampling extensions"),
    "include_reasoning": (lambda v: v is None or v is True,
                          "no reasoning parser: a model's reasoning text stays in the content"),
    "guided_decoding_backend": (_none, "one structured-output backend (llguidance)"),
    "guided_whitespace_pattern": (_none, "JSON is generated compact"),
    "structural_tag": (_none, "no structural tags"),
}

KNOWN = HONOURED | LABELS | frozenset(REFUSED)


def unsupported(param: str, what: str) -> ClientError:
    return ClientError(f"'{param}' is not supported by this server: {what}", param=param, code="unsupported_parameter")


def refuse_what_would_be_ignored(body: dict) -> None:
    """A 400 for the first REFUSED parameter that asks for something (`best_of` is checked with `n`)."""
    for name, (off, why) in REFUSED.items():
        if off is not None and name in body and not off(body[name]):
            raise unsupported(name, why)


MAX_LOGGED_NAMES = 1024  # distinct unknown names remembered (a client could send endless new ones)
MAX_NAME_CHARS = 64  # an unknown name as logged and counted


class UnknownParameters:
    """Unknown parameter names: each logged once (per process) and passed to `on_unknown` (a metric)
    every time, or, with `reject`, a 400 `unsupported_parameter` naming it."""

    def __init__(self, reject: bool = False, on_unknown: Callable[[str], None] | None = None):
        self.reject, self.on_unknown = reject, on_unknown
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def check(self, body: dict) -> None:
        for name in body:
            if name not in KNOWN:
                self.report(name)

    def report(self, name: str, what: str = "parameter") -> None:
        """`name` is not known (the caller drops it), or, rejecting, a 400."""
        if not isinstance(name, str):
            name = repr(name)
        if self.reject:
            raise ClientError(f"unknown {what} '{name[:200]}': this server does not support it", param=name[:200],
                              code="unsupported_parameter")
        short = name[:MAX_NAME_CHARS]
        with self._lock:
            first = short not in self._logged and len(self._logged) < MAX_LOGGED_NAMES
            if first:
                self._logged.add(short)
        if first:
            log.warning("requests carry the unknown %s %r: it is ignored (reject_unknown_parameters makes it a 400; "
                        "this is logged once per name)", what, short)
        if self.on_unknown is not None:
            self.on_unknown(short)


LENIENT = UnknownParameters()  # callers without a server's policy (tests, scripts): logged once, not counted
