"""OpenAI chat-completions request parsing and response shapes.

Parsing is explicit rather than a pydantic union so that every client mistake yields a 400 whose
`param` points at the offending field (e.g. `messages[0].content[2].type`). Every parameter is
honoured, refused or reported as unknown (app/api/params.py); omitted sampling parameters take the
server's defaults (app/api/defaults.py: the checkpoint's generation config, or OpenAI's).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from ..config import MediaConfig
from ..errors import ClientError
from ..llm.grammar import grammar_for, grammar_for_structured
from ..llm.sampling import MAX_CHOICES, MAX_LOGPROBS, MAX_STOP_TOKEN_IDS, SamplingParams
from ..media.ref import MediaOptions, MediaRef
from .defaults import OPENAI, SamplingDefaults
from .params import LENIENT, UnknownParameters, refuse_what_would_be_ignored, unsupported
from .prompt import DEFAULT_TEMPLATE_OPTIONS, TemplateOptions
from .text_checks import _message_text, _unicode
from .tools import TOOL_NAME, ToolSpec, parse_tools, tool_grammar

MAX_STOP_CHARS = 1024  # per stop string: the check at each chunk costs up to its length (stream.StopChecker)

ROLES = ("system", "user", "assistant", "developer", "tool")
MAX_REQUEST_ID_CHARS = 256
MAX_FPS = 240.0  # mm_processor_kwargs.fps: frames stay within media.video_min_frames..video_max_frames too
# chat_template_kwargs names that are apply_chat_template's own arguments or the request's other parameters
RESERVED_TEMPLATE_KWARGS = frozenset({"chat_template", "tokenize", "conversation", "messages", "tools", "documents",
                                      "return_dict", "return_tensors", "padding", "truncation", "max_length",
                                      "return_assistant_tokens_mask", "tokenizer_kwargs"})


@dataclass(frozen=True)
class ServerContext:
    """What parsing needs to know of the server (ChatService builds it; the defaults suit direct callers)."""

    defaults: SamplingDefaults = OPENAI  # what omitted sampling parameters take
    unknown: UnknownParameters = LENIENT  # unknown names: logged and counted, or a 400
    template_variables: frozenset[str] | None = None  # what the chat template reads; None: not known
    media: MediaConfig = MediaConfig()  # the limits mm_processor_kwargs must stay within
    slices_images: bool = False  # MiniCPM-V: images are sliced, not resized within pixel bounds
    adds_special_tokens: bool = False  # the tokenizer would add tokens (a BOS) with add_special_tokens


DEFAULT_SERVER = ServerContext()


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
    template: TemplateOptions = DEFAULT_TEMPLATE_OPTIONS  # how the chat template renders it
    role: str = "assistant"  # the answer's: the last message's without a generation prompt (as vLLM)
    echo: str | None = None  # `echo`: the last message's text, which the answer starts with
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage on every chunk
    token_ids_as_text: bool = False  # `return_tokens_as_token_ids`: logprobs' tokens as "token_id:<id>"
    # where the Router's share of the time to first token went, in seconds (`ChatService.prepare`: `parse_s`,
    # `media_s`, `prompt_s`); the request's log line reports them with the replica's parts (`ChatService.record`)
    timing: dict = field(default_factory=dict)


def _num(body: dict, key: str, lo: float, hi: float, default, integer: bool = False):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or (integer and not isinstance(v, int)):
        raise ClientError(f"'{key}' must be {'an integer' if integer else 'a number'}", param=key)
    if not lo <= v <= hi:
        raise ClientError(f"'{key}' must be between {lo} and {hi}", param=key)
    return v


def _url_of(part: dict, key: str, param: str) -> str:
    v = part.get(key)
    url = v.get("url") if isinstance(v, dict) else v
    if not isinstance(url, str) or not url:
        raise ClientError(f"'{key}.url' must be a non-empty string", param=f"{param}.{key}.url")
    return _unicode(url, f"{param}.{key}.url")


def _bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ClientError(f"'{key}' must be a boolean", param=key)
    return v


def _json_text(v, param: str, depth: int = 32):
    """A JSON value a chat template renders (chat_template_kwargs, documents): its strings valid Unicode,
    its nesting bounded."""
    if depth < 0:
        raise ClientError(f"{param} is nested too deeply", param=param)
    if isinstance(v, str):
        _unicode(v, param)
    elif isinstance(v, dict):
        for k, x in v.items():
            _unicode(k, param)
            _json_text(x, param, depth - 1)
    elif isinstance(v, list):
        for x in v:
            _json_text(x, param, depth - 1)
    return v


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


def parse_chat_request(body, default_max_tokens: int, max_items: int, tool_tags: bool = False,
                       server: ServerContext = DEFAULT_SERVER) -> ChatRequest:
    """`tool_tags`: the tokenizer has `<tool_call>` and `</tool_call>` as tokens of their own (forced
    tool calls' grammar names them: app/api/tools.py). `server`: its sampling defaults, unknown-parameter
    policy, chat template and media limits."""
    if not isinstance(body, dict):
        raise ClientError("request body must be a JSON object")
    server.unknown.check(body)
    refuse_what_would_be_ignored(body)
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
    params = sampling_params(body, max_tokens, server.defaults.default_max_tokens(default_max_tokens), server)
    params.logprobs = _logprobs(body)
    params.grammar = structured_grammar(body)
    tools = parse_tools(body)
    if tools is not None and tools.forced:  # the calls are generated under a grammar
        if params.grammar is not None:
            raise ClientError("a forced 'tool_choice' cannot be combined with 'response_format' or "
                              "'structured_outputs'", param="tool_choice", code="invalid_tool_choice")
        params.grammar = tool_grammar(tools, tool_tags)
    stream, include_usage, continuous_usage = stream_flags(body, server)
    model = model_name(body)
    media_options = _mm_processor_kwargs(body, {r.kind for r in media}, server)
    if media_options is not None:
        for r in media:
            r.options = media_options
    if _bool(body, "add_special_tokens", False) and server.adds_special_tokens:
        raise unsupported("add_special_tokens", "the chat template writes the prompt's special tokens; this "
                          "tokenizer's own (a BOS) are not added")
    template = _template_options(body, server)
    role = "assistant" if template.add_generation_prompt else messages[-1]["role"]
    echo = _echo_text(messages[-1]) if _bool(body, "echo", False) and messages[-1]["role"] == role else None
    req = ChatRequest(messages, media, params, stream, include_usage, model, tools,
                      template=template, role=role, echo=echo, continuous_usage=continuous_usage,
                      token_ids_as_text=_bool(body, "return_tokens_as_token_ids", False))
    request_id = client_request_id(body)
    if request_id is not None:  # as vLLM: the answer's id
        req.id = f"chatcmpl-{request_id}"
    return req


def sampling_params(body: dict, max_tokens, default_max_tokens: int, server: ServerContext = DEFAULT_SERVER
                    ) -> SamplingParams:
    """The sampling parameters the generating endpoints share (chat and text completions): `max_tokens`
    as the request gives it (None: `default_max_tokens`), the others read from `body`, omitted ones
    taking the server's defaults. Log-probabilities and structured output are each endpoint's own."""
    d = server.defaults
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
    min_tokens = _num(body, "min_tokens", 0, 1 << 20, 0, integer=True)
    if min_tokens > max_tokens:  # as vLLM
        raise ClientError(f"'min_tokens' ({min_tokens}) must not exceed 'max_tokens' ({max_tokens})", param="min_tokens")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_num(body, "temperature", 0, 2, d["temperature"]),
        top_p=_num(body, "top_p", 0, 1, d["top_p"]),
        top_k=_top_k(body, d["top_k"]),
        min_p=_num(body, "min_p", 0, 1, d["min_p"]),
        repetition_penalty=_num(body, "repetition_penalty", 0, 100, d["repetition_penalty"]),
        frequency_penalty=_num(body, "frequency_penalty", -2, 2, 0.0),
        presence_penalty=_num(body, "presence_penalty", -2, 2, 0.0),
        seed=_num(body, "seed", -(1 << 63), (1 << 63) - 1, None, integer=True),
        stop=stop or [],
        n=_num(body, "n", 1, MAX_CHOICES, 1, integer=True),
        min_tokens=min_tokens,
        stop_token_ids=_stop_token_ids(body),
        ignore_eos=_bool(body, "ignore_eos", False),  # as vLLM: benchmarks generate max_tokens
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False),
    )
    # a fast tokenizer (every supported checkpoint's) joins special tokens' text as it is either way, as
    # vLLM's fast detokenizer does: both values give vLLM's text
    _bool(body, "spaces_between_special_tokens", True)
    if params.top_p == 0:
        raise ClientError("'top_p' must be greater than 0", param="top_p")
    if params.repetition_penalty == 0:
        raise ClientError("'repetition_penalty' must be greater than 0", param="repetition_penalty")
    best_of = body.get("best_of")
    if best_of is not None and best_of != params.n:
        raise unsupported("best_of", "no best-of-n selection (send n)")
    return params


def stream_flags(body: dict, server: ServerContext = DEFAULT_SERVER) -> tuple[bool, bool, bool]:
    """(`stream`, `stream_options.include_usage`, vLLM's `stream_options.continuous_usage_stats`)."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ClientError("'stream' must be a boolean", param="stream")
    opts = body.get("stream_options")
    opts = {} if opts is None else opts
    if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
        raise ClientError("'stream_options' must be an object with a boolean 'include_usage'", param="stream_options")
    if opts and not stream:  # as OpenAI answers
        raise ClientError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    _stream_options(opts, server.unknown)
    return stream, bool(opts.get("include_usage")), opts.get("continuous_usage_stats") is True


def model_name(body: dict) -> str | None:
    """The request's `model` (any name: one model is served), checked."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ClientError("'model' must be a string", param="model")
    if model is not None:
        _unicode(model, "model")
    return model


def with_header_request_id(body, header: str | None):
    """The body with an `X-Request-Id` header's value as its `request_id` unless it has one: the header
    names the request (the answer's id, the log line's), as in vLLM's server. vLLM lets the header win
    over the body; here the body does, because Ray Serve's HTTP proxy adds an `X-Request-Id` of its own to
    every request it forwards, which would otherwise replace every client's `request_id`. A header that
    could not be an id (empty, longer than MAX_REQUEST_ID_CHARS) is ignored: the client asked for nothing
    the body would be refused for. A body that is not an object is left for the parser to refuse."""
    if (not header or len(header) > MAX_REQUEST_ID_CHARS or not isinstance(body, dict)
            or body.get("request_id") is not None):
        return body
    return {**body, "request_id": header}


def client_request_id(body: dict) -> str | None:
    """vLLM's `request_id`, which the answer's id is made of, checked."""
    request_id = body.get("request_id")
    if request_id is None:
        return None
    if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
        raise ClientError(f"'request_id' must be a string of 1 to {MAX_REQUEST_ID_CHARS} characters",
                          param="request_id")
    return _unicode(request_id, "request_id")


def _top_k(body: dict, default: int) -> int:
    """vLLM's top_k: -1 and 0 are off (0 here)."""
    k = _num(body, "top_k", -1, 1 << 20, default, integer=True)
    return 0 if k == -1 else k


def _stop_token_ids(body: dict) -> list[int]:
    ids = body.get("stop_token_ids")
    if ids is None:
        return []
    if (not isinstance(ids, list) or len(ids) > MAX_STOP_TOKEN_IDS
            or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1 << 31 for i in ids)):
        raise ClientError(f"'stop_token_ids' must be a list of at most {MAX_STOP_TOKEN_IDS} token ids (integers >= 0)",
                          param="stop_token_ids")
    return list(ids)


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_grammar(body: dict) -> str | None:
    """The grammar of OpenAI's response_format, vLLM's structured_outputs, or vLLM's older guided_*
    parameters (the same as structured_outputs' keys); at most one of them (app/llm/grammar.py)."""
    grammar = grammar_for(body.get("response_format"))
    spec = body.get("structured_outputs")
    guided = {k: body[k] for k in _GUIDED if body.get(k) is not None}
    if guided:
        if spec is not None or len(guided) > 1:
            name = next(iter(guided))
            raise ClientError(f"give one of 'structured_outputs', {', '.join(map(repr, _GUIDED))}", param=name,
                              code="invalid_structured_outputs")
        name, value = next(iter(guided.items()))
        if name == "guided_json" and isinstance(value, str):  # vLLM takes the schema as JSON text too
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ClientError(f"'guided_json' is not JSON: {e}", param=name, code="invalid_structured_outputs") from None
        spec = {_GUIDED[name]: value}
    structured = grammar_for_structured(spec)
    if structured is not None:
        if grammar is not None:
            raise ClientError("give 'response_format' or 'structured_outputs', not both", param="structured_outputs",
                              code="invalid_structured_outputs")
        grammar = structured
    return grammar


def _stream_options(opts: dict, unknown: UnknownParameters) -> None:
    """stream_options beyond include_usage: vLLM's continuous_usage_stats (usage on every chunk, as
    GuideLLM asks by default) is honoured; OpenAI's include_obfuscation is refused when it asks for
    something; other names are unknown ones."""
    for key, value in opts.items():
        if key == "include_usage":
            continue
        if key == "continuous_usage_stats":
            if value is not None and not isinstance(value, bool):
                raise ClientError("'stream_options.continuous_usage_stats' must be a boolean",
                                  param="stream_options.continuous_usage_stats")
        elif key == "include_obfuscation":
            if value not in (None, False):
                raise unsupported(f"stream_options.{key}", "chunks carry no obfuscation")
        else:
            unknown.report(f"stream_options.{key}")


def _template_options(body: dict, server: ServerContext) -> TemplateOptions:
    """add_generation_prompt, continue_final_message, chat_template_kwargs (the names the template reads;
    the others are unknown ones) and documents, as vLLM takes them."""
    kwargs = body.get("chat_template_kwargs")
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, dict):
        raise ClientError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise ClientError(f"'chat_template_kwargs' may not set {', '.join(reserved)} (the request's own parameters "
                          "or the template's)", param="chat_template_kwargs", code="invalid_chat_template_kwargs")
    _json_text(kwargs, "chat_template_kwargs")
    # as vLLM, the kwargs may set these two as well, over the request's own
    kwargs = dict(kwargs)
    flags = {k: body.get(k) for k in ("add_generation_prompt", "continue_final_message")}
    flags |= {k: kwargs.pop(k) for k in ("add_generation_prompt", "continue_final_message") if k in kwargs}
    add = _bool(flags, "add_generation_prompt", True)
    cont = _bool(flags, "continue_final_message", False)
    if add and cont:  # as vLLM
        raise ClientError("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                          param="continue_final_message")
    passed = {}
    for name, value in kwargs.items():
        if server.template_variables is None or name in server.template_variables:
            passed[name] = value
        else:
            server.unknown.report(f"chat_template_kwargs.{name}", "chat template variable")
    documents = body.get("documents")
    if documents is not None:
        if not isinstance(documents, list) or not all(isinstance(x, dict) for x in documents):
            raise ClientError("'documents' must be a list of objects", param="documents")
        for i, doc in enumerate(documents):
            for k, v in doc.items():
                if not isinstance(v, str):
                    raise ClientError(f"documents[{i}].{k} must be a string", param="documents")
                _message_text(v, f"documents[{i}].{k}")
                _unicode(k, "documents")
    if not passed and documents is None and add and not cont:
        return DEFAULT_TEMPLATE_OPTIONS
    return TemplateOptions(add, cont, passed, documents)


def _echo_text(message: dict) -> str:
    """The text `echo` repeats: a message's string, or its text parts joined by newlines (as vLLM)."""
    content = message["content"]
    if isinstance(content, str):
        return content
    return "\n".join(p["text"] for p in content if p["type"] == "text")


_MM_KEYS = ("min_pixels", "max_pixels", "fps")


def _mm_processor_kwargs(body: dict, kinds: set[str], server: ServerContext) -> MediaOptions | None:
    """vLLM's per-request preprocessing settings for Qwen models: `min_pixels` and `max_pixels` (the
    smart-resize bounds of images and of each video frame) and `fps` (video frames sampled per second),
    each within this server's limits for the request's media (a 400 naming the limit); any other key is
    refused by name."""
    kw = body.get("mm_processor_kwargs")
    if kw is None:
        return None
    if not isinstance(kw, dict):
        raise ClientError("'mm_processor_kwargs' must be an object", param="mm_processor_kwargs")
    for key in kw:
        if key not in _MM_KEYS:
            raise unsupported(f"mm_processor_kwargs.{key}", f"this server takes {', '.join(_MM_KEYS)}")
    m = server.media
    got = {}
    for key in ("min_pixels", "max_pixels"):
        v = kw.get(key)
        if v is None:
            continue
        param = f"mm_processor_kwargs.{key}"
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ClientError(f"'{param}' must be a positive integer", param=param, code="invalid_mm_processor_kwargs")
        if server.slices_images:
            raise unsupported(param, "this model slices images (MiniCPM-V) instead of resizing them within pixel bounds")
        for kind, lo, hi in (("image", m.image_min_pixels, m.image_max_pixels),
                             ("video", m.video_min_pixels, m.video_max_pixels)):
            if kind not in kinds:
                continue
            if v < lo:
                raise ClientError(f"'{param}' ({v}) is below this server's media.{kind}_min_pixels ({lo})", param=param,
                                  code="invalid_mm_processor_kwargs")
            if v > hi:
                raise ClientError(f"'{param}' ({v}) exceeds this server's media.{kind}_max_pixels ({hi})", param=param,
                                  code="invalid_mm_processor_kwargs")
        got[key] = v
    if "min_pixels" in got and "max_pixels" in got and got["min_pixels"] > got["max_pixels"]:
        raise ClientError("'mm_processor_kwargs.min_pixels' must not exceed max_pixels",
                          param="mm_processor_kwargs.min_pixels", code="invalid_mm_processor_kwargs")
    for kind, lo, hi in (("image", m.image_min_pixels, m.image_max_pixels),
                         ("video", m.video_min_pixels, m.video_max_pixels)):
        if kind in kinds and got.get("min_pixels", lo) > got.get("max_pixels", hi):
            raise ClientError(f"'mm_processor_kwargs' would resize {kind}s to at least {got.get('min_pixels', lo)} "
                              f"and at most {got.get('max_pixels', hi)} pixels", param="mm_processor_kwargs",
                              code="invalid_mm_processor_kwargs")
    fps = kw.get("fps")
    if fps is not None:
        if isinstance(fps, bool) or not isinstance(fps, int | float) or not 0 < fps <= MAX_FPS:
            raise ClientError(f"'mm_processor_kwargs.fps' must be a number above 0 and at most {MAX_FPS:g} (the "
                              f"frames sampled stay within this server's media.video_min_frames ({m.video_min_frames}) "
                              f"and media.video_max_frames ({m.video_max_frames}))", param="mm_processor_kwargs.fps",
                              code="invalid_mm_processor_kwargs")
        got["fps"] = float(fps)
    return MediaOptions(**got) if got else None


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


def usage(prompt: int, completion: int, image_tokens: int, video_tokens: int, vision_embeddings: int,
          cached_tokens: int | None = None) -> dict:
    # placeholders counted in the prompt, and the embeddings the encoder produced for them; with
    # `enable_prompt_tokens_details`, OpenAI's cached prompt tokens (served by the prefix cache)
    details = {} if cached_tokens is None else {"cached_tokens": cached_tokens}
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": details | {"image_tokens": image_tokens, "video_tokens": video_tokens,
                                            "vision_embeddings": vision_embeddings},
    }


def choice(index: int, text: str | None, finish: str, logprobs: list | None = None,
           tool_calls: list[dict] | None = None, role: str = "assistant") -> dict:
    """One of a chat.completion's choices. `logprobs`: OpenAI's `logprobs.content` entries
    (app/api/logprobs.py), for requests that asked; `tool_calls`: the calls the answer made."""
    message = {"role": role, "content": text} | ({"tool_calls": tool_calls} if tool_calls else {})
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
