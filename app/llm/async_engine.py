"""The engine for an asyncio program (the LLM replica): requests as async generators of chunks.

The engine thread hands each step's token ids, for every request at once, to the event loop in one
`call_soon_threadsafe`, where they are only appended to each request's pending list. A generator
wakes for its request's first token (time to first token), its last, and otherwise on one timer per
`stream_interval_s` shared by every request with something pending; it then makes text of all of it
at once (detokenizer, stop strings: never on the step path) and yields one chunk. So a stream sends a
bounded number of messages however fast it decodes, and the loop's work per step does not grow with
its streams: it shares the GIL with the engine thread, whose steps stay short. The engine shortens
the switch interval (`llm.switch_interval_ms`), else each turn of the loop waits up to Python's
default 5 ms and the loop falls far behind (benchmarks/results/2026-11-23-llm-replica-at-serving-load.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from .engine import Engine
from .sequence import GenerationRequest, Sequence
from .stream import Chunk, TokenDelta


class _Pending:
    """One choice's deltas not yet made into text. The choices of a request share one event: its
    generator wakes once for whatever arrived for any of them."""

    __slots__ = ("deltas", "event", "started")

    def __init__(self, event: asyncio.Event):
        self.deltas: list[TokenDelta] = []
        self.event = event
        self.started = False


class AsyncEngine:
    def __init__(self, engine: Engine, stream_interval_s: float = 0.01):
        self.engine, self.interval = engine, stream_interval_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self._due: set[_Pending] = set()
        self._timer: asyncio.TimerHandle | None = None
        engine.emit = self._emit

    def _emit(self, outputs) -> None:
        """Engine thread: one hand-off per step."""
        self.loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[tuple[Sequence, TokenDelta]]) -> None:
        interval = self.interval
        for seq, delta in outputs:
            p = seq.sink
            if not isinstance(p, _Pending):  # submitted by other code with a plain callable sink
                p(delta)
                continue
            p.deltas.append(delta)
            if not p.started or delta.finish_reason or delta.error is not None or not interval:
                p.event.set()
            else:
                self._due.add(p)
        if self._due and self._timer is None:
            self._timer = self.loop.call_later(interval, self._flush)

    def _flush(self) -> None:
        self._timer = None
        for p in self._due:
            p.event.set()
        self._due.clear()

    async def generate(self, req: GenerationRequest, on_submit: Callable[[Sequence], None] | None = None
                       ) -> AsyncIterator[Chunk]:
        """Chunks of one request, each with its choice's `index` (OpenAI's `n`; chunks of different
        choices interleave); it ends when every choice has finished. Closing the generator (a client
        that went away) cancels the request; the engine frees its blocks at its next step.
        `on_submit` sees each of the engine's sequences."""
        self.loop = asyncio.get_running_loop()
        if req.params.grammar is not None:  # compiled off the loop (a first compile can be slow); then cached
            await asyncio.to_thread(self.engine.grammars.compile, req.params.grammar)
        n, event = req.params.n, asyncio.Event()
        streams = [self.engine.output_stream(req) for _ in range(n)]
        pending = [_Pending(event) for _ in range(n)]
        seqs = self.engine.submit_choices(req, pending)
        # The sequences hold their own copy of the embeddings: drop the request's, which may be GPU
        # memory (the fused placement) that would otherwise stay for the whole generation.
        del req
        if on_submit is not None:
            for seq in seqs:
                on_submit(seq)
        live = list(range(n))
        try:
            while live:
                await event.wait()
                event.clear()
                for i in list(live):
                    p, stream = pending[i], streams[i]
                    deltas, p.deltas = p.deltas, []
                    if not deltas:
                        continue
                    chunk = stream.push(deltas)
                    if stream.stopped:
                        seqs[i].cancel()
                    if chunk is not None:
                        p.started = True
                        chunk.index = i
                        yield chunk
                    if stream.finished:
                        live.remove(i)
        finally:
            for seq, p in zip(seqs, pending):
                seq.cancel()
                self._due.discard(p)
