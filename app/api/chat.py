"""One chat completion, end to end, independent of Ray.

parse -> fetch/decode/preprocess media -> prompt with exact placeholders ->
backend.stream(generation request, encoder payload) -> OpenAI JSON or server-sent events.
The media source decides where media is prepared (a worker pool in this process, or the
MediaPreprocessor deployment: app/media/remote.py); the backend decides how encoding and generation
run (Ray handles in production, app/serving/local_backend.py in one process).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from dataclasses import asdict
from typing import Protocol

from ..config import AppConfig
from ..errors import ClientError
from ..llm.sampling import SamplingParams
from ..media.pipeline import PreparedItem, to_encoder_payload
from ..media.preprocess import PatchSpec
from .answer import DONE, Answer, StreamedAnswer, sse
from .defaults import load_sampling_defaults
from .logprobs import TokenText
from .minicpmv_prompt import prompt_builder_for
from .params import UnknownParameters
from .prompt import IMAGE_TYPE, TEXT, VIDEO_TYPE, Prompt, template_variables
from .retry import (
    RetryPolicy,
    cancel_stream,
    collect,
    drain_later,
    first_chunk,
    is_replica_failure,
    replica_failed,
)
from .schemas import ChatRequest, ServerContext, parse_chat_request
from .tools import has_tag_tokens

log = logging.getLogger(__name__)
# True while a Router's own warm-up requests run (app/serving/warmup.py sets it around them): they are
# answered as any other, but not counted in metrics, here or in the LLM replicas (`warm_up` in the
# generation dict). A context variable, so no client can set it.
WARM_UP: ContextVar[bool] = ContextVar("vlm_warm_up", default=False)
# True for a request whose client asked for its time to first token's parts (the Router sets it for an
# `X-TTFT-Parts` header): a streamed answer then opens with an SSE comment carrying them, which clients
# skip as the SSE format says (benchmarks/serve.py reads it: benchmarks/ttft_tail.py).
TTFT_PARTS_ASKED: ContextVar[bool] = ContextVar("vlm_ttft_parts_asked", default=False)


def ask_ttft_parts(asked: bool) -> None:
    """Sets TTFT_PARTS_ASKED for the calling task (a function, so that a Serve deployment that uses it is
    pickled without the variable itself, which cannot be)."""
    TTFT_PARTS_ASKED.set(asked)


class MediaSource(Protocol):
    """app.media.pipeline.MediaPipeline (in this process) or app.media.remote.RemoteMedia (replicas)."""

    spec: PatchSpec

    async def prepare_all(self, refs: list) -> list[PreparedItem]:
        """The request's items in order; ClientError for bad media."""


class Backend(Protocol):
    def stream(self, gen_request: dict, encoder_payload: list) -> AsyncIterator[dict]:
        """Yields engine chunks (dicts of app.llm.engine.Chunk) for one request."""


