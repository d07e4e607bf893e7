"""One request inside the engine: its tokens, where its KV lives, and how far it has been computed.

Everything that depends only on the request (rotary positions, per the family's `Rope`, which prompt tokens are vision
tokens, the keys that identify each KV block for prefix caching, the vision embeddings, pinned
on the host) is built once, in `Sequence.__init__`, on the caller's thread, so the engine's step loop
only moves counters and lists.
"""

from __future__ import annotations

import copy
import enum
import itertools
import random
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .mrope import Rope
from .sampling import SamplingParams

_ids = itertools.count()


@dataclass
class VisionInput:
    """Encoder output for one media item, in prompt order. `key` identifies its content (the
    router's embedding-cache key); without one, its KV blocks are never shared with another request."""

    grid: tuple[int, int, int]
    main: torch.Tensor  # [n, hidden]
    deepstack: list[torch.Tensor]
    key: str | None = None
    seconds_per_group: float | None = None  # a Qwen2.5-VL video: its second_per_grid_ts (time positions)


@dataclass
class GenerationRequest:
    input_ids: list[int]
    mm_token_type_ids: list[int]
    vision: list[VisionInput] = field(default_factory=list)
    params: SamplingParams = field(default_factory=SamplingParams)

    @classmethod
    def from_router(cls, gen: dict, encoded: list) -> GenerationRequest:
        """The Router's generation dict (app/api) plus the encoder's (main, deepstack) per item, in
        prompt order."""
        n = len(gen["grids"])
        keys = gen.get("media_keys") or [None] * n
        seconds = gen.get("second_per_grid_ts") or [None] * n
        vision = [VisionInput(tuple(g), main, ds, key, secs)
                  for g, (main, ds), key, secs in zip(gen["grids"], encoded, keys, seconds, strict=True)]
        return cls(gen["input_ids"], gen["mm_token_type_ids"], vision, SamplingParams(**gen["params"]))


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class Sequence:
    """Owned by the engine thread once submitted; `cancel()` may be called from any thread."""

    def __init__(self, req: GenerationRequest, *, rope: Rope, vision_ids: tuple[int, int], max_model_len: int,
                 block_size: int, device: torch.device, dtype: torch.dtype):
        self.arrival_time = time.perf_counter()
        self.id = next(_ids)
        self.params = req.params
        self.token_ids = list(req.input_ids)
        self.prompt_len = len(self.token_ids)
        self.max_new = max(0, min(req.params.max_tokens, max_model_len - self.prompt_len))
        types = np.asarray(req.mm_token_type_ids, dtype=np.int8)
        self.is_vision = types != 0
        ids = np.asarray(self.token_ids)
        placeholder = ids == vision_ids[0]
        for v in vision_ids[1:]:
            placeholder |= ids == v
        placeholders = int(np.count_nonzero(placeholder))
        rows = sum(v.main.shape[0] for v in req.vision)
        if placeholders != rows or int(self.is_vision.sum()) != rows:
            raise ValueError(f"prompt has {placeholders} vision placeholders but the encoder produced {rows} embeddings")
        pos, self.rope_delta = rope.positions(req.mm_token_type_ids, [v.grid for v in req.vision],
                                             [v.seconds_per_group for v in req.vision])
        self.prompt_positions = pos.numpy().astype(np.int32)  # [3, prompt_len]
        # rows of the vision embeddings before each prompt index: a chunk [a, b) uses rows [r[a], r[b])
        self.vision_rows_before = np.concatenate([[0], np.cumsum(self.is_vision)]).astype(np.int64)
        # The embeddings stay on the host here: this runs on the submitting thread (the LLM replica's
        # event loop), and a copy to the GPU from there would wait for the engine's queued step (a
        # pageable copy synchronises the stream), stalling every other request's stream on that loop.
        # They are pinned, and the engine thread copies them asynchronously before the request's first
        # prefill chunk (`vision_to_device`). Embeddings that arrive on the GPU (`fused` placement) stay
        # there: concatenating them only queues kernels, behind the encoder's on the same stream.
        self.device = device
        self.vision_main: torch.Tensor | None = None
        self.vision_deepstack: torch.Tensor | None = None  # [layers, n, hidden]
        if req.vision:
            self.vision_main = _host(torch.cat([v.main for v in req.vision]), dtype, device)
            if req.vision[0].deepstack:
                self.vision_deepstack = _host(torch.stack(
                    [torch.cat([v.deepstack[j] for v in req.vision]) for j in range(len(req.vision[0].deepstack))]
                ), dtype, device)
        self.block_keys = _block_keys(self.token_ids, self.is_vision, req.vision, block_size)
        self.prompt_hashes: list[int] | None = None  # the block keys' chained hashes (BlockManager.chain)
        # counter-based sampling noise: the same seed gives the same tokens, batched or alone
        self.seed = _seed(req.params.seed)
        self._init_engine_state()

    def _init_engine_state(self) -> None:
        """What the engine changes as the request runs (a `fork` starts it afresh)."""
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # prefix-cache hashes of the computed full prompt blocks
        self.num_computed = 0  # tokens whose KV is in the cache
        self.num_cached = 0  # of those, taken from the prefix cache at admission
        # waiting for another's computation of shared prompt blocks: (the last one's hash, that sequence)
        self.waits_on: tuple[int, Sequence] | None = None
        self.row = -1  # its row of the block tables (block_tables.py) and penalty counts while running
        self.finish_reason: str | None = None
        # perf_counter times: built (arrival_time), queued for the engine, first scheduled, first token
        self.queued_time: float | None = None
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self._cancel = threading.Event()
        self.sink = None  # where the engine puts this request's token deltas
        self.matcher = None  # the response format's grammar state (grammar.py), set at submit
        self.reader = None  # set when the engine turns them into text chunks itself (`next_chunk`)

    def fork(self, seed: int | None) -> Sequence:
        """Another choice of this request (OpenAI's `n`), made before either is submitted. It shares the
        prompt's positions, embeddings and block keys, which nothing changes, and draws with `seed`
        (None: a random one). Queued behind this sequence, it waits to be admitted until this one's
        prompt blocks are in the KV cache, and takes them from there (block_manager.py): n choices
        compute their prompt (and encode nothing) once. With prefix caching off it computes the prompt
        again. Sharing the block keys matters: items without a content key get a random one, so
        separately built sequences of one request would never share."""
        twin = copy.copy(self)
        twin.id, twin.arrival_time = next(_ids), time.perf_counter()
        twin.token_ids = self.token_ids[:self.prompt_len]
        twin.seed = _seed(seed)
        twin._init_engine_state()
        return twin

    # ------------------------------------------------------------------ views
    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_remaining(self) -> int:
        """Tokens to run before the next one can be sampled: the prompt (or what is left of it) while
        prefilling, 1 while decoding. A step that runs all of them samples."""
        return len(self.token_ids) - self.num_computed

    def positions(self, start: int, end: int) -> np.ndarray:
        """M-RoPE positions [3, end - start] of tokens [start, end): the prompt's from its grids,
        generated tokens' on all three axes from their index plus the prompt's delta."""
        out = np.empty((3, end - start), dtype=np.int32)
        p_end = min(end, self.prompt_len)
        if start < p_end:
            out[:, :p_end - start] = self.prompt_positions[:, start:p_end]
        if end > self.prompt_len:
            lo = max(start, self.prompt_len)
            out[:, lo - start:] = np.arange(lo, end, dtype=np.int32) + self.rope_delta
        return out

    def vision_rows(self, start: int, end: int) -> tuple[np.ndarray, int, int]:
        """For prompt tokens [start, end): offsets of the vision tokens within the range, and the
        range of embedding rows they take."""
        end = min(end, self.prompt_len)
        if start >= end or self.vision_main is None:
            return np.empty(0, dtype=np.int64), 0, 0
        offsets = np.flatnonzero(self.is_vision[start:end])
        return offsets, int(self.vision_rows_before[start]), int(self.vision_rows_before[end])

    def next_chunk(self, timeout: float | None = None):
        """The next text chunk (for requests submitted without a sink)."""
        return self.reader.next_chunk(timeout)

    # ------------------------------------------------------------------ cancellation
    def cancel(self) -> None:
        """Stop this request; the engine frees its blocks at its next step."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def vision_to_device(self) -> None:
        """Engine thread, before the first prefill chunk that reads them: start the embeddings' copies
        on the engine's stream (ordered before that step's kernels; no host wait from pinned memory).
        The pinned sources may be dropped at once: PyTorch's pinned-memory allocator keeps a block
        until the copies recorded on it have finished."""
        if self.vision_main is None or self.vision_main.device.type == self.device.type:
            return
        self.vision_main = self.vision_main.to(self.device, non_blocking=True)
        if self.vision_deepstack is not None:
            self.vision_deepstack = self.vision_deepstack.to(self.device, non_blocking=True)

    def release_vision(self) -> None:
        self.vision_main = self.vision_deepstack = None


def _seed(given: int | None) -> int:
    """The sampling noise's 63-bit seed: the request's, or a random one."""
    return (given if given is not None else random.getrandbits(63)) & ((1 << 63) - 1)


def _host(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`t` on the host in `dtype`, pinned when it is bound for a CUDA device. Embeddings that are
    already on the engine's GPU (the `fused` placement: the tower ran in this process, on the same
    stream as the engine) stay there: no copy to the host and back."""
    if t.is_cuda and device.type == "cuda":
        return t.to(device, dtype)
    t = t.to("cpu", dtype)
    return t.pin_memory() if device.type == "cuda" else t


def _block_keys(token_ids: list[int], is_vision: np.ndarray, vision: list[VisionInput], block_size: int
                ) -> list[tuple]:
    """What identifies each full block of the prompt: its token ids, with every vision token replaced
    by (its item's content key, its index in the item). Placeholder ids are the same for every
    image, so without the key two different pictures would share KV."""
    keys = list(token_ids)
    if vision:
        i = 0
        vis_idx = np.flatnonzero(is_vision)
        for v in vision:
            n = v.main.shape[0]
            content = v.key if v.key is not None else f"unkeyed-{random.getrandbits(64)}"
            if v.seconds_per_group is not None:  # Qwen2.5-VL: the same frames at another pace rotate differently
                content = (content, v.seconds_per_group)
            for j, t in enumerate(vis_idx[i:i + n].tolist()):
                keys[t] = (content, j)
            i += n
    full = len(keys) // block_size
    return [tuple(keys[b * block_size:(b + 1) * block_size]) for b in range(full)]
