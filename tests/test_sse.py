"""The server-sent-event stream a Router writes (ChatService.open_stream): which events, in which
order, and how many writes carry them (each write is one message through Ray Serve's proxy)."""

from __future__ import annotations

import asyncio
import json

import pytest

from app.config import AppConfig


class ScriptedBackend:
    """Yields the given engine chunks; then raises `fail_after`, if given, or with `hang` never ends
    (a stream whose end has not come back from the replica yet)."""

    def __init__(self, chunks: list[dict], fail_after: Exception | None = None, hang: bool = False):
        self.chunks, self.fail_after, self.hang = chunks, fail_after, hang

    async def stream(self, gen, payload):
        for c in self.chunks:
            await asyncio.sleep(0)
            yield c
        if self.fail_after is not None:
            raise self.fail_after
        if self.hang:
            await asyncio.Event().wait()


def chunk(text: str, finish: str | None = None, done_tokens: int = 0) -> dict:
    return {"text": text, "finish_reason": finish, "prompt_tokens": 7, "completion_tokens": done_tokens,
            "vision_embeddings": 0}


def writes(tiny_checkpoint, backend, body: dict, **config) -> tuple[list[str], list]:
    """(the stream's writes, the records the service logged)."""
    from helpers import local_chat

    records = []
    chat = local_chat(AppConfig(model=str(tiny_checkpoint), **config), tiny_checkpoint, backend)
    chat.observer = records.append

    async def run():
        req, gen, payload = await chat.prepare(body)
        if not req.stream:
            return [await chat.complete(req, gen, payload)]
        out, stream = [], await chat.open_stream(req, gen, payload)
        async for w in stream:  # as a client reads: until [DONE]
            out.append(w)
            if "[DONE]" in w:
                break
        await stream.aclose()  # the client is done (here: before a hanging stream's end)
        return out

    return asyncio.run(asyncio.wait_for(run(), timeout=60)), records


def events(write: str) -> list:
    assert write.endswith("\n\n")
    out = []
    for block in write[:-2].split("\n\n"):
        assert block.startswith("data: ")
        data = block[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


BODY = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 3}


def test_ready_events_share_a_write(tiny_checkpoint):
    """role + first text in one write, one write per later chunk, and finish + usage + [DONE] in the
    last: 3 writes for 3 chunks (7 events)."""
    backend = ScriptedBackend([chunk("a"), chunk("b"), chunk("c", "length", 3)])
    out, records = writes(tiny_checkpoint, backend, BODY | {"stream_options": {"include_usage": True}})
    got = [events(w) for w in out]
    assert len(got) == 3
    role, first = got[0]
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["choices"][0]["delta"] == {"content": "a"}
    assert [e["choices"][0]["delta"] for e in got[1]] == [{"content": "b"}]
    text, finish, usage, done = got[2]
    assert text["choices"][0]["delta"] == {"content": "c"}
    assert finish["choices"][0]["finish_reason"] == "length" and finish["choices"][0]["delta"] == {}
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3 and done == "[DONE]"
    assert [(r["status"], r["completion_tokens"]) for r in records] == [(200, 3)]


def test_without_usage_and_with_an_empty_last_chunk(tiny_checkpoint):
    backend = ScriptedBackend([chunk("a"), chunk("", "stop", 1)])
    got = [events(w) for w in writes(tiny_checkpoint, backend, BODY)[0]]
    assert [len(g) for g in got] == [2, 2]
    assert got[1][0]["choices"][0]["finish_reason"] == "stop" and got[1][1] == "[DONE]"


def test_a_failure_mid_stream_is_an_error_event_then_done(tiny_checkpoint):
    backend = ScriptedBackend([chunk("a"), chunk("b")], fail_after=RuntimeError("engine broke"))
    out, records = writes(tiny_checkpoint, backend, BODY)
    got = [events(w) for w in out]
    assert [e["choices"][0]["delta"] for e in got[1]] == [{"content": "b"}]
    (err,), (done,) = got[2], got[3]
    assert err["error"]["type"] == "server_error" and done == "[DONE]"
    assert records[0]["status"] == 500