def unwrap_client_error(e: BaseException) -> ClientError | None:
    """Ray wraps remote exceptions; find a ClientError inside, if any."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, ClientError):
            return e
        e = getattr(e, "cause", None) or e.__cause__
        seen += 1
    return None


class ChatService:
    def __init__(self, cfg: AppConfig, tokenizer, media: MediaSource, backend: Backend,
                 observer: Callable[[dict], None] | None = None, on_unknown: Callable[[str], None] | None = None,
                 checkpoint: str | None = None):
        """`observer(record)` receives one record per finished request (metrics); `on_unknown(name)`
        each unknown parameter name a request carries (a metric). `checkpoint`: the folder whose
        generation_config.json gives the sampling defaults (default: the tokenizer's)."""
        self.cfg, self.media, self.backend, self.observer = cfg, media, backend, observer
        self.tokenizer = tokenizer  # text completions and /tokenize use it as well (completions.py, tokenize.py)
        self.prompts = prompt_builder_for(tokenizer, media.spec)
        self.token_text = TokenText(tokenizer)  # log-probabilities' token texts, for requests that ask
        self.tool_tags = has_tag_tokens(tokenizer)  # forced tool calls name the tags as tokens
        self.merge = media.spec.merge
        self.retry = RetryPolicy.from_config(cfg.retry)  # replica failures before the first token
        self.defaults = load_sampling_defaults(checkpoint or getattr(tokenizer, "name_or_path", None),
                                               cfg.sampling_defaults)
        self.server = ServerContext(
            defaults=self.defaults, unknown=UnknownParameters(cfg.reject_unknown_parameters, on_unknown),
            template_variables=template_variables(tokenizer), media=cfg.media,
            slices_images=getattr(media.spec, "slicing", None) is not None,
            adds_special_tokens=_adds_special_tokens(tokenizer))

    def model_card(self) -> dict:
        """This server's model as `/v1/models` lists it, with the sampling defaults in force."""
        name = self.cfg.model_name
        return {"id": name, "object": "model", "owned_by": "vlm-serve", "created": 0, "root": name,
                "max_model_len": self.cfg.llm.max_model_len,
                "sampling_defaults": self.defaults.card(self.cfg.llm.default_max_tokens)}

    def record(self, *, id: str | None, status: int, e2e_s: float, items: int = 0, prompt_tokens: int = 0,
               completion_tokens: int = 0, ttft_s: float | None = None, retries: int = 0,
               parts: dict | None = None) -> None:
        """One INFO line per request, and the same record to the observer. `parts`: where the time to
        first token went (`ttft_parts`), on the line as `parts_ms=name:ms,...` (benchmarks/ttft_tail.py
        reads them to say what the slowest requests waited for)."""
        rec = {"id": id, "status": status, "items": items, "prompt_tokens": prompt_tokens,
               "completion_tokens": completion_tokens, "ttft_s": ttft_s, "e2e_s": e2e_s, "retries": retries,
               "parts": parts}
        log.info("request %s status=%d items=%d prompt_tokens=%d completion_tokens=%d ttft_ms=%s e2e_ms=%.1f "
                 "retries=%d%s", id or "-", status, items, prompt_tokens, completion_tokens,
                 "-" if ttft_s is None else f"{1e3 * ttft_s:.1f}", 1e3 * e2e_s, retries, parts_text(parts))
        if self.observer is not None and not WARM_UP.get():
            self.observer(rec)

    async def prepare(self, body) -> tuple[ChatRequest, dict, list]:
        t = time.perf_counter()
        req = parse_chat_request(body, self.cfg.llm.default_max_tokens, self.cfg.media.max_items_per_request,
                                 self.tool_tags, self.server)
        parsed = time.perf_counter()
        items = await self.media.prepare_all(req.media)
        prepared = time.perf_counter()
        frames = sum(it.frames(self.media.spec.temporal) for it in items)
        if frames > self.cfg.media.max_frames_per_request:
            raise ClientError(f"{frames} sampled video frames exceed the limit of {self.cfg.media.max_frames_per_request} "
                              "per request", param="messages", code="too_many_frames")
        prompt = self.prompts.build(req.messages, [it.slot(self.merge) for it in items],
                                    req.tools.tools if req.tools else None, req.template)
        self.check_length(len(prompt.input_ids), "messages")
        tower = [x for it in items for x in it.tower_inputs()]  # per tower item (MiniCPM-V: several per item)
        gen = _generation(prompt, req.params, tower, [s for it in items for s in it.tower_seconds()])
        req.timing = {"parse_s": parsed - t, "media_s": prepared - parsed, "prompt_s": time.perf_counter() - prepared}
        return req, gen, to_encoder_payload(items)

    def check_length(self, tokens: int, param: str) -> None:
        """A 400 for a prompt that leaves no room to generate within `llm.max_model_len`."""
        if tokens >= self.cfg.llm.max_model_len:
            raise ClientError(f"prompt of {tokens} tokens exceeds max_model_len {self.cfg.llm.max_model_len}",
                              param=param, code="context_length_exceeded")

    def text_generation(self, input_ids: list[int], params: SamplingParams, param: str = "prompt") -> dict:
        """The generation request of a text prompt given as token ids (text completions): what `prepare`
        makes for a chat prompt, without media."""
        self.check_length(len(input_ids), param)
        return _generation(Prompt(list(input_ids), [TEXT] * len(input_ids)), params, [], [])

    async def complete(self, req: ChatRequest, gen: dict, payload: list, t0: float | None = None) -> dict:
        t0 = time.perf_counter() if t0 is None else t0
        n = req.params.n
        called = time.perf_counter()
        chunks, first_at, retries = await collect(lambda: self.backend.stream(gen, payload), self.retry, n)
        answer = Answer(n, self.token_text if req.params.logprobs is not None else None, req.token_ids_as_text,
                        self.cfg.enable_prompt_tokens_details)
        for c in chunks:
            answer.add(c)
        prompt, completion = answer.tokens()
        timing = next((c["timing"] for c in chunks if c.get("timing")), None)
        self.record(id=req.id, status=200, e2e_s=time.perf_counter() - t0, items=len(req.media),
                    prompt_tokens=prompt, completion_tokens=completion, ttft_s=first_at - t0, retries=retries,
                    parts=ttft_parts(req, called - t0, timing))
        return answer.response(req, self.cfg.model_name, gen)

    async def open_stream(self, req: ChatRequest, gen: dict, payload: list,
                          t0: float | None = None, events: bool = False) -> AsyncIterator:
        """Waits for the first generated chunk, so that errors before it (overload, bad input) still
        get their HTTP status; then returns the server-sent-event stream: strings, one per write, or
        with `events` each write's list of event objects (answer.StreamedAnswer's; an error object;
        answer.DONE), which /v1/completions and /v1/responses rewrite in their own shapes."""
        t0 = time.perf_counter() if t0 is None else t0

        def start():
            return self.backend.stream(gen, payload)

        started, called, called_at = time.monotonic(), time.perf_counter(), time.time()  # the call's start, 3 clocks
        first, stream, retries = await first_chunk(start, self.retry)
        return self._sse(req, gen, first, stream, t0, time.perf_counter() - t0, len(req.media), retries,
                         (start, started), (lambda evs: evs) if events else sse,
                         ttft_parts(req, called - t0, first.get("timing"), (called_at, time.time())),
                         TTFT_PARTS_ASKED.get() and not events)

    async def _sse(self, req: ChatRequest, gen: dict, first: dict, rest: AsyncIterator[dict], t0: float,
                   ttft: float, items: int, retries: int,
                   restart: tuple[Callable[[], AsyncIterator[dict]], float],
                   write: Callable[[list], object] = sse, parts: dict | None = None,
                   parts_comment: bool = False) -> AsyncIterator:
        """Server-sent events; errors after the first byte become an error event, then [DONE].

        The first token may have no text yet (the detokenizer holds back part of a character); until
        some text or the finish has gone out the client has seen only the role, so a replica that
        fails then is retried with `restart` (the call, and the request's start on the retry policy's
        clock: the policy's bounds cover all of the request's attempts), as before the first chunk.

        Events that are ready together go out as one write: the role with the first text, and the
        finish, the usage and [DONE] at the end. Every write is one message through Ray Serve's proxy
        and one HTTP chunk, each a fixed cost in the proxy's and this replica's single Python thread
        (a 16-token answer reached a client in 8-9 HTTP chunks, now 4; benchmarks/RESULTS.md); clients
        parse the same events either way. [DONE]
        goes out with the last chunk, before the stream's end has come back from the replica; the
        stream is still read to its end (Ray Serve counts the call as running until then).
        `parts_comment`: the first write opens with an SSE comment of the time to first token and its
        `parts` (`parts_comment_text`)."""
        model = self.cfg.model_name

        async def chunks():
            nonlocal rest, retries
            c, shown = first, False
            while True:
                if c is None:
                    try:
                        c = await anext(rest)
                    except StopAsyncIteration:
                        return
                    except Exception as e:
                        if shown or not is_replica_failure(e):
                            raise
                        start, started = restart
                        log.warning("request %s: replica failed before any text went out", req.id)
                        try:  # replica_failed when the attempts or the time are spent
                            c, rest, retries = await first_chunk(start, self.retry, retries + 1, started, e)
                        except StopAsyncIteration:  # a stream that ended without a chunk
                            retries += 1
                            raise replica_failed(retries) from None
                        except ClientError as given_up:
                            retries = getattr(given_up, "retries", retries)
                            raise
                        continue
                # anything sent counts: a chunk of logprobs without text yet (part of a character) goes out too,
                # and a retry after it would send the new attempt's logprobs beside the old ones
                shown = shown or bool(c["text"]) or bool(c["finish_reason"]) or bool(c.get("logprobs"))
                yield c
                c = None

        answer = StreamedAnswer(req, model, gen, self.token_text, self.cfg.enable_prompt_tokens_details)
        status, ended = 200, False
        pending = answer.opening()
        comment = parts_comment_text(ttft, parts) if parts_comment else ""
        try:
            async for chunk in chunks():
                out, pending = pending + answer.events(chunk), []
                if out:
                    yield comment + write(out) if comment else write(out)
                    comment = ""
            ended = True
        except Exception as e:  # the status line is already sent: report in-band
            if answer.finished:  # the whole answer and [DONE] are out; nothing may follow them
                log.warning("request %s: its stream failed after the last chunk: %r", req.id, e)
            else:
                err = unwrap_client_error(e) or (replica_failed(retries) if is_replica_failure(e) else None)
                log.exception("request %s failed while streaming", req.id) if err is None else None
                err = err or ClientError("internal error while generating", status=500, type="server_error")
                status = err.status
                yield write(pending + [err.to_json()])
        finally:  # also when the client goes away (499, as nginx counts it)
            if answer.finished and not ended:  # a client that left after [DONE]: the stream is still read to its end
                drain_later(rest)
            elif not ended:  # it left mid-answer: stop the generation (through Ray Serve's proxy, Serve
                cancel_stream(rest)  # cancels it too; on the Routers' own port nobody else would)
            if status == 200 and not answer.done:
                status = 499
            prompt, completion = answer.tokens()
            self.record(id=req.id, status=status, e2e_s=time.perf_counter() - t0, items=items, ttft_s=ttft,
                        prompt_tokens=prompt, completion_tokens=completion, retries=retries, parts=parts)
        if not answer.finished:
            yield write([DONE])


def ttft_parts(req: ChatRequest, before_s: float, replica: dict | None,
               call_wall: tuple[float, float] | None = None) -> dict:
    """Where a request's time to first token went, in seconds: `before_s` from the Router's start (its
    body read) to the backend's call, the Router's own parts of it (`ChatRequest.timing`), then the
    replica's from its first chunk (`Chunk.timing`: under `fused` `replica_s`, its own time to that chunk,
    and its parts). What the time to first token has beyond `before_s` + `replica_s` is the way there and
    back: Ray's call, the chunk's return, the event loops' lag. With `call_wall` (the call's start and
    its first chunk's arrival, by the wall clock) and the replica's own wall times, that way is split:
    `to_replica_s` from the call to the replica's handler starting, `from_replica_s` from its first chunk
    to the Router (the two processes' clocks: one host's, or NTP's skew between nodes)."""
    parts = {"before_s": before_s, **req.timing, **(replica or {})}
    got_in, got_out = parts.pop("replica_in_at", None), parts.pop("replica_out_at", None)
    if call_wall is not None and got_in is not None and got_out is not None:
        parts["to_replica_s"], parts["from_replica_s"] = got_in - call_wall[0], call_wall[1] - got_out
    return parts


def parts_text(parts: dict | None) -> str:
    """` parts_ms=before:12.3,parse:0.4,...` for a request's log line ('' without parts)."""
    if not parts:
        return ""
    return " parts_ms=" + ",".join(f"{k.removesuffix('_s')}:{1e3 * v:.1f}" for k, v in parts.items()
                                   if isinstance(v, int | float))


def parts_comment_text(ttft_s: float, parts: dict | None) -> str:
    """An SSE comment line (`: ttft_ms=41.5 parts_ms=before:10.0,...`): the Router's time to first token and
    its parts, for a client that asked (`TTFT_PARTS_ASKED`); SSE clients skip lines that start with ':'."""
    return f": ttft_ms={1e3 * ttft_s:.1f}{parts_text(parts)}\n\n"


def _generation(prompt: Prompt, params: SamplingParams, tower: list, seconds: list) -> dict:
    """The generation request the backend takes (app.llm.sequence.GenerationRequest.from_router): the
    prompt, and per tower item (MiniCPM-V: several per media item) its grid, cache key and seconds."""
    return {"input_ids": prompt.input_ids, "mm_token_type_ids": prompt.mm_token_type_ids,
            "grids": [g for _, g, _ in tower], "media_keys": [k for _, _, k in tower],
            # Qwen2.5-VL's video temporal positions (None for images; other families ignore it)
            "second_per_grid_ts": seconds,
            "params": asdict(params),
            "image_tokens": prompt.count(IMAGE_TYPE), "video_tokens": prompt.count(VIDEO_TYPE),
            "warm_up": WARM_UP.get()}


def _adds_special_tokens(tokenizer) -> bool:
    """Whether the tokenizer adds tokens of its own (a BOS) when encoding with add_special_tokens."""
    try:
        return tokenizer.encode("a", add_special_tokens=True) != tokenizer.encode("a", add_special_tokens=False)
    except Exception:  # noqa: BLE001 - a tokenizer that cannot say: assume it would
        return True
