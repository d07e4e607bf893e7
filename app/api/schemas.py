"""OpenAI chat-completions request parsing and response shapes.

Parsing is explicit rather than a pydantic union so that every client mistake yields a 400 whose
`param` points at the offending field (e.g. `messages[0].content[2].type`).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from ..errors import ClientError
from ..llm.grammar import grammar_for, grammar_for_structured
from ..llm.sampling import MAX_CHOICES, MAX_LOGPROBS, SamplingParams
from ..media.ref import MediaRef
from .prompt import VISION_MARKERS, has_vision_marker
from .tools import TOOL_NAME, ToolSpec, parse_tools, tool_grammar

MAX_STOP_CHARS = 1024  # per stop string: the check at each chunk costs up to its length (stream.StopChecker)

ROLES = ("system", "user", "assistant", "developer", "tool")


@dataclass
class ChatRequest:
    messages: list[dict]  # content parts normalised to {"type": "text"|"image"|"video", ...}
    media: list[MediaRef]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    model: str | None = None
    tools: ToolSpec | None = None  # tool calling (app/api/tools.py); None: no tools, or tool_choice "none"
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))


def _num(body: dict, key: str, lo: float, hi: float, default, integer: bool = False):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or (integer and not isinstance(v, int)):
        raise ClientError(f"'{key}' must be {'an integer' if integer else 'a number'}", param=key)
    if not lo <= v <= hi:
        raise ClientError(f"'{key}' must be between {lo} and {hi}", param=key)
    return v


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


def _url_of(part: dict, key: str, param: str) -> str:
    v = part.get(key)
    url = v.get("url") if isinstance(v, dict) else v
    if not isinstance(url, str) or not url:
        raise ClientError(f"'{key}.url' must be a non-empty string", param=f"{param}.{key}.url")
    return _unicode(url, f"{param}.{key}.url")


def _unsupported(param: str, what: str) -> ClientError:
    return ClientError(f"'{param}' is not supported by this server: {what}", param=param, code="unsupported_parameter")


def _refuse_what_would_be_ignored(body: dict) -> None:
    """OpenAI parameters that ask for a behaviour this server does not have (token biases, audio) are
    a 400 naming them, never silently dropped: an answer that ignored them would look like the
    model's own failure. Parameters that only label or route a request (`user`, `metadata`, `store`,
    `service_tier`) and their off values (`modalities: ["text"]`, empty lists and maps) are accepted."""
    if body.get("logit_bias"):
        raise _unsupported("logit_bias", "no per-token biases")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise _unsupported("modalities", "text output only")
    if body.get("audio") is not None:
        raise _unsupported("audio", "text output only")
    if body.get("prediction") is not None:
        raise _unsupported("prediction", "no predicted outputs")


def _history_calls(m: dict, p: str, role: str) -> dict:
    """An earlier assistant turn's `tool_calls` (OpenAI's shape, checked; the chat template renders
    them), or a tool result's `tool_call_id`; {} for other messages."""
    if role == "tool":
        call_id = m.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise ClientError(f"{p}.tool_call_id must be a string", param=f"{p}.tool_call_id")
        return {} if call_id is None else {"tool_call_id": call_id}
    calls = m.get("tool_calls")
    if calls is None or role != "assistant":
        if calls is not None:
            raise ClientError(f"{p}.tool_calls is only allowed in assistant messages", param=f"{p}.tool_calls")
        return {}
    if not isinstance(calls, list):
        raise ClientError(f"{p}.tool_calls must be a list", param=f"{p}.tool_calls")
    out = []
    for k, c in enumerate(calls):
        pc = f"{p}.tool_calls[{k}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if (not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not TOOL_NAME.fullmatch(fn["name"])
                or not isinstance(fn.get("arguments", ""), str | None) or not isinstance(c.get("id", ""), str)):
            raise ClientError(f"{pc} must be {{\"id\": ..., \"type\": \"function\", \"function\": {{\"name\": ..., "
                              "\"arguments\": a JSON string}}}} with a tool's name (1-64 letters, digits, '_', '-')",
                              param=pc)
        # templates write the arguments string into the JSON of the call: none is an empty object
        out.append({"id": c.get("id", ""), "type": "function",
                    "function": {"name": fn["name"],
                                 "arguments": _message_text(fn.get("arguments") or "{}", f"{pc}.function.arguments")}})
    return {"tool_calls": out} if out else {}