def test_the_answer_does_not_wait_for_the_streams_end(tiny_checkpoint):
    """The chunk with a finish reason is the last: [DONE] (or the whole non-streamed answer) goes out
    then, not when the replica's end of stream comes back (here it never does)."""
    for stream in (True, False):
        backend = ScriptedBackend([chunk("a"), chunk("b", "stop", 2)], hang=True)
        out, records = writes(tiny_checkpoint, backend, BODY | {"stream": stream})
        if stream:
            assert [e if e == "[DONE]" else e["choices"][0]["delta"] for e in events(out[-1])] == [
                {"content": "b"}, {}, "[DONE]"]
        else:
            assert out[0]["choices"][0]["message"]["content"] == "ab" and out[0]["choices"][0]["finish_reason"] == "stop"
        assert records[0]["status"] == 200 and records[0]["completion_tokens"] == 2


def test_nothing_follows_done(tiny_checkpoint):
    """A failure after the last chunk (the answer and [DONE] already out) adds no event."""
    backend = ScriptedBackend([chunk("a", "stop", 1)], fail_after=RuntimeError("late"))
    out, records = writes(tiny_checkpoint, backend, BODY)
    got = [events(w) for w in out]
    assert len(got) == 1 and got[0][-1] == "[DONE]" and len(got[0]) == 4  # role, text, finish, [DONE]
    assert records[0]["status"] == 200


def test_a_finished_answers_stream_is_still_read_to_its_end(tiny_checkpoint):
    """Ray Serve counts a call as running until its stream ends, so the rest of the stream is read in
    the background after the answer is out: non-streamed, and streamed when the client leaves at [DONE]."""
    from helpers import local_chat

    chat = local_chat(AppConfig(model=str(tiny_checkpoint)), tiny_checkpoint)

    class Held(ScriptedBackend):
        """Ends only when `release` is set after the last chunk; `ended` then."""

        async def stream(self, gen, payload):
            for c in self.chunks:
                yield c
            await self.release.wait()
            self.ended = True

    async def run(stream: bool) -> tuple[bool, bool]:
        backend = Held([chunk("a", "stop", 1)])
        backend.release, backend.ended = asyncio.Event(), False
        chat.backend = backend
        req, gen, payload = await chat.prepare(BODY | {"stream": stream})
        if stream:
            writes_ = await chat.open_stream(req, gen, payload)
            assert "[DONE]" in await anext(writes_)
            await writes_.aclose()  # the client leaves at [DONE]
        else:
            assert (await chat.complete(req, gen, payload))["choices"][0]["finish_reason"] == "stop"
        before = backend.ended
        backend.release.set()
        for _ in range(10):
            await asyncio.sleep(0)
        return before, backend.ended

    for stream in (False, True):
        assert asyncio.run(run(stream)) == (False, True), stream


class CancellableStream:
    """Like Ray Serve's DeploymentResponseGenerator: an async iterator with `cancel()`, which stops the
    generation on its replica. Yields its chunks, then waits for more until cancelled."""

    def __init__(self, chunks: list[dict]):
        self.chunks, self.cancelled = list(chunks), asyncio.Event()

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.chunks:
            return self.chunks.pop(0)
        await self.cancelled.wait()
        raise asyncio.CancelledError

    def cancel(self):
        self.cancelled.set()


def test_a_client_that_leaves_mid_answer_cancels_the_generation(tiny_checkpoint):
    """Through Ray Serve's proxy, Serve cancels the Router's downstream call when the client goes; on the
    Routers' own port (app/api/shared_port.py) nothing would, and the engine slot stayed taken
    (tests/test_integration.py checks both ports end to end)."""
    from helpers import local_chat

    streams = []

    class Backend:
        def stream(self, gen, payload):
            streams.append(CancellableStream([chunk("a"), chunk("b")]))
            return streams[-1]

    records = []
    chat = local_chat(AppConfig(model=str(tiny_checkpoint)), tiny_checkpoint, Backend())
    chat.observer = records.append

    async def run():
        req, gen, payload = await chat.prepare(BODY)
        stream = await chat.open_stream(req, gen, payload)
        assert "[DONE]" not in await anext(stream)
        await stream.aclose()  # the client went away before the answer ended

    asyncio.run(asyncio.wait_for(run(), timeout=60))
    assert streams[0].cancelled.is_set()
    assert records[-1]["status"] == 499


