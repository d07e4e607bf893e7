"""OpenAI's (legacy) text completions, `POST /v1/completions`, as vLLM serves them.

A prompt is text or token ids, generated from as it is: no chat template, and its tokens are exactly
the tokenizer's encoding of the text (its own special tokens, `add_special_tokens`, as vLLM). Several
prompts in one request each get `n` choices, indexed `prompt index x n + choice`, usage summed.

Each prompt runs as a chat request without media (`ChatService.text_generation`, `complete`,
`open_stream`): the same sampling parameters and defaults (schemas.sampling_params), retries,
streaming, cancellation and metrics; only the shapes differ (`text_completion` objects, legacy
log-probabilities). Refused: `suffix` (no fill-in-the-middle), `best_of` other than `n`, and `echo`
with `logprobs` (the prompt's log-probabilities, which the engine does not compute), with the chat
path's other refusals.
"""

from __future__ import annotations

import asyncio
import codecs
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from ..errors import ClientError
from ..llm.sampling import MAX_CHOICES, MAX_LOGPROBS
from .answer import DONE, sse
from .chat import ChatService
from .logprobs import TokenText
from .minicpmv_prompt import UNK, MiniCPMVPromptBuilder
from .params import LABELS, REFUSED, refuse_what_would_be_ignored, unsupported
from .prompt import VISION_MARKERS
from .schemas import (
    ChatRequest,
    _bool,
    client_request_id,
    model_name,
    sampling_params,
    stream_flags,
    structured_grammar,
)
from .text_checks import _unicode

DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's for completions (never above the server's default)

# what /v1/completions honours: OpenAI's parameters and vLLM's extensions to them; REFUSED and
# LABELS (app/api/params.py) as on the chat path; anything else is an unknown parameter
HONOURED = frozenset({
    "prompt", "model", "max_tokens", "temperature", "top_p", "frequency_penalty", "presence_penalty", "seed", "stop",
    "n", "stream", "stream_options", "logprobs", "echo", "suffix", "best_of",
    "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "include_stop_str_in_output", "add_special_tokens",
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "request_id", "return_tokens_as_token_ids",
})
KNOWN = HONOURED | LABELS | frozenset(REFUSED)


@dataclass
class CompletionRequest:
    prompts: list[list[int]]  # each prompt's token ids
    parts: list[ChatRequest]  # one per prompt, run as a chat request over those ids
    gens: list[dict]  # their generation requests
    n: int
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    logprobs: int | None = None  # the legacy `logprobs`: alternatives per token
    token_ids_as_text: bool = False
    skip_special_tokens: bool = True
    echo: list[str] | None = None  # per prompt, the text its choices start with
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))


def reserved_token_ids(tokenizer, prompts) -> frozenset[int]:
    """Token ids a text prompt may not hold: the vision markers (Qwen's, or MiniCPM-V's `<unk>`). The
    engine reads them as media placeholders that no media item backs."""
    names = (UNK,) if isinstance(prompts, MiniCPMVPromptBuilder) else VISION_MARKERS
    out = set()
    for name in names:
        i = tokenizer.convert_tokens_to_ids(name)
        if isinstance(i, int) and tokenizer.convert_ids_to_tokens(i) == name:
            out.add(i)
    return frozenset(out)


def _token_id(entry: dict) -> int:
    """The id of a log-probability entry written `token_id:<id>` (the chat path's
    `return_tokens_as_token_ids`, which the prompts' requests ask for)."""
    return int(entry["token"].rpartition(":")[2])


