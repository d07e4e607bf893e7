"""The three stages' work, one class each, with no Ray in them (`pool.py` runs them as Ray core actors);
they are the serving code, not copies of it:
- `MediaWorker`: `ChatService.prepare` over a `BatchMediaPipeline`; returns the request and the patch
  rows separately, so the driver never holds pixels.
- `EncoderWorker`: `EncoderService.encode_async`; many rows in flight let the batcher fill its budgets.
- `LLMWorker`: the `Engine` behind `AsyncEngine`, many rows in flight so continuous batching always has
  sequences; under `fused` placement (the GPU default) it also holds the tower and there is no encoder stage.

Stages take chunks of rows (`BatchConfig.chunk_rows`), run concurrently inside the actor: each Ray call
costs the driver's one Python thread milliseconds, which capped row-by-row jobs whatever the GPU count
(benchmarks/results/2026-11-26-four-gpus-at-last.md). Client errors come back as values (`Failure`), so
a bad row costs one row; a row the engine had no room for comes back as `Busy`, sent again.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..api.answer import Answer
from ..api.chat import ChatService
from ..api.logprobs import TokenText
from ..api.schemas import ChatRequest
from ..checkpoints.model_builder import resolve_model
from ..config import AppConfig
from ..errors import ClientError
from ..gpu.kernel_cache import use_kernel_cache
from ..llm.sampling import MAX_CHOICES
from ..media.spec import patch_spec_for
from ..serving.placement import pinned_gpu

log = logging.getLogger(__name__)


@dataclass
class Failure:
    status: int
    error: dict  # OpenAI's {"message", "type", "param", "code"}

    @classmethod
    def of(cls, e: ClientError) -> Failure:
        return cls(e.status, e.to_json()["error"])


@dataclass
class Busy:
    """A stage refused the row for now (an engine or encoder overloaded, a 5xx): the driver sends it again."""

    message: str


def _unexpected(e: BaseException) -> Failure:
    """A row's own unexpected error, as the answer for that row alone (the chunk's others go on)."""
    log.error("a row failed", exc_info=e)
    return Failure.of(ClientError(f"internal error: {type(e).__name__}: {e}", status=500, type="server_error"))


async def _answer(call: Awaitable):
    """A row's call in a chunk, its trouble as the row's answer: Busy for a 5xx (no room now: the driver
    sends it again), a Failure for a client error, an unexpected error as a 500 Failure."""
    try:
        return await call
    except ClientError as e:
        return Busy(e.message) if e.status >= 500 else Failure.of(e)
    except Exception as e:
        return _unexpected(e)


@dataclass
class Prepared:
    req: ChatRequest
    gen: dict
    items: int  # media items (the payload's length)


def _checkpoint(cfg: AppConfig) -> str:
    return str(resolve_model(cfg.model, cfg.cache_dir))


class MediaWorker:
    def __init__(self, config: dict, file_root: str | None = None):
        from ..checkpoints.tokenizer_loader import load_tokenizer
        from .media import BatchMediaPipeline

        cfg = AppConfig(**config)
        ckpt = _checkpoint(cfg)
        pool = ThreadPoolExecutor(max_workers=cfg.media.worker_threads, thread_name_prefix="media")
        media = BatchMediaPipeline(cfg.media, patch_spec_for(ckpt), pool, root=file_root)
        self.chat = ChatService(cfg, load_tokenizer(ckpt), media, backend=None)

    def ready(self) -> bool:
        return True

    async def prepare(self, body: dict) -> tuple[Prepared | Failure | Busy, list]:
        """(Prepared, Failure or Busy, encoder payload: per item (uint8 rows, grid, cache key))."""
        try:
            req, gen, payload = await self.chat.prepare(body)
        except ClientError as e:  # a 5xx (the media budget full, say) is no fault of the row: sent again
            return (Busy(e.message) if e.status >= 500 else Failure.of(e)), []
        except ValueError as e:  # the chat template and the media disagree: the request's fault
            return Failure.of(ClientError(str(e), param="messages")), []
        return Prepared(req, gen, len(payload)), payload

    async def prepare_many(self, bodies: list[dict]) -> tuple[list[Prepared | Failure], list[list]]:
        """`prepare` for a chunk of rows, concurrently: (per row Prepared or Failure, per row payload).
        The driver keeps only the first; the payloads go to the next stage as one object reference."""
        done = await asyncio.gather(*(self.prepare(b) for b in bodies), return_exceptions=True)
        done = [(_unexpected(d), []) if isinstance(d, BaseException) else d for d in done]
        return [p for p, _ in done], [payload for _, payload in done]


class EncoderWorker:
    def __init__(self, config: dict, pin: tuple[int, int] | None = None):
        """`pin` = (actor index, GPUs per node): colocated with the LLM actors, this actor reserved no
        GPU in Ray and takes the node's GPU of its index in turn (as the serving encoder replicas do,
        `app.serving.placement.pinned_gpu`), before CUDA starts."""
        if pin is not None:
            device = pinned_gpu(pin[0], pin[1], os.environ.get("CUDA_VISIBLE_DEVICES"))
            if device is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = device
        from ..vision.service import EncoderService

        cfg = AppConfig(**config)
        use_kernel_cache(cfg.cache_dir)
        self.service = EncoderService(cfg, _checkpoint(cfg))

    def ready(self) -> bool:
        return True

    async def encode(self, payload: list) -> tuple[int, list]:
        """(item count, per item (main, deepstack)); the count is what the driver waits on, the
        embeddings go to an LLM actor without passing through the driver."""
        return len(payload), await self.service.encode_async(payload)

    async def encode_many(self, payloads: list[list]) -> tuple[int, list]:
        """`encode` for a chunk of rows, all queued at once so the batcher packs them together: (item
        count, per row its items' embeddings, [] for a row without media, or its Failure or Busy, which
        the LLM stage passes on as that row's answer)."""
        async def row(payload: list):
            return await _answer(self.service.encode_async(payload)) if payload else []

        return sum(map(len, payloads)), list(await asyncio.gather(*(row(p) for p in payloads)))

    def stats(self) -> dict:
        return self.service.stats()


class LLMWorker:
    def __init__(self, config: dict, fused: bool = False):
        """`fused`: this actor also holds the vision tower and encodes its rows' media itself, the
        embeddings staying on the GPU (serving's `fused` placement, app/serving/fused.py)."""
        from ..serving.fused import build_generation
        from ..vision.service import pick_device

        cfg = AppConfig(**config)
        use_kernel_cache(cfg.cache_dir)
        # Nothing streams here: wake each request for its first and last chunk, rarely between. The
        # driver keeps `capacity()` rows in flight here (a full batch and as many again); the engine
        # queues them all, each row's `n` choices included: its `max_waiting` guards a server's
        # latency, and a batch row refused with 503 would only come back (under `fused` all of them
        # arrive at once, none paced by an encoder stage).
        seqs = cfg.llm.resolved_max_num_seqs(pick_device(cfg.device))
        cfg = cfg.model_copy(update={"llm": cfg.llm.model_copy(update={
            "stream_interval_ms": 500.0, "max_waiting": max(cfg.llm.max_waiting, 2 * seqs * MAX_CHOICES)})})
        self.fused, self.streams = build_generation(cfg, _checkpoint(cfg), fused)
        self.engine = self.streams.engine
        self.model_name = cfg.model_name
        self.prompt_tokens_details = cfg.enable_prompt_tokens_details
        self.token_text = TokenText(self.engine.tokenizer)  # for requests that ask for logprobs

    def ready(self) -> bool:
        return True

    def capacity(self) -> int:
        """Requests worth keeping in flight here: a full decode batch and as many again waiting,
        within what the engine accepts before refusing (max_waiting)."""
        return self.engine.max_num_seqs + min(self.engine.max_num_seqs, self.engine.max_waiting)

    async def generate(self, prepared: Prepared, encoded: list) -> dict | Failure:
        """The OpenAI chat.completion object, built as the server builds it (`completion_response`)."""
        from ..llm.sequence import GenerationRequest

        return await self._complete(prepared, lambda: self.streams.generate(GenerationRequest.from_router(prepared.gen, encoded)))

    async def generate_from_media(self, prepared: Prepared, payload: list) -> dict | Failure:
        """`fused`: the same from the media worker's payload (uint8 rows, grid, cache key per item)."""
        if self.fused is None:
            raise RuntimeError("generate_from_media needs an LLM actor built with fused=True")
        return await self._complete(prepared, lambda: self.fused.chunks(prepared.gen, payload))

    async def generate_many(self, prepared: list[Prepared | Failure], encoded: list[list]) -> list:
        """`generate` for a chunk of rows, concurrently; a row that failed an earlier stage (a Failure)
        is passed through. Per row: the chat.completion object, a Failure or Busy."""
        return await self._many(prepared, self.generate, encoded)

    async def generate_from_media_many(self, prepared: list[Prepared | Failure], payloads: list[list]) -> list:
        """`fused`: `generate_from_media` for a chunk of rows, as `generate_many`."""
        return await self._many(prepared, self.generate_from_media, payloads)

    async def _many(self, prepared: list, one, inputs: list[list]) -> list:
        async def row(p, x):
            if isinstance(p, Failure | Busy):  # the media stage's answer for this row
                return p
            if isinstance(x, Failure | Busy):  # the encoder stage's answer for this row
                return x
            return await _answer(one(p, x))  # _complete raises only 5xx: no room in the engine now

        return list(await asyncio.gather(*(row(p, x) for p, x in zip(prepared, inputs, strict=True))))

    def encoder_stats(self) -> dict:
        """`fused`: this actor's tower counters."""
        return self.fused.encoder.stats() if self.fused is not None else {}

    async def _complete(self, prepared: Prepared, chunks) -> dict | Failure:
        params = prepared.req.params
        answer = Answer(params.n, self.token_text if params.logprobs is not None else None,
                        prepared.req.token_ids_as_text, self.prompt_tokens_details)
        try:
            async for chunk in chunks():
                answer.add(chunk.as_dict())
        except ClientError as e:
            if e.status >= 500:
                raise  # overloaded: the driver retries it
            return Failure.of(e)
        return answer.response(prepared.req, self.model_name, prepared.gen)

    def stats(self) -> dict:
        return self.engine.stats()
