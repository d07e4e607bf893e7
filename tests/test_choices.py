"""OpenAI's `n`: several choices from one prompt. Each choice is what a request of one choice with its
seed gives (seed + i, exactly: sampling noise is counter-based), the prompt is computed once and its
KV shared, and the answer, the stream and their usage hold every choice."""

import asyncio
import json

import pytest

from app.llm.async_engine import AsyncEngine
from app.llm.engine import Engine
from helpers import make_request, ours


def by_choice(chunks, n: int) -> list[list[int]]:
    out = [[] for _ in range(n)]
    for c in chunks:
        out[c.index] += c.token_ids
    return out


def test_each_choice_is_the_single_request_with_seed_plus_its_index(world):
    kw = {"temperature": 1.0, "top_p": 0.9, "max_tokens": 12, "ignore_eos": True}
    req = make_request(world, ["image"], data_seed=5, seed=77, n=3, **kw)[0]
    chunks = list(world["engine"].generate(req))
    got = by_choice(chunks, 3)
    want = [ours(world, make_request(world, ["image"], data_seed=5, seed=77 + i, **kw)[0])[0] for i in range(3)]
    assert got == want
    assert len({tuple(t) for t in got}) > 1  # different seeds drew different answers
    finals = [c for c in chunks if c.finish_reason]
    assert sorted(c.index for c in finals) == [0, 1, 2] and all(c.completion_tokens == 12 for c in finals)