def parse_chat_request(body, default_max_tokens: int, max_items: int, tool_tags: bool = False) -> ChatRequest:
    """`tool_tags`: the tokenizer has `<tool_call>` and `</tool_call>` as tokens of their own (forced
    tool calls' grammar names them: app/api/tools.py)."""
    if not isinstance(body, dict):
        raise ClientError("request body must be a JSON object")
    _refuse_what_would_be_ignored(body)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ClientError("'messages' must be a non-empty list", param="messages")
    messages, media = [], []
    for i, m in enumerate(msgs):
        p = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ClientError(f"{p} must be an object with a role in {ROLES}", param=f"{p}.role")
        role = "system" if m["role"] == "developer" else m["role"]
        content = m.get("content")
        calls = _history_calls(m, p, role)
        if content is None or isinstance(content, str):
            messages.append({"role": role, "content": _message_text(content or "", f"{p}.content")} | calls)
            continue
        if not isinstance(content, list):
            raise ClientError(f"{p}.content must be a string or a list of parts", param=f"{p}.content")
        parts = []
        for j, part in enumerate(content):
            pp = f"{p}.content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise ClientError(f"{pp}.text must be a string", param=f"{pp}.text")
                parts.append({"type": "text", "text": _message_text(part["text"], f"{pp}.text")})
            elif kind in ("image_url", "video_url"):
                if role != "user":
                    raise ClientError(f"media parts are only allowed in user messages ({pp})", param=f"{pp}.type")
                media.append(MediaRef(kind.removesuffix("_url"), _url_of(part, kind, pp), f"{pp}.{kind}"))
                parts.append({"type": kind.removesuffix("_url")})
            else:
                raise ClientError(f"unknown content part type {kind!r} at {pp}; expected text, image_url or video_url",
                                  param=f"{pp}.type", code="unsupported_content_type")
        messages.append({"role": role, "content": parts} | calls)
    if len(media) > max_items:
        raise ClientError(f"{len(media)} media items exceed the limit of {max_items} per request", param="messages",
                          code="too_many_media_items")
    max_tokens = body.get("max_completion_tokens")  # clients may send the unset one as null
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    max_tokens = _num({"max_tokens": max_tokens}, "max_tokens", 1, 1 << 20, default_max_tokens, integer=True)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) for s in stop)):
        raise ClientError("'stop' must be a string or a list of at most 4 strings", param="stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop or []):  # each is matched against the text at every chunk
        raise ClientError(f"each 'stop' string must be at most {MAX_STOP_CHARS} characters", param="stop")
    for s in stop or []:
        _unicode(s, "stop")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_num(body, "temperature", 0, 2, 1.0),
        top_p=_num(body, "top_p", 0, 1, 1.0),
        top_k=_num(body, "top_k", 0, 1 << 20, 0, integer=True),
        frequency_penalty=_num(body, "frequency_penalty", -2, 2, 0.0),
        presence_penalty=_num(body, "presence_penalty", -2, 2, 0.0),
        seed=_num(body, "seed", -(1 << 63), (1 << 63) - 1, None, integer=True),
        stop=stop or [],
        n=_num(body, "n", 1, MAX_CHOICES, 1, integer=True),
    )
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None:  # extension (as vLLM): benchmarks generate max_tokens
        if not isinstance(ignore_eos, bool):
            raise ClientError("'ignore_eos' must be a boolean", param="ignore_eos")
        params.ignore_eos = ignore_eos
    if params.top_p == 0:
        raise ClientError("'top_p' must be greater than 0", param="top_p")
    params.logprobs = _logprobs(body)
    # structured output (app/llm/grammar.py): OpenAI's response_format, or vLLM's structured_outputs
    params.grammar = grammar_for(body.get("response_format"))
    structured = grammar_for_structured(body.get("structured_outputs"))
    if structured is not None:
        if params.grammar is not None:
            raise ClientError("give 'response_format' or 'structured_outputs', not both", param="structured_outputs",
                              code="invalid_structured_outputs")
        params.grammar = structured
    tools = parse_tools(body)
    if tools is not None and tools.forced:  # the calls are generated under a grammar
        if params.grammar is not None:
            raise ClientError("a forced 'tool_choice' cannot be combined with 'response_format' or "
                              "'structured_outputs'", param="tool_choice", code="invalid_tool_choice")
        params.grammar = tool_grammar(tools, tool_tags)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ClientError("'stream' must be a boolean", param="stream")
    opts = body.get("stream_options")
    opts = {} if opts is None else opts
    if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
        raise ClientError("'stream_options' must be an object with a boolean 'include_usage'", param="stream_options")
    if opts and not stream:  # as OpenAI answers
        raise ClientError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ClientError("'model' must be a string", param="model")
    if model is not None:
        _unicode(model, "model")
    return ChatRequest(messages, media, params, stream, bool(opts.get("include_usage")), model, tools)


