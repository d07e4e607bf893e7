"""OpenAI's Responses API, `POST /v1/responses`, over the chat path.

A request is translated into a chat-completions request and runs as one (`ChatService.prepare`,
`complete`, `open_stream`; `input` becomes `messages`, `instructions` a first system message,
`text.format` `response_format`), so prompts, images, sampling, structured output, retries and metrics
are the chat path's own; an error names the Responses field it came from. Streamed answers end with
`response.completed` as vLLM's do, also when `incomplete` (`max_output_tokens` reached).

Refused with a 400 naming the field, since this server keeps no state and runs no tools: `store: true`,
`previous_response_id`, `conversation`, `background`, `tools` (served by /v1/chat/completions),
`input_file` and `input_audio` parts, and the others in REFUSED below.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ..errors import ClientError
from ..llm.sampling import SamplingParams
from . import fastjson
from .answer import DONE
from .chat import ChatService, unwrap_client_error
from .params import unsupported
from .schemas import ChatRequest

ROLES = ("user", "system", "developer", "assistant")
DETAILS = (None, "auto", "low", "high")
# vLLM's sampling extensions, passed to the chat path as they are (its checks name them)
PASSED = ("top_k", "min_p", "repetition_penalty", "seed", "stop", "frequency_penalty", "presence_penalty",
          "min_tokens", "stop_token_ids", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
          "mm_processor_kwargs", "chat_template_kwargs")
HONOURED = frozenset({"input", "instructions", "max_output_tokens", "temperature", "top_p", "text", "stream",
                      "model", "parallel_tool_calls", *PASSED})
LABELS = frozenset({"user", "metadata", "service_tier", "safety_identifier", "prompt_cache_key"})


def _none(v) -> bool:
    return v is None


def _stream_options_off(v) -> bool:
    """OpenAI's `include_obfuscation: false`, and chat's `include_usage`, which clients written for chat
    completions send here too (AIPerf's `responses` endpoint type: `{"include_usage": true}`; vLLM ignores it):
    the Responses stream carries the usage in `response.completed` whatever it says."""
    if v is None:
        return True
    return isinstance(v, dict) and all((k == "include_obfuscation" and x is False)
                                       or (k == "include_usage" and isinstance(x, bool)) for k, x in v.items())


# name -> (whether a value asks for nothing, why the others are refused)
REFUSED = {
    "store": (lambda v: v is None or v is False, "responses are not stored (send 'store': false)"),
    "previous_response_id": (_none, "responses are not stored: send the whole conversation in 'input'"),
    "conversation": (_none, "no stored conversations: send the whole conversation in 'input'"),
    "background": (lambda v: v is None or v is False, "no background responses"),
    "tools": (lambda v: v is None or v == [], "no built-in tools here; function tools are served by "
              "/v1/chat/completions"),
    "tool_choice": (lambda v: v in (None, "none", "auto"), "no tools here; function tools are served by "
                    "/v1/chat/completions"),
    "max_tool_calls": (_none, "no tools here; function tools are served by /v1/chat/completions"),
    "include": (lambda v: v is None or v == [], "no additional output data"),
    "reasoning": (lambda v: v is None or v == {} or v == {"effort": None}, "no reasoning controls"),
    "prompt": (_none, "no stored prompt templates"),
    "truncation": (lambda v: v in (None, "disabled"), "inputs are never truncated"),
    "top_logprobs": (lambda v: v in (None, 0), "no log-probabilities in responses (/v1/chat/completions has them)"),
    "stream_options": (_stream_options_off, "only 'include_usage' (the usage is in "
                       "response.completed either way) and 'include_obfuscation': false are taken: events "
                       "carry no obfuscation"),
}
KNOWN = HONOURED | LABELS | frozenset(REFUSED)


@dataclass
class ResponseRequest:
    chat: ChatRequest  # the request as the chat path runs it
    gen: dict
    payload: list
    instructions: str | None = None
    max_output_tokens: int | None = None
    text_format: dict = field(default_factory=lambda: {"type": "text"})
    user: str | None = None
    metadata: dict | None = None
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    message_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def stream(self) -> bool:
        return self.chat.stream


class _Paths:
    """Chat parameter names -> the Responses fields they came from, for error messages."""

    def __init__(self):
        # per chat message, its Responses path, and whether that field is the message's text itself
        # (`instructions`, a string `input`) rather than a message
        self.messages: list[tuple[str, bool]] = []

    def rename(self, param: str | None) -> str | None:
        if param is None:
            return None
        m = re.match(r"messages\[(\d+)\]", param)
        if m and int(m.group(1)) < len(self.messages):
            path, text = self.messages[int(m.group(1))]
            rest = param[m.end():]
            return path + (rest.removeprefix(".content") if text else rest)
        if param == "messages":
            return "input"
        return {"max_tokens": "max_output_tokens", "response_format": "text.format"}.get(param, param)


def _text_format(text) -> tuple[dict | None, dict]:
    """(the chat path's `response_format`, the response's `text.format`) for `text`."""
    if text is None:
        return None, {"type": "text"}
    if not isinstance(text, dict):
        raise ClientError("'text' must be an object", param="text")
    if text.get("verbosity") not in (None, "medium"):
        raise unsupported("text.verbosity", "no verbosity control")
    fmt = text.get("format")
    if fmt is None:
        return None, {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_schema", "json_object"):
        raise ClientError("'text.format' must be an object whose 'type' is 'text', 'json_schema' or 'json_object'",
                          param="text.format")
    if fmt["type"] == "text":
        return None, {"type": "text"}
    if fmt["type"] == "json_object":
        return {"type": "json_object"}, {"type": "json_object"}
    if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema"), dict):
        raise ClientError("'text.format' of type 'json_schema' needs a 'name' (a string) and a 'schema' (an object)",
                          param="text.format")
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
    return {"type": "json_schema", "json_schema": spec}, {"type": "json_schema", **spec}


def _parts(content: list, p: str) -> list[dict]:
    """Responses content parts -> chat parts, one for one (so error paths map back by index)."""
    out = []
    for j, part in enumerate(content):
        pp = f"{p}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text"):  # output_text: an earlier answer sent back
            if not isinstance(part.get("text"), str):
                raise ClientError(f"{pp}.text must be a string", param=f"{pp}.text")
            out.append({"type": "text", "text": part["text"]})
        elif kind == "input_image":
            if part.get("file_id") is not None:
                raise unsupported(f"{pp}.file_id", "no file storage: send the image as 'image_url' (a URL or a "
                                  "data URL)")
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise ClientError(f"{pp}.image_url must be a URL or a data URL (a non-empty string)",
                                  param=f"{pp}.image_url")
            if part.get("detail") not in DETAILS:
                raise ClientError(f"{pp}.detail must be one of 'auto', 'low', 'high'", param=f"{pp}.detail")
            out.append({"type": "image_url", "image_url": {"url": url}})
        elif kind in ("input_file", "input_audio"):
            raise ClientError(f"{kind} parts are not supported ({pp}): this server takes input_text and input_image "
                              "parts", param=f"{pp}.type", code="unsupported_content_type")
        else:
            raise ClientError(f"unknown content part type {kind!r} at {pp}; expected input_text or input_image",
                              param=f"{pp}.type", code="unsupported_content_type")
    return out


def _messages(body: dict, paths: _Paths) -> list[dict]:
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ClientError("'instructions' must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
        paths.messages.append(("instructions", True))
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
        paths.messages.append(("input", True))
        return messages
    if not isinstance(given, list) or not given:
        raise ClientError("'input' must be a string or a non-empty list of messages", param="input")
    for i, item in enumerate(given):
        p = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind in ("function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output"):
            raise unsupported(f"{p}.type", f"no {kind} items: function tools are served by /v1/chat/completions")
        if kind != "message":
            raise ClientError(f"{p} must be a message ({{\"role\", \"content\"}}), not {kind!r}", param=f"{p}.type",
                              code="unsupported_parameter" if kind is not None else None)
        if item.get("role") not in ROLES:
            raise ClientError(f"{p}.role must be one of {', '.join(ROLES)}", param=f"{p}.role")
        content = item.get("content")
        if isinstance(content, list):
            content = _parts(content, p)
        elif not isinstance(content, str):
            raise ClientError(f"{p}.content must be a string or a list of parts", param=f"{p}.content")
        messages.append({"role": item["role"], "content": content})
        paths.messages.append((p, False))
    return messages


def _status(finish: str | None) -> tuple[str, dict | None]:
    if finish == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


class ResponseService:
    def __init__(self, chat: ChatService):
        self.chat = chat

    async def prepare(self, body) -> ResponseRequest:
        if not isinstance(body, dict):
            raise ClientError("request body must be a JSON object")
        for name in body:
            if name not in KNOWN:
                self.chat.server.unknown.report(name)
        for name, (off, why) in REFUSED.items():
            if name in body and not off(body[name]):
                raise unsupported(name, why)
        paths = _Paths()
        chat_body = {"messages": _messages(body, paths)}
        response_format, text_format = _text_format(body.get("text"))
        if response_format is not None:
            chat_body["response_format"] = response_format
        for name, to in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("stream", "stream"), ("model", "model"), *((k, k) for k in PASSED)):
            if body.get(name) is not None:
                chat_body[to] = body[name]
        if body.get("stream") is True:
            chat_body["stream_options"] = {"include_usage": True}
        parallel = body.get("parallel_tool_calls")
        if parallel is not None and not isinstance(parallel, bool):
            raise ClientError("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
        metadata = body.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise ClientError("'metadata' must be an object", param="metadata")
        try:
            chat, gen, payload = await self.chat.prepare(chat_body)
        except Exception as e:
            err = unwrap_client_error(e)
            if err is not None:
                err.param = paths.rename(err.param)
                err.message = err.message.replace("'max_tokens'", "'max_output_tokens'")
            raise
        req = ResponseRequest(chat, gen, payload, body.get("instructions"), body.get("max_output_tokens"),
                              text_format, body.get("user"), metadata)
        chat.id = req.id  # the chat path's logs and records name the response
        return req

    # ------------------------------------------------------------------ answers
    def _usage(self, usage: dict | None) -> dict | None:
        if usage is None:
            return None
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)  # the prefix cache's
        return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]}

    def _message(self, req: ResponseRequest, text: str | None, status: str) -> dict:
        content = [] if text is None else [_output_text(text)]
        return {"type": "message", "id": req.message_id, "status": status, "role": "assistant", "content": content}

    def _response(self, req: ResponseRequest, status: str, output: list, usage: dict | None = None,
                  incomplete: dict | None = None, error: dict | None = None) -> dict:
        params: SamplingParams = req.chat.params
        return {"id": req.id, "object": "response", "created_at": req.created, "status": status,
                "background": False, "error": error, "incomplete_details": incomplete,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "model": self.chat.cfg.model_name, "output": output, "parallel_tool_calls": True,
                "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "store": False,
                "temperature": params.temperature, "text": {"format": req.text_format}, "tool_choice": "auto",
                "tools": [], "top_p": params.top_p, "truncation": "disabled", "usage": self._usage(usage),
                "user": req.user, "metadata": req.metadata or {}}

    async def complete(self, req: ResponseRequest, t0: float | None = None) -> dict:
        answer = await self.chat.complete(req.chat, req.gen, req.payload, t0)
        choice = answer["choices"][0]
        status, incomplete = _status(choice["finish_reason"])
        return self._response(req, status, [self._message(req, choice["message"]["content"] or "", status)],
                              answer["usage"], incomplete)

    async def open_stream(self, req: ResponseRequest, t0: float | None = None) -> AsyncIterator[str]:
        """Waits for the first generated chunk (errors before it keep their HTTP status), then returns
        the Responses events."""
        return self._events(req, await self.chat.open_stream(req.chat, req.gen, req.payload, t0, events=True))

    async def _events(self, req: ResponseRequest, chat: AsyncIterator[str]) -> AsyncIterator[str]:
        """The chat stream's chunks, rewritten as the Responses event sequence."""
        seq = 0

        def event(kind: str, **fields) -> str:
            nonlocal seq
            seq += 1
            return f"event: {kind}\ndata: {fastjson.dumps({'type': kind, 'sequence_number': seq - 1, **fields})}\n\n"

        where = {"item_id": req.message_id, "output_index": 0, "content_index": 0}
        texts, finish, usage = [], None, None
        out = (event("response.created", response=self._response(req, "in_progress", []))
               + event("response.in_progress", response=self._response(req, "in_progress", []))
               + event("response.output_item.added", output_index=0, item=self._message(req, None, "in_progress"))
               + event("response.content_part.added", part=_output_text(""), **where))
        try:
            async for write in chat:
                for ev in write:
                    if ev == DONE:
                        continue
                    if "error" in ev:  # the chat stream's in-band error: the response fails here
                        err = ev["error"]
                        yield out + event("error", code=err.get("code"), message=err.get("message"),
                                          param=err.get("param")) + event(
                            "response.failed", response=self._response(
                                req, "failed", [self._message(req, "".join(texts), "incomplete")],
                                error={"code": err.get("code") or "server_error", "message": err.get("message")}))
                        return
                    if not ev["choices"]:
                        usage = ev["usage"]
                        continue
                    c = ev["choices"][0]
                    delta = c["delta"].get("content")
                    if delta:
                        texts.append(delta)
                        out += event("response.output_text.delta", delta=delta, logprobs=[], **where)
                    finish = c["finish_reason"] or finish
                if usage is not None:  # the chat stream's last chunk
                    text = "".join(texts)
                    status, incomplete = _status(finish)
                    message = self._message(req, text, status)
                    yield (out + event("response.output_text.done", text=text, logprobs=[], **where)
                           + event("response.content_part.done", part=_output_text(text), **where)
                           + event("response.output_item.done", output_index=0, item=message)
                           + event("response.completed", response=self._response(req, status, [message], usage,
                                                                                 incomplete)))
                    return
                if out:
                    yield out
                    out = ""
        finally:
            await chat.aclose()


def _output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
