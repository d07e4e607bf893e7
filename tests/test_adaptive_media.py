"""The Router's media source: inline images at low load are prepared in the Router, the rest in the
MediaPreprocessor replicas (app/media/adaptive.py). The replicas are a stand-in that prepares with the
same pipeline, so the two ways can be compared item for item."""

from __future__ import annotations

import asyncio
import base64
import threading

import numpy as np
import pytest

from app.config import MediaConfig
from app.errors import ClientError
from app.media import pipeline
from app.media.adaptive import AdaptiveMedia, CountingPool
from app.media.pipeline import MediaPipeline
from app.media.preprocess import PatchSpec
from app.media.ref import MediaRef
from helpers import mp4_bytes, png_bytes

CFG = MediaConfig()
SPEC = PatchSpec()


def image_ref(seed: int = 0, h: int = 64, w: int = 96) -> MediaRef:
    return MediaRef("image", "data:image/png;base64," + base64.b64encode(png_bytes(h, w, seed)).decode(), "m")


class Replicas:
    """Stands in for RemoteMedia: the same pipeline, and an optional gate that holds every call."""

    def __init__(self):
        self.spec, self.pipeline, self.calls, self.gate = SPEC, MediaPipeline(CFG, SPEC), [], None

    async def prepare_all(self, refs):
        self.calls.append(refs)
        if self.gate is not None:
            await self.gate.wait()
        return await self.pipeline.prepare_all(refs)


def source(below: int = 1, max_bytes: int = 1 << 20):
    replicas, seen = Replicas(), []
    local = MediaPipeline(CFG, SPEC, CountingPool(CFG.worker_threads))
    return AdaptiveMedia(replicas, local, below, max_bytes, on_choice=seen.append), replicas, seen


def test_an_idle_router_prepares_inline_images_itself_and_gets_the_replicas_items():
    media, replicas, seen = source()
    refs = [image_ref(1), image_ref(2, 80, 48)]
    local = asyncio.run(media.prepare_all(refs))
    assert seen == ["local"] and replicas.calls == []
    remote = asyncio.run(replicas.pipeline.prepare_all(refs))
    for a, b in zip(local, remote, strict=True):
        assert a.patches.grid == b.patches.grid and a.key == b.key
        assert np.array_equal(a.patches.pixel_values, b.patches.pixel_values)
        assert a.encoder_ref is None  # its rows travel with the call
    assert media.preparing == 0


@pytest.mark.parametrize("refs", [
    [MediaRef("image", "http://example.com/a.png", "m")],  # a fetch: never from the Router
    [MediaRef("video", "data:video/mp4;base64," + base64.b64encode(mp4_bytes()).decode(), "m")],
    [image_ref(0), MediaRef("video", "data:video/mp4;base64,AAAA", "m")],  # one video sends the whole request
    [image_ref(0, 256, 256)],  # over the byte limit below
    [],
], ids=["http", "video", "image_and_video", "too_large", "no_media"])
def test_fetches_videos_and_large_payloads_go_to_the_replicas(refs):
    media, _, _ = source(max_bytes=20_000)
    assert not media.is_local(refs)


def test_off_sends_everything_to_the_replicas():
    media, replicas, seen = source(below=0)
    asyncio.run(media.prepare_all([image_ref(0)]))
    assert seen == ["remote"] and len(replicas.calls) == 1


def test_while_another_request_prepares_media_the_next_goes_to_the_replicas():
    async def run():
        media, replicas, seen = source(below=1)
        replicas.gate = asyncio.Event()
        first = asyncio.ensure_future(media.prepare_all([MediaRef("image", "http://example.com/a.png", "m")]))
        await asyncio.sleep(0)
        assert media.preparing == 1
        second = asyncio.ensure_future(media.prepare_all([image_ref(3)]))  # busy: the replicas
        await asyncio.sleep(0)
        assert seen == ["remote", "remote"] and media.preparing == 2
        replicas.gate.set()
        assert len(await second) == 1
        first.cancel()  # the http fetch would fail; it is not the point here
        await asyncio.gather(first, return_exceptions=True)
        assert media.preparing == 0
        await media.prepare_all([image_ref(4)])  # idle again: here
        assert seen == ["remote", "remote", "local"]

    asyncio.run(run())


def test_a_wider_limit_lets_several_requests_prepare_here_at_once():
    async def run():
        media, replicas, seen = source(below=2)
        replicas.gate = asyncio.Event()
        one = asyncio.ensure_future(media.prepare_all([image_ref(5)]))
        two = asyncio.ensure_future(media.prepare_all([image_ref(6)]))
        three = asyncio.ensure_future(media.prepare_all([image_ref(7)]))
        await asyncio.sleep(0)
        assert seen == ["local", "local", "remote"]
        replicas.gate.set()
        assert [len(x) for x in await asyncio.gather(one, two, three)] == [1, 1, 1]

    asyncio.run(run())


def test_bad_media_prepared_here_is_a_client_error_and_frees_the_router():
    media, replicas, seen = source()
    bad = MediaRef("image", "data:image/png;base64," + base64.b64encode(b"not an image").decode(), "messages[0]")
    with pytest.raises(ClientError) as e:
        asyncio.run(media.prepare_all([bad]))
    assert e.value.status == 400 and seen == ["local"]
    assert media.preparing == 0
    asyncio.run(media.prepare_all([image_ref(8)]))
    assert seen == ["local", "local"] and replicas.calls == []


def test_a_request_without_media_is_not_counted():
    media, replicas, seen = source()
    assert asyncio.run(media.prepare_all([])) == []
    assert seen == [] and replicas.calls == []


def test_leftover_decoding_of_abandoned_requests_keeps_the_next_request_off_the_router(monkeypatch):
    """A job handed to a thread runs to its end even when its request is gone (here: clients that left);
    while such jobs hold every worker the Router is not idle, and the next request goes to the replicas."""
    release, real = threading.Event(), pipeline.prepare_inline

    def held(ref, cfg, spec):
        if ref.param == "held":
            release.wait(30)
        return real(ref, cfg, spec)

    monkeypatch.setattr(pipeline, "prepare_inline", held)

    async def run():
        media, replicas, seen = source()
        pool = media.local.executor
        for n in range(CFG.worker_threads):  # one abandoned request per worker
            task = asyncio.ensure_future(media.prepare_all([MediaRef("image", image_ref(n).url, "held")]))
            while pool.jobs < n + 1:
                await asyncio.sleep(0.01)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert media.preparing == 0 and pool.jobs == CFG.worker_threads
        assert len(await media.prepare_all([image_ref(9)])) == 1
        assert seen == ["local"] * CFG.worker_threads + ["remote"] and len(replicas.calls) == 1
        release.set()
        while pool.jobs:
            await asyncio.sleep(0.01)
        await media.prepare_all([image_ref(10)])  # the threads are free again: here
        assert seen[-1] == "local" and len(replicas.calls) == 1

    try:
        asyncio.run(run())
    finally:
        release.set()


def test_the_router_pipeline_must_count_its_jobs():
    with pytest.raises(TypeError):
        AdaptiveMedia(Replicas(), MediaPipeline(CFG, SPEC), 1, 1 << 20)