class LegacyLogprobs:
    """One choice's log-probabilities in the Completions API's legacy shape, from the chat path's
    entries: `text_offset` is each token's offset in the choice's text (its echoed prompt included),
    counted in characters of the UTF-8 text the tokens' bytes make; `skipped` tokens (special ones,
    whose text the answer leaves out) take no room."""

    def __init__(self, token_text: TokenText, as_ids: bool, offset: int = 0, skipped: frozenset[int] = frozenset()):
        self.token_text, self.as_ids, self.offset, self.skipped = token_text, as_ids, offset, skipped
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def _name(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self.token_text(token_id)[0]

    def add(self, entries: list[dict]) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            tid = _token_id(e)
            name = self._name(tid)
            top = {}
            for t in e.get("top_logprobs") or ():
                top.setdefault(self._name(_token_id(t)), t["logprob"])
            top.setdefault(name, e["logprob"])  # as vLLM: the chosen token is always among them
            out["tokens"].append(name)
            out["token_logprobs"].append(e["logprob"])
            out["top_logprobs"].append(top)
            if tid in self.skipped:
                out["text_offset"].append(self.offset)
                continue
            raw = bytes(self.token_text(tid)[1])
            # where the token's first character starts: after the text so far, or at the character its
            # bytes complete; bytes held back that it shows invalid are a replacement character before it
            held = self.decoder.getstate()[0]
            before, through = held.decode("utf-8", "replace"), (held + raw).decode("utf-8", "replace")
            out["text_offset"].append(self.offset + len(os.path.commonprefix([before, through])))
            self.offset += len(self.decoder.decode(raw))
        return out


async def _all(calls: list[Awaitable], abandon: Callable[[object], Awaitable] | None = None) -> list:
    """The results of `calls` run together; when one fails (or the caller is cancelled) the others
    are cancelled, `abandon` is awaited for each result already made, and the error raised."""
    if len(calls) == 1:
        return [await calls[0]]
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise t.exception()
        return [t.result() for t in tasks]
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if abandon is not None:
            for t in tasks:
                if not t.cancelled() and t.exception() is None:
                    await abandon(t.result())
        raise


async def _abandon_stream(stream: AsyncIterator[str]) -> None:
    """Close an opened chat stream nobody will read: started and closed, its own cleanup stops the
    generation and records the request."""
    try:
        await anext(stream)
    except Exception:  # noqa: BLE001 - its error is not this request's any more
        pass
    await stream.aclose()


async def _merge(streams: list[AsyncIterator[str]]) -> AsyncIterator[tuple[int, str]]:
    """(stream index, write) from several streams as they come. Closed early, it cancels the streams
    still running (their own cleanup stops their generations)."""
    if len(streams) == 1:
        try:
            async for w in streams[0]:
                yield 0, w
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[str]) -> None:
        try:
            async for w in stream:
                await queue.put((i, w, None))
        except Exception as e:  # noqa: BLE001 - passed on to the reader
            await queue.put((i, None, e))
            return
        await queue.put((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            i, w, e = await queue.get()
            if e is not None:
                raise e
            if w is None:
                live -= 1
                continue
            yield i, w
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class CompletionService:
    def __init__(self, chat: ChatService):
        self.chat = chat
        self.tok = chat.tokenizer
        self.vocab = len(self.tok)
        self.reserved = reserved_token_ids(self.tok, chat.prompts)
        decoder = getattr(self.tok, "added_tokens_decoder", None) or {}
        self.special = frozenset(i for i, t in decoder.items() if getattr(t, "special", False))

    # ------------------------------------------------------------------ parsing
    def _prompt_ids(self, body: dict) -> tuple[list[list[int]], list[str | None]]:
        """Each prompt's token ids, and its text where it came as text."""
        prompt = body.get("prompt")
        add_special = _bool(body, "add_special_tokens", True)

        def ids_of(v, param: str) -> list[int]:
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab for t in v):
                raise ClientError(f"{param} must hold token ids from 0 to {self.vocab - 1}", param=param,
                                  code="invalid_prompt")
            return list(v)

        if isinstance(prompt, list) and len(prompt) > MAX_CHOICES and not all(isinstance(p, int) for p in prompt):
            raise ClientError(f"at most {MAX_CHOICES} prompts per request", param="prompt")
        if isinstance(prompt, str):
            texts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            texts = list(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return [ids_of(prompt, "prompt")], [None]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
            return [ids_of(p, f"prompt[{i}]") for i, p in enumerate(prompt)], [None] * len(prompt)
        else:
            raise ClientError("'prompt' must be a string, a non-empty list of strings, a list of token ids or a "
                              "list of lists of token ids", param="prompt")
        ids = []
        for i, text in enumerate(texts):
            param = "prompt" if isinstance(prompt, str) else f"prompt[{i}]"
            ids.append(self.tok.encode(_unicode(text, param), add_special_tokens=add_special))
        return ids, texts

    async def prepare(self, body) -> CompletionRequest:
        if not isinstance(body, dict):
            raise ClientError("request body must be a JSON object")
        server = self.chat.server
        for name in body:
            if name not in KNOWN:
                server.unknown.report(name)
        refuse_what_would_be_ignored(body)
        if body.get("suffix") not in (None, ""):
            raise unsupported("suffix", "no insertion (fill-in-the-middle) completions")
        prompts, texts = self._prompt_ids(body)
        params = sampling_params(body, body.get("max_tokens"),
                                 min(DEFAULT_MAX_TOKENS, server.defaults.default_max_tokens(
                                     self.chat.cfg.llm.default_max_tokens)), server)
        if len(prompts) * params.n > MAX_CHOICES:
            raise ClientError(f"{len(prompts)} prompts x n={params.n} exceed the {MAX_CHOICES} choices a request "
                              "may ask for", param="prompt")
        logprobs = body.get("logprobs")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= MAX_LOGPROBS):
            raise ClientError(f"'logprobs' must be an integer from 0 to {MAX_LOGPROBS}", param="logprobs")
        params.logprobs = logprobs
        params.grammar = structured_grammar(body)
        echo = _bool(body, "echo", False)
        if echo and logprobs is not None:
            raise unsupported("echo", "'echo' with 'logprobs' asks for the prompt's log-probabilities, which this "
                              "server does not compute; send 'echo' or 'logprobs', not both")
        stream, include_usage, continuous = stream_flags(body, server)
        model = model_name(body)
        req = CompletionRequest(prompts, [], [], params.n, stream, include_usage, continuous, logprobs,
                                _bool(body, "return_tokens_as_token_ids", False), params.skip_special_tokens)
        request_id = client_request_id(body)
        if request_id is not None:  # as vLLM: the answer's id
            req.id = f"cmpl-{request_id}"
        for i, ids in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if not ids:
                raise ClientError(f"{param} has no tokens", param=param, code="invalid_prompt")
            if self.reserved and not self.reserved.isdisjoint(ids):
                raise ClientError(f"{param} holds a reserved vision marker token; send media to /v1/chat/completions "
                                  "or /v1/responses", param=param, code="reserved_token")
            req.gens.append(self.chat.text_generation(ids, params, param))
            # logprobs' tokens come back as ids (return_tokens_as_token_ids) and are written here
            req.parts.append(ChatRequest([], [], params, stream, stream, model, id=req.id, created=req.created,
                                         continuous_usage=continuous, token_ids_as_text=True))
        if echo:
            req.echo = [t if t is not None else self.tok.decode(ids, skip_special_tokens=False)
                        for t, ids in zip(texts, prompts)]
        return req

    # ------------------------------------------------------------------ answers
    def _legacy(self, req: CompletionRequest, prompt: int) -> LegacyLogprobs | None:
        if req.logprobs is None:
            return None
        return LegacyLogprobs(self.chat.token_text, req.token_ids_as_text, len(req.echo[prompt]) if req.echo else 0,
                              self.special if req.skip_special_tokens else frozenset())

    async def complete(self, req: CompletionRequest, t0: float | None = None) -> dict:
        answers = await _all([self.chat.complete(part, gen, [], t0) for part, gen in zip(req.parts, req.gens)])
        choices, prompt_tokens, completion_tokens, cached = [], 0, 0, None
        for i, answer in enumerate(answers):
            for c in answer["choices"]:
                lp = self._legacy(req, i)
                if lp is not None:
                    lp = lp.add((c.get("logprobs") or {}).get("content") or [])
                text = (req.echo[i] if req.echo else "") + (c["message"]["content"] or "")
                choices.append({"index": i * req.n + c["index"], "text": text, "logprobs": lp,
                                "finish_reason": c["finish_reason"]})
            prompt_tokens += answer["usage"]["prompt_tokens"]
            completion_tokens += answer["usage"]["completion_tokens"]
            cached = _add_cached(cached, answer["usage"])
        return {"id": req.id, "object": "text_completion", "created": req.created, "model": self.chat.cfg.model_name,
                "choices": choices, "usage": _usage(prompt_tokens, completion_tokens, cached)}

    async def open_stream(self, req: CompletionRequest, t0: float | None = None) -> AsyncIterator[str]:
        """Waits for every prompt's first chunk (errors before them keep their HTTP status), then returns
        the server-sent events."""
        t0 = time.perf_counter() if t0 is None else t0
        streams = await _all([self.chat.open_stream(part, gen, [], t0, events=True)
                              for part, gen in zip(req.parts, req.gens)],
                             abandon=_abandon_stream)
        return self._sse(req, streams)

    def _chunk(self, req: CompletionRequest, index: int, text: str, logprobs: dict | None = None,
               finish: str | None = None, usage: dict | None = None) -> str:
        out = {"id": req.id, "object": "text_completion", "created": req.created, "model": self.chat.cfg.model_name,
               "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
        if usage is not None or req.include_usage:  # as OpenAI: null on every chunk but the usage one
            out["usage"] = usage
        return sse([out])

    async def _sse(self, req: CompletionRequest, streams: list[AsyncIterator[str]]) -> AsyncIterator[str]:
        """The prompts' chat streams, rewritten as `text_completion` chunks and merged; one usage chunk
        (with `include_usage`) and `[DONE]` after the last prompt's. An error event of any prompt ends
        the whole stream (the others are stopped)."""
        n = len(req.prompts)
        legacy = [self._legacy(req, k // req.n) for k in range(n * req.n)]
        prompt_tokens = sum(len(g["input_ids"]) for g in req.gens)
        generated = [0] * n  # continuous usage: each prompt's tokens so far
        finals: dict[int, dict] = {}
        merged = _merge(streams)
        try:
            async for i, write in merged:
                out = ""
                for ev in write:
                    if ev == DONE:
                        continue
                    if "error" in ev:  # the chat stream's in-band error: the request ends here
                        yield out + sse([ev, DONE])
                        return
                    if not ev["choices"]:  # the prompt's usage chunk: its last
                        finals[i] = ev["usage"]
                        continue
                    c = ev["choices"][0]
                    k, delta = i * req.n + c["index"], c["delta"]
                    if "role" in delta:  # a choice's first event: the echoed prompt goes first
                        if req.echo:
                            out += self._chunk(req, k, req.echo[i])
                        continue
                    lp = c.get("logprobs")
                    lp = legacy[k].add(lp["content"]) if legacy[k] is not None and lp else None
                    running = None
                    if req.continuous_usage:  # vLLM's: every chunk says the tokens streamed so far
                        if ev.get("usage"):
                            generated[i] = ev["usage"]["completion_tokens"]
                        running = _usage(prompt_tokens, sum(generated))
                    if delta.get("content") or lp or c["finish_reason"]:
                        out += self._chunk(req, k, delta.get("content") or "", lp, c["finish_reason"], running)
                if len(finals) == n:
                    if req.include_usage:
                        cached = None
                        for u in finals.values():
                            cached = _add_cached(cached, u)
                        usage = _usage(sum(u["prompt_tokens"] for u in finals.values()),
                                       sum(u["completion_tokens"] for u in finals.values()), cached)
                        chunk = {"id": req.id, "object": "text_completion", "created": req.created,
                                 "model": self.chat.cfg.model_name, "choices": [], "usage": usage}
                        out += sse([chunk])
                    yield out + sse([DONE])
                    return
                if out:
                    yield out
        finally:
            await merged.aclose()


def _usage(prompt: int, completion: int, cached: int | None = None) -> dict:
    """OpenAI's usage; `cached`: prompt tokens the prefix cache served (a whole answer's usage only)."""
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def _add_cached(total: int | None, chat_usage: dict) -> int | None:
    """`total` plus the prefix cache's prompt tokens in a chat usage, if it reports them
    (`enable_prompt_tokens_details`)."""
    n = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return total if n is None else (total or 0) + n