@pytest.mark.parametrize("budget,keyed", [(2048, True), (2048, False), (32, True)])
def test_the_choices_compute_their_prompt_once(tiny_checkpoint, world, budget, keyed):
    """On a fresh engine, the three later choices wait for the first one's prompt and take its full
    blocks from the prefix cache, whether the budget would have admitted all four prompts in one step
    (2048) or the first one's takes several (32). Their greedy answers equal a lone request's, so the
    shared KV is the right one. A media item without a content key shares too (the choices share
    block keys)."""
    engine = Engine(str(tiny_checkpoint), max_num_batched_tokens=budget)
    req, _, prompt = make_request(world, ["image"], data_seed=6, words=20, n=4, max_tokens=6, ignore_eos=True)
    if not keyed:
        req.vision[0].key = None
    length, bs = len(prompt.input_ids), engine.blocks.block_size
    assert 3 * 32 < length and 4 * length < 2048
    chunks = list(engine.generate(req))
    alone = ours(world, make_request(world, ["image"], data_seed=6, words=20, max_tokens=6, ignore_eos=True)[0])[0]
    assert by_choice(chunks, 4) == [alone] * 4
    assert engine.blocks.hit_tokens == 3 * ((length - 1) // bs) * bs
    prefilled = sum(tokens for _, tokens, _, _, _ in engine.step_log) - 4 * (6 - 1)  # less the decodes
    assert prefilled == length + 3 * (length - (length - 1) // bs * bs)
    engine.shutdown()


def test_choices_through_the_event_loop_interleave_and_close_together(world, tiny_checkpoint):
    engine = Engine(str(tiny_checkpoint))
    streams = AsyncEngine(engine, stream_interval_s=0.0)
    kw = {"temperature": 1.0, "max_tokens": 10, "ignore_eos": True, "seed": 3, "n": 3}

    async def read(req):
        return [c async for c in streams.generate(req)]

    chunks = asyncio.run(read(make_request(world, ["video"], **kw)[0]))
    want = by_choice(list(world["engine"].generate(make_request(world, ["video"], **kw)[0])), 3)
    assert by_choice(chunks, 3) == want
    assert [c.index for c in chunks if c.finish_reason] != [] and len({c.index for c in chunks}) == 3

    async def first_then_close():
        agen = streams.generate(make_request(world, [], **(kw | {"max_tokens": 5000}))[0])
        await agen.__anext__()
        await agen.aclose()
        for _ in range(2000):
            if not engine.running and not engine.scheduler.waiting and engine.blocks.num_free == engine.blocks.usable_blocks:
                return True
            await asyncio.sleep(0.005)
        return False

    assert asyncio.run(first_then_close())  # every choice was cancelled and freed
    engine.shutdown()


def test_a_request_of_more_choices_than_the_queue_holds_is_a_client_error(world):
    from app.errors import ClientError

    engine = world["engine"]
    req = make_request(world, [], n=engine.max_waiting + 1)[0]
    with pytest.raises(ClientError) as e:
        engine.submit_choices(req, [None] * req.params.n)
    assert e.value.status == 400 and e.value.param == "n"
    with pytest.raises(ValueError, match="submit_choices"):
        engine.submit(make_request(world, [], n=2)[0])


def run_chat(tiny_checkpoint, body: dict):
    """The in-process ChatService: the JSON answer, or the stream's writes."""
    from app.config import AppConfig
    from helpers import local_chat

    chat = local_chat(AppConfig(model=str(tiny_checkpoint)), tiny_checkpoint)

    async def run():
        req, gen, payload = await chat.prepare(body)
        if not req.stream:
            return await chat.complete(req, gen, payload)
        return [w async for w in await chat.open_stream(req, gen, payload)]

    return asyncio.run(asyncio.wait_for(run(), timeout=120))


def test_the_answer_and_the_stream_hold_every_choice_and_their_usage(tiny_checkpoint):
    body = {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 8, "temperature": 1.0,
            "seed": 11, "n": 3, "logprobs": True, "top_logprobs": 1}
    answer = run_chat(tiny_checkpoint, body)
    choices = answer["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    single = [run_chat(tiny_checkpoint, body | {"n": 1, "seed": 11 + i})["choices"][0] for i in range(3)]
    for c, alone in zip(choices, single):  # the same tokens; log-probabilities up to float32 rounding (the
        mine, theirs = c["logprobs"]["content"], alone["logprobs"]["content"]  # choices share steps)
        assert (c["message"], c["finish_reason"]) == (alone["message"], alone["finish_reason"])
        assert [e["bytes"] for e in mine] == [e["bytes"] for e in theirs]
        assert max(abs(e["logprob"] - f["logprob"]) for e, f in zip(mine, theirs)) <= 1e-4
    u = answer["usage"]
    assert u["prompt_tokens"] == run_chat(tiny_checkpoint, body | {"n": 1})["usage"]["prompt_tokens"]
    assert u["completion_tokens"] == sum(len(c["logprobs"]["content"]) for c in choices) == u["total_tokens"] - u["prompt_tokens"]

    writes = run_chat(tiny_checkpoint, body | {"stream": True, "stream_options": {"include_usage": True}})
    events = [b[len("data: "):] for w in writes for b in w.split("\n\n") if b.startswith("data: ")]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    events = [json.loads(e) for e in events[:-1]]
    assert events[-1]["choices"] == [] and events[-1]["usage"] == u
    text, lps, finish = ["", "", ""], [[], [], []], [None, None, None]
    for ev in events[:-1]:
        (c,) = ev["choices"]
        text[c["index"]] += c["delta"].get("content", "")
        lps[c["index"]] += (c["logprobs"] or {}).get("content", [])
        if c["finish_reason"]:
            assert finish[c["index"]] is None
            finish[c["index"]] = c["finish_reason"]
    assert text == [c["message"]["content"] for c in choices]
    assert lps == [c["logprobs"]["content"] for c in choices]
    assert finish == [c["finish_reason"] for c in choices]
    roles = [ev["choices"][0]["index"] for ev in events[:-1] if ev["choices"][0]["delta"].get("role")]
    assert roles == [0, 1, 2]


def test_a_batch_worker_queues_every_choice_of_the_rows_it_keeps_in_flight(world, tiny_checkpoint):
    """The batch driver keeps `capacity()` rows in flight on an LLM worker and a row refused with 503
    only comes back: rows of the most choices each must all be queued at once, and all answered."""
    from app.batch.workers import LLMWorker
    from app.llm.sampling import MAX_CHOICES

    worker = LLMWorker({"model": str(tiny_checkpoint)})

    async def row():
        req = make_request(world, [], n=MAX_CHOICES, max_tokens=1)[0]
        return sorted(c.index for c in [c async for c in worker.streams.generate(req)] if c.finish_reason)

    async def all_rows():
        return await asyncio.gather(*(row() for _ in range(worker.capacity())))

    assert asyncio.run(asyncio.wait_for(all_rows(), 120)) == [list(range(MAX_CHOICES))] * worker.capacity()
    worker.engine.shutdown()