def _logprobs(body: dict) -> int | None:
    """`logprobs` (a boolean) and `top_logprobs` (0-20, only with `logprobs: true`), as OpenAI's API
    takes them -> SamplingParams.logprobs: None, or the number of alternatives per token."""
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise ClientError("'logprobs' must be a boolean", param="logprobs")
    top = body.get("top_logprobs")
    if top is None:
        return 0 if wanted else None
    top = _num(body, "top_logprobs", 0, MAX_LOGPROBS, 0, integer=True)
    if not wanted:
        raise ClientError("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
    return top


def usage(prompt: int, completion: int, image_tokens: int, video_tokens: int, vision_embeddings: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        # placeholders counted in the prompt, and the embeddings the encoder produced for them
        "prompt_tokens_details": {"image_tokens": image_tokens, "video_tokens": video_tokens,
                                  "vision_embeddings": vision_embeddings},
    }


def choice(index: int, text: str | None, finish: str, logprobs: list | None = None,
           tool_calls: list[dict] | None = None) -> dict:
    """One of a chat.completion's choices. `logprobs`: OpenAI's `logprobs.content` entries
    (app/api/logprobs.py), for requests that asked; `tool_calls`: the calls the answer made."""
    message = {"role": "assistant", "content": text} | ({"tool_calls": tool_calls} if tool_calls else {})
    return {"index": index, "message": message, "finish_reason": finish,
            "logprobs": None if logprobs is None else {"content": logprobs}}


def completion_response(req: ChatRequest, model: str, choices: list[dict], usage_: dict) -> dict:
    return {"id": req.id, "object": "chat.completion", "created": req.created, "model": model,
            "choices": choices, "usage": usage_}


def stream_chunk(req: ChatRequest, model: str, delta: dict, finish: str | None = None, usage_: dict | None = None,
                 choices: bool = True, logprobs: list | None = None, index: int = 0) -> dict:
    """A chat.completion.chunk with one choice (`index`: which of the request's `n`), or with none
    (`choices=False`: the usage chunk)."""
    lp = None if logprobs is None else {"content": logprobs}
    out = {"id": req.id, "object": "chat.completion.chunk", "created": req.created, "model": model,
           "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": lp}] if choices else []}
    if usage_ is not None or req.include_usage:  # OpenAI: null on every chunk but the usage one
        out["usage"] = usage_
    return out
