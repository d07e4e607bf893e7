"""One request's decoding state: sampling, stop strings, incremental text, finish reason."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .sampling import Sampler, SamplingParams, StopChecker


class Cancelled(Exception):
    """Raised to a reader of a sequence that was cancelled."""


@dataclass
class Chunk:
    """One streamed step: new text, and on the last chunk the finish reason and counts."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    vision_embeddings: int = 0


class Sequence:
    """Owned by the scheduler thread; clients read `chunks` and may call `cancel()` from any thread."""

    def __init__(self, prompt_len: int, params: SamplingParams, max_new: int, tokenizer, eos_ids: set[int],
                 vision_embeddings: int, device: torch.device,
                 on_chunk: Callable[[Chunk | BaseException], None] | None = None):
        """Chunks go to `on_chunk` when given (e.g. into an event loop), else to the `chunks` queue."""
        self.prompt_len, self.params, self.max_new = prompt_len, params, max_new
        self.tok, self.eos_ids, self.vision_embeddings = tokenizer, eos_ids, vision_embeddings
        self.sampler = Sampler(params, device)
        self.stops = StopChecker(params.stop)
        self.out_ids: list[int] = []
        self.emitted = 0
        self.sent_ids = 0
        self.finished = False
        self.chunks: queue.Queue[Chunk | BaseException] = queue.Queue()
        self._emit = on_chunk or self.chunks.put
        self._cancel = threading.Event()
        # set by the engine
        self.slot = -1
        self.kv_len = 0
        self.rope_delta = 0
        self.next_token = -1
        self.first_token_time: float | None = None  # perf_counter at the first sampled token

    # ------------------------------------------------------------------ client side
    def cancel(self) -> None:
        """Stop this request; the scheduler frees its slot at the next step. Wakes a blocked reader."""
        if not self._cancel.is_set():
            self._cancel.set()
            self._emit(Cancelled("request cancelled"))

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def next_chunk(self, timeout: float | None = None) -> Chunk:
        item = self.chunks.get(timeout=timeout)
        if isinstance(item, BaseException):
            raise item
        return item

    # ------------------------------------------------------------------ scheduler side
    def fail(self, err: BaseException) -> None:
        self.finished = True
        self._emit(err)

    def sample(self, logits: torch.Tensor) -> int:
        return self.sampler(logits, self.out_ids)

    def advance(self, token: int) -> None:
        """Account one sampled token; queue the text that is safe to emit; mark the end."""
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        finish = None
        if token in self.eos_ids and not self.params.ignore_eos:
            finish = "stop"
        else:
            self.out_ids.append(token)
        text = self.tok.decode(self.out_ids, skip_special_tokens=True)
        cut = self.stops.find(text) if finish is None else None
        if cut is not None:
            text, finish = text[:cut], "stop"
        if finish is None and len(self.out_ids) >= self.max_new:
            finish = "length"
        upto = len(text) if finish else self.stops.safe_length(text)
        delta = text[self.emitted:upto]
        self.emitted = max(self.emitted, upto)
        if finish:
            self.finished = True
            self._emit(Chunk(delta, self.out_ids[self.sent_ids:], finish, self.prompt_len, len(self.out_ids),
                             self.vision_embeddings))
        elif delta or self.sent_ids == 0:  # the first token always goes out: it marks time to first token
            self._emit(Chunk(delta, self.out_ids[self.sent_ids:]))
            self.sent_ids = len(self.out_ids)
        self.next_token = token