class FailingThenFine:
    """The first stream yields a chunk with no text (the first token, part of a character) and then its
    replica dies; the second answers."""

    def __init__(self, first_chunks: list[dict]):
        self.first_chunks, self.calls = first_chunks, 0

    def stream(self, gen, payload):
        from ray.exceptions import ActorDiedError

        self.calls += 1
        if self.calls == 1:
            return ScriptedBackend(self.first_chunks, fail_after=ActorDiedError()).stream(gen, payload)
        return ScriptedBackend([chunk("a"), chunk("b", "length", 2)]).stream(gen, payload)


def test_a_replica_lost_before_any_text_went_out_is_retried_in_the_same_stream(tiny_checkpoint):
    """The client has seen only the role: the generation starts again on another replica and the
    client reads one ordinary answer, with no error event."""
    pytest.importorskip("ray")
    backend = FailingThenFine([chunk("")])
    out, records = writes(tiny_checkpoint, backend, BODY)
    got = [e for w in out for e in events(w)]
    assert backend.calls == 2
    assert [e["choices"][0]["delta"] for e in got[:-1] if e["choices"]] == [
        {"role": "assistant", "content": ""}, {"content": "a"}, {"content": "b"}, {}]
    assert got[-1] == "[DONE]" and not any("error" in e for e in got[:-1])
    assert records[0]["status"] == 200 and records[0]["retries"] == 1


def test_a_replica_lost_after_text_went_out_ends_the_stream_with_an_error(tiny_checkpoint):
    pytest.importorskip("ray")
    backend = FailingThenFine([chunk(""), chunk("x")])
    out, records = writes(tiny_checkpoint, backend, BODY)
    got = [e for w in out for e in events(w)]
    assert backend.calls == 1
    assert got[-2]["error"]["code"] == "replica_failed" and got[-1] == "[DONE]"
    assert records[0]["status"] == 503


def test_a_replica_lost_after_logprobs_without_text_went_out_ends_the_stream_with_an_error(tiny_checkpoint):
    """A first token that is part of a character sends no text but does send its log-probability; the
    replica then dies. A retry would send the new attempt's log-probabilities after the old one's (bytes
    of two different characters), so the stream ends with an error, as after text (found in review)."""
    pytest.importorskip("ray")
    first = chunk("") | {"token_ids": [160], "logprobs": [(-0.5, [], [])]}
    backend = FailingThenFine([first])
    out, records = writes(tiny_checkpoint, backend, BODY | {"logprobs": True})
    got = [e for w in out for e in events(w)]
    assert backend.calls == 1
    sent = [x for e in got[:-1] if "choices" in e and e["choices"] and e["choices"][0]["logprobs"]
            for x in e["choices"][0]["logprobs"]["content"]]
    assert len(sent) == 1 and got[-2]["error"]["code"] == "replica_failed" and got[-1] == "[DONE]"


class NeverShowsText(FailingThenFine):
    """The first stream yields a first token with no text, then its replica dies; every later one dies
    before its first chunk."""

    def stream(self, gen, payload):
        from ray.exceptions import ActorDiedError

        self.calls += 1
        chunks = self.first_chunks if self.calls == 1 else []
        return ScriptedBackend(chunks, fail_after=ActorDiedError()).stream(gen, payload)


def test_restarts_count_against_the_requests_attempts(tiny_checkpoint):
    """The policy's bounds cover all of a request's tries, restarts included: with 3 attempts, 3 streams
    are started, then the client gets `replica_failed` after 2 retries."""
    pytest.importorskip("ray")
    backend = NeverShowsText([chunk("")])
    out, records = writes(tiny_checkpoint, backend, BODY, retry={"max_attempts": 3, "backoff_s": 0})
    got = [e for w in out for e in events(w)]
    assert backend.calls == 3
    assert got[-2]["error"]["code"] == "replica_failed" and "after 2 retries" in got[-2]["error"]["message"]
    assert got[-1] == "[DONE]" and records[0]["status"] == 503 and records[0]["retries"] == 2
