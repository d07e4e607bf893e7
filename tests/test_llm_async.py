"""The engine behind an event loop (the LLM replica's path): the same text as reading on a thread,
chunks merged per stream interval, and a closed stream cancels its request."""

import asyncio
import sys
import time

import pytest

from app.llm.async_engine import AsyncEngine
from app.llm.engine import Engine
from helpers import make_request, ours


def run(coro):
    return asyncio.run(coro)


async def read_all(streams, req):
    chunks = []
    async for c in streams.generate(req):
        chunks.append(c)
    return chunks


def test_event_loop_chunks_equal_the_thread_readers_text(world, tiny_checkpoint):
    reference = ours(world, make_request(world, ["image"], data_seed=3, max_tokens=20)[0])[1]
    streams = AsyncEngine(Engine(str(tiny_checkpoint)), stream_interval_s=0.0)
    chunks = run(read_all(streams, make_request(world, ["image"], data_seed=3, max_tokens=20)[0]))
    assert "".join(c.text for c in chunks) == "".join(c.text for c in reference)
    assert [t for c in chunks for t in c.token_ids] == [t for c in reference for t in c.token_ids]
    assert chunks[-1].finish_reason == reference[-1].finish_reason
    assert chunks[-1].completion_tokens == reference[-1].completion_tokens


def test_a_long_interval_merges_tokens_into_few_chunks(world, tiny_checkpoint):
    """60 tokens with a 10 s interval: the first token goes out at once (time to first token), the
    rest wait for the end, which wakes the stream at once: 2 or 3 chunks, every token in them."""
    streams = AsyncEngine(Engine(str(tiny_checkpoint)), stream_interval_s=10.0)
    t0 = time.monotonic()
    chunks = run(read_all(streams, make_request(world, [], max_tokens=60, ignore_eos=True)[0]))
    assert time.monotonic() - t0 < 10  # the finish did not wait for the timer
    assert len(chunks) <= 3 and sum(len(c.token_ids) for c in chunks) == 60


def test_closing_the_stream_cancels_the_request(world, tiny_checkpoint):
    engine = Engine(str(tiny_checkpoint))
    streams = AsyncEngine(engine, stream_interval_s=0.0)

    async def first_then_close():
        agen = streams.generate(make_request(world, [], max_tokens=5000, ignore_eos=True)[0])
        await agen.__anext__()
        await agen.aclose()
        for _ in range(2000):
            if not engine.running and engine.blocks.num_free == engine.blocks.usable_blocks:
                return True
            await asyncio.sleep(0.005)
        return False

    assert run(first_then_close())



def test_the_engine_sets_the_configured_gil_switch_interval(tiny_checkpoint):
    """`llm.switch_interval_ms` is the one place the interval comes from: the engine applies it (the
    loop and the engine thread share the GIL); None leaves the interpreter's."""
    saved = sys.getswitchinterval()
    try:
        Engine(str(tiny_checkpoint), switch_interval_ms=0.3).shutdown()
        assert sys.getswitchinterval() == pytest.approx(0.0003)
        sys.setswitchinterval(0.004)
        Engine(str(tiny_checkpoint), switch_interval_ms=None).shutdown()
        assert sys.getswitchinterval() == pytest.approx(0.004)
    finally:
        sys.setswitchinterval(saved)
