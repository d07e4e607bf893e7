"""Batch job pieces without Ray: input rows, shards and resume, file media under a root, config."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from app.batch.config import BatchConfig
from app.batch.io import ShardWriter, read_rows
from app.batch.media import BatchMediaPipeline, resolve_file
from app.errors import ClientError
from helpers import png_bytes


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_rows_keep_their_id_and_bad_lines_get_a_stable_id_and_an_error(tmp_path):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    p = write_lines(tmp_path / "in.jsonl", [
        json.dumps({"id": "a", **body}), "", "{oops", json.dumps({"id": 7, **body}), json.dumps(body),
        json.dumps({"id": "a", **body}), "[1, 2]"])
    rows = list(read_rows(p))
    assert [(r.line, r.id) for r in rows] == [(1, "a"), (3, "line-3"), (4, "7"), (5, "line-5"), (6, "line-6"),
                                             (7, "line-7")]
    ok = rows[0]
    assert ok.error is None and "id" not in ok.body and ok.body["stream"] is False and ok.body["max_tokens"] == 3
    assert [r.error and r.error.code for r in rows[1:]] == ["invalid_json", None, "invalid_id", "duplicate_id", "invalid_json"]
    assert rows[2].error is None and rows[2].body["messages"] == body["messages"]


def test_parquet_rows_equal_the_jsonl_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    bodies = [{"id": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
              {"id": "y", "messages": [{"role": "user", "content": "yo"}], "temperature": 0.0}]
    jl = write_lines(tmp_path / "in.jsonl", [json.dumps(b) for b in bodies])
    # messages as JSON text (content may be a string or a list of parts, which Parquet cannot mix)
    table = pa.table({"id": [b["id"] for b in bodies], "messages": [json.dumps(b["messages"]) for b in bodies],
                      "max_tokens": [2, None], "temperature": [None, 0.0]})
    pq.write_table(table, tmp_path / "in.parquet")
    assert [(r.id, r.body) for r in read_rows(tmp_path / "in.parquet")] == [(r.id, r.body) for r in read_rows(jl)]


def test_shards_are_whole_files_and_a_rerun_resumes_after_them(tmp_path):
    out = tmp_path / "out"
    w = ShardWriter(out, shard_rows=2)
    for i in range(5):
        w.add({"id": f"r{i}", "response": {"n": i}})
    assert sorted(os.listdir(out)) == [".lock", "part-00000.jsonl", "part-00001.jsonl"]  # r4 still buffered
    first = (out / "part-00000.jsonl").read_bytes()
    assert [json.loads(x)["id"] for x in first.splitlines()] == ["r0", "r1"]
    (out / ".part-00002.jsonl.tmp").write_bytes(b'{"id": "r4", "resp')  # a shard being written at a kill
    w.release()  # the killed driver's lock went with its process
    w2 = ShardWriter(out, shard_rows=2)
    assert w2.done == {"r0", "r1", "r2", "r3"} and w2.next_index == 2
    assert not (out / ".part-00002.jsonl.tmp").exists()
    w2.add({"id": "r4"})
    w2.flush()
    assert (out / "part-00000.jsonl").read_bytes() == first
    assert json.loads((out / "part-00002.jsonl").read_text()) == {"id": "r4"}


def test_file_media_are_read_only_under_the_root(tmp_path):
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a.png").write_bytes(png_bytes(64, 64))
    (tmp_path / "secret.png").write_bytes(png_bytes(64, 64))
    os.symlink(tmp_path / "secret.png", root / "link.png")
    r = str(root)
    assert resolve_file("sub/a.png", r, "p") == root / "sub" / "a.png"
    assert resolve_file(f"file://{root}/sub/a.png", r, "p") == root / "sub" / "a.png"
    assert resolve_file(str(root / "sub" / "a.png"), r, "p") == root / "sub" / "a.png"
    for bad in ("../secret.png", str(tmp_path / "secret.png"), "link.png", "file:///etc/passwd",
                "file://host/x.png"):
        with pytest.raises(ClientError) as e:
            resolve_file(bad, r, "p")
        assert e.value.status == 400 and e.value.code == "invalid_media_url"
    with pytest.raises(ClientError):
        resolve_file("sub/a.png", None, "p")
    os.symlink(root / "loop", root / "loop")  # a symlink loop: resolve() raises RuntimeError (a 500 before)
    with pytest.raises(ClientError) as e:
        resolve_file("loop/x.png", r, "p")
    assert e.value.status == 400 and e.value.code == "invalid_media_url"


def test_reserved_ids_and_online_stream_options_found_in_review(tmp_path):
    """An id of the form line-<n> is refused, so a bad line's fallback id never equals a real row's (two
    records with one id; on resume a row could be skipped as done); an online body's stream_options is
    dropped with its stream (a 400 before: stream_options without stream)."""
    body = {"messages": [{"role": "user", "content": "hi"}]}
    p = write_lines(tmp_path / "in.jsonl", [
        json.dumps({"id": "line-3", **body}), json.dumps({"id": "line-x", **body}), "{oops",
        json.dumps({"id": "s", **body, "stream": True, "stream_options": {"include_usage": True}})])
    rows = list(read_rows(p))
    assert [(r.id, r.error and r.error.code) for r in rows] == [
        ("line-1", "invalid_id"), ("line-x", None), ("line-3", "invalid_json"), ("s", None)]
    assert len({r.id for r in rows}) == 4
    from app.api.schemas import parse_chat_request

    assert "stream_options" not in rows[3].body and not parse_chat_request(rows[3].body, 16, 4).stream


def test_a_file_image_prepares_like_the_same_bytes_as_a_data_url(tmp_path, tiny_checkpoint):
    import base64

    from app.config import MediaConfig
    from app.media.ref import MediaRef
    from app.media.spec import patch_spec_for

    data = png_bytes(80, 112, seed=3)
    (tmp_path / "a.png").write_bytes(data)
    pipe = BatchMediaPipeline(MediaConfig(), patch_spec_for(tiny_checkpoint), root=str(tmp_path))
    by_file = asyncio.run(pipe.prepare(MediaRef("image", "a.png", "p")))
    by_url = asyncio.run(pipe.prepare(MediaRef("image", "data:image/png;base64," + base64.b64encode(data).decode(),
                                               "p")))
    assert by_file.key == by_url.key and by_file.patches.grid == by_url.patches.grid
    assert (by_file.patches.pixel_values == by_url.patches.pixel_values).all()
    with pytest.raises(ClientError) as e:
        asyncio.run(pipe.prepare(MediaRef("image", "missing.png", "p")))
    assert e.value.code == "media_fetch_failed"


def test_a_requests_files_prepare_together_as_the_server_prepares_its_items(tmp_path, tiny_checkpoint):
    # ChatService.prepare goes through prepare_all, which hands each item the request's worker slots
    from app.config import MediaConfig
    from app.media.ref import MediaRef
    from app.media.spec import patch_spec_for

    (tmp_path / "a.png").write_bytes(png_bytes(80, 112, seed=3))
    (tmp_path / "b.png").write_bytes(png_bytes(64, 48, seed=4))
    os.mkfifo(tmp_path / "pipe.png")
    pipe = BatchMediaPipeline(MediaConfig(), patch_spec_for(tiny_checkpoint), root=str(tmp_path))
    items = asyncio.run(pipe.prepare_all([MediaRef("image", "a.png", "p0"), MediaRef("image", f"file://{tmp_path}/b.png", "p1")]))
    single = [asyncio.run(pipe.prepare(MediaRef("image", name, "p"))) for name in ("a.png", "b.png")]
    assert [it.key for it in items] == [it.key for it in single] and items[0].key != items[1].key
    with pytest.raises(ClientError) as e:  # a FIFO under the root is refused, not read (it would block)
        asyncio.run(pipe.prepare_all([MediaRef("image", "a.png", "p0"), MediaRef("image", "pipe.png", "p1")]))
    assert e.value.status == 400 and e.value.param == "p1"


def test_config_file_and_overrides(tmp_path):
    f = tmp_path / "b.yaml"
    f.write_text("app:\n  model: embedded:tiny\n  llm: {max_num_seqs: 4}\nllm_pool: {min_size: 1, max_size: 3}\n"
                 "shard_rows: 50\n")
    cfg = BatchConfig.load(str(f), model="embedded:other", file_root="/data")
    assert cfg.app.model == "embedded:other" and cfg.app.llm.max_num_seqs == 4
    assert cfg.app.encoder.batch_wait_ms == 20.0  # the batch default: a deep queue fills budgets
    assert cfg.app.encoder.batch_wait_when_idle and BatchConfig().app.encoder.batch_wait_when_idle
    f.write_text("app:\n  encoder: {batch_wait_ms: 7, min_budget: 64}\n")
    enc = BatchConfig.load(str(f)).app.encoder  # a file's encoder block keeps the batch defaults it leaves out
    assert (enc.batch_wait_ms, enc.batch_wait_when_idle, enc.min_budget) == (7.0, True, 64)
    assert cfg.llm_pool.max_size == 3 and cfg.shard_rows == 50 and cfg.file_root == "/data"
    assert cfg.chunk_rows == 16 and BatchConfig.load(str(f), chunk_rows=4).chunk_rows == 4
    from app.batch.__main__ import parse_args

    assert parse_args(["--input", "i", "--output", "o", "--chunk-rows", "8"]).chunk_rows == 8
    with pytest.raises(ValueError):
        BatchConfig(llm_pool={"min_size": 3, "max_size": 2})
    with pytest.raises(ValueError):
        BatchConfig(shards=3)


def test_a_pool_whose_replacement_actors_fail_to_start_retries_then_fails_its_callers(monkeypatch):
    """The only actor dies and its replacements fail in their constructors: callers waited for ever (the
    job hung). Now each failure wakes them, a new start follows after a pause, a start that succeeds
    serves them, and after START_ATTEMPTS failures in a row with no actor left they get PoolFailed."""
    import ray

    from app.batch import pool as pool_module
    from app.batch.config import PoolConfig
    from app.batch.pool import ActorPool, PoolFailed

    monkeypatch.setattr(pool_module, "START_BACKOFF_S", 0.001)
    monkeypatch.setattr(ray, "kill", lambda handle: None)

    class Call:
        def __init__(self, fn):
            self.fn = fn

        def remote(self, *args):
            async def run():
                return self.fn()
            return run()

    def fleet(fails: set[int]):
        starts = []

        class Handle:
            def __init__(self):
                starts.append(len(starts) + 1)
                n = starts[-1]

                def ready():
                    if n in fails:
                        raise RuntimeError(f"start {n}: CUDA out of memory")
                    return True
                self.ready = Call(ready)

        class Remote:
            def remote(self, *args):
                return Handle()
        return Remote(), starts

    async def scenario(fails: set[int]):
        p = ActorPool("llm", object, lambda i: (), PoolConfig(min_size=1, max_size=1), 0)
        p.remote_cls, starts = fleet(fails)
        await p.start()
        await p.release(*await p.acquire(), dead=True)  # the only actor died
        try:
            await asyncio.wait_for(p.acquire(), 10)
            return "served", len(starts)
        except PoolFailed:
            return "failed", len(starts)

    assert asyncio.run(scenario({2, 3})) == ("served", 4)  # two failed starts, the third replacement serves
    assert asyncio.run(scenario(set(range(2, 100)))) == ("failed", 1 + pool_module.START_ATTEMPTS)


def test_an_output_folder_is_one_jobs_and_one_drivers_at_a_time(tmp_path):
    """A second driver on the folder is refused while the first holds it (both would number shards from
    the same index and one rename would replace the other's rows); another input's job is refused (its
    ids, 0, 1, 2..., would be skipped as answered); the same input resumes."""
    a, b = write_lines(tmp_path / "a.jsonl", ["{}"]), write_lines(tmp_path / "b.jsonl", ["{}"])
    out = tmp_path / "out"
    first = ShardWriter(out, 10)
    first.claim(a)
    with pytest.raises(RuntimeError, match="another batch job is writing"):
        ShardWriter(out, 10).claim(a)
    first.release()  # the first driver ended
    with pytest.raises(RuntimeError, match="holds the output of a job over"):
        ShardWriter(out, 10).claim(b)
    again = ShardWriter(out, 10)
    again.claim(a)  # the same job, resumed
    again.release()


def test_a_refused_second_driver_leaves_the_first_ones_shard_in_progress(tmp_path):
    """The folder's lock comes before anything the constructor does to the folder: a second driver used
    to delete the running one's `.part-*.tmp` before being refused, and the first then crashed renaming it."""
    out = tmp_path / "out"
    first = ShardWriter(out, 10)
    in_progress = out / ".part-00000.jsonl.tmp"
    in_progress.write_bytes(b'{"id": "r0"}\n')
    with pytest.raises(RuntimeError, match="another batch job is writing"):
        ShardWriter(out, 10)
    assert in_progress.exists()
    first.release()


def test_a_shard_is_never_replaced_even_where_the_lock_does_nothing(tmp_path):
    """Storage whose flock is a no-op let two writers number shards from the same index; a commit that
    finds its name taken moves to the next instead of replacing the other writer's rows."""
    out = tmp_path / "out"
    w = ShardWriter(out, shard_rows=10)
    (out / "part-00000.jsonl").write_text('{"id": "theirs"}\n')  # another writer, unseen by this one
    w.add({"id": "mine"})
    w.flush()
    assert json.loads((out / "part-00000.jsonl").read_text()) == {"id": "theirs"}
    assert json.loads((out / "part-00001.jsonl").read_text()) == {"id": "mine"}
    assert not list(out.glob(".part-*.tmp")) and w.next_index == 2


def test_a_line_nested_too_deep_to_parse_is_that_lines_error(tmp_path):
    """json.loads raises RecursionError, not ValueError, past about 1,000 levels: once it escaped and
    stopped the job at that line on every rerun."""
    deep = "[" * 5000 + "]" * 5000
    path = write_lines(tmp_path / "in.jsonl", [json.dumps({"id": "ok", "messages": []}), deep,
                                               json.dumps({"id": "after", "messages": []})])
    rows = list(read_rows(path))
    assert [r.id for r in rows] == ["ok", "line-2", "after"]
    assert rows[0].error is None and rows[2].error is None
    assert rows[1].error.code == "invalid_json" and "RecursionError" in rows[1].error.message


def test_fused_llm_actors_share_a_gpu_as_serving_replicas_do():
    """Under `fused`, `llm_replicas_per_gpu` actors per GPU, each with its share of the KV budget, when the
    pool can fill every GPU so; an explicit pool share wins; without GPUs none. The 4-GPU example config
    runs two per GPU."""
    from pathlib import Path

    import yaml

    from app.batch.job import llm_actor_share

    cfg = BatchConfig(app={"placement": {"llm_replicas_per_gpu": 2}, "llm": {"gpu_memory_utilization": 0.9}})
    share, app = llm_actor_share(cfg, 4, fused=True)  # a pool of 1: one whole GPU, not half of one
    assert share == 1.0 and app["llm"]["gpu_memory_utilization"] == 0.9
    cfg = cfg.model_copy(update={"llm_pool": cfg.llm_pool.model_copy(update={"min_size": 8, "max_size": 8})})
    share, app = llm_actor_share(cfg, 4, fused=True)
    assert share == 0.5 and app["llm"]["gpu_memory_utilization"] == 0.45
    small = cfg.model_copy(update={"llm_pool": cfg.llm_pool.model_copy(update={"min_size": 4, "max_size": 4})})
    assert llm_actor_share(small, 4, fused=True)[0] == 1.0  # 4 half-GPU actors would leave two GPUs idle
    assert app["placement"]["llm_replicas_per_gpu"] == 2 and app["model"] == cfg.app.model
    share, app = llm_actor_share(cfg, 4, fused=False)  # colocate: a whole GPU each
    assert share == 1.0 and app["llm"]["gpu_memory_utilization"] == 0.9
    assert llm_actor_share(cfg, 0, fused=True)[0] == 0.0
    explicit = cfg.model_copy(update={"llm_pool": cfg.llm_pool.model_copy(update={"num_gpus": 0.25})})
    share, app = llm_actor_share(explicit, 4, fused=True)
    assert share == 0.25 and app["llm"]["gpu_memory_utilization"] == 0.225
    example = BatchConfig(**yaml.safe_load((Path(__file__).parent.parent / "configs" /
                                            "batch-qwen3-vl-2b-gpu.yaml").read_text()))
    share, _ = llm_actor_share(example, 4, fused=True)
    assert example.llm_pool.min_size == example.llm_pool.max_size == 4 / share


def test_a_chunk_takes_a_slot_per_row_and_one_larger_than_an_actor_takes_a_whole_idle_one():
    """Stage calls carry chunks of rows (BatchConfig.chunk_rows), and an actor's capacity counts rows:
    the LLM actors' is the engine's batch plus its queue, which per-call counting would overfill."""
    from app.batch.config import PoolConfig
    from app.batch.pool import ActorPool, Member

    async def scenario():
        p = ActorPool("media", object, lambda i: (), PoolConfig(min_size=2, max_size=2, max_in_flight=8), 0)
        a, b = Member("a", 8), Member("b", 8)
        p.members = [a, b]
        first = await p.acquire(5)
        second = await p.acquire(5)
        third = await p.acquire(3)
        loads = [first[0].handle, second[0].handle, third[0].handle], (a.in_flight, b.in_flight)
        big = asyncio.ensure_future(p.acquire(20))  # more rows than any actor holds: waits for an idle one
        await asyncio.sleep(0.05)
        waited = not big.done()
        await p.release(*second)  # b is idle now
        got = await asyncio.wait_for(big, 5)
        return loads, waited, (got[0].handle, got[1]), (a.in_flight, b.in_flight)

    loads, waited, big, after = asyncio.run(scenario())
    assert loads == (["a", "b", "a"], (8, 5))
    assert waited and big == ("b", 8) and after == (8, 8)


def _stages(monkeypatch, once, retries=2):
    from app.batch import job

    monkeypatch.setattr(job, "RETRY_DELAY_S", 0)
    stages = job.Stages.__new__(job.Stages)  # its pools are not used: _once is replaced
    stages.cfg = BatchConfig(max_retries=retries)
    stages._once = once
    return stages


def _rows():
    from app.batch.io import Row

    return [Row(1, "a", {}), Row(2, "b", {}), Row(3, "c", {}),
            Row(4, "line-4", None, ClientError("the line is not a JSON object", code="invalid_json"))]


def test_a_chunk_sends_again_only_its_busy_rows_and_answers_every_row_in_order(monkeypatch):
    """A row the engine had no room for (Busy) is sent again with the others of its chunk that were
    also refused, up to max_retries; the chunk's answered rows are not sent twice."""
    from app.batch import job
    from app.batch.workers import Busy

    calls = []

    async def once(rows):
        calls.append([r.id for r in rows])
        return [Busy("engine full") if r.id == "b" or (r.id == "c" and len(calls) == 1)
                else ({"id": r.id, "response": {}}, 1) for r in rows]

    out = asyncio.run(_stages(monkeypatch, once).run_chunk(_rows()))
    assert calls == [["a", "b", "c"], ["b", "c"], ["b"]]
    assert [rec["id"] for rec, _ in out] == ["a", "b", "c", "line-4"]
    assert out[0] == ({"id": "a", "response": {}}, 1) and out[2] == ({"id": "c", "response": {}}, 1)
    # out of tries: the server's trouble, left for a rerun (job._final), not the row's final answer
    assert out[1][0]["status"] == 503 and out[1][0]["error"]["code"] == "server_unavailable"
    assert not job._final(out[1][0]) and all(job._final(rec) for i, (rec, _) in enumerate(out) if i != 1)
    assert "engine full" in out[1][0]["error"]["message"] and out[1][1] == 0
    assert out[3][0]["status"] == 400 and out[3][0]["error"]["code"] == "invalid_json"


def test_a_chunk_whose_actor_died_is_sent_again_whole_and_one_that_broke_is_sent_row_by_row(monkeypatch):
    from app.batch import job

    calls = []

    async def dies_once(rows):
        calls.append(len(rows))
        if len(calls) == 1:
            raise job._Retry("llm actor lost")
        return [({"id": r.id}, 0) for r in rows]

    out = asyncio.run(_stages(monkeypatch, dies_once).run_chunk(_rows()))
    assert calls == [3, 3] and [rec for rec, _ in out[:3]] == [{"id": "a"}, {"id": "b"}, {"id": "c"}]

    calls.clear()

    async def breaks(rows):
        calls.append(len(rows))
        raise KeyError("usage")

    out = asyncio.run(_stages(monkeypatch, breaks).run_chunk(_rows()))
    assert calls == [3, 1, 1, 1]  # the chunk once, then each row alone, once
    assert all(rec["status"] == 500 and "KeyError" in rec["error"]["message"] for rec, _ in out[:3])
    assert out[3][0]["error"]["code"] == "invalid_json"

    calls.clear()

    async def one_poison_row(rows):  # e.g. a row that cannot be pickled fails the whole call it is in
        calls.append([r.id for r in rows])
        if any(r.id == "b" for r in rows):
            raise RecursionError("maximum recursion depth exceeded while pickling")
        return [({"id": r.id}, 0) for r in rows]

    out = asyncio.run(_stages(monkeypatch, one_poison_row).run_chunk(_rows()))
    assert calls[0] == ["a", "b", "c"] and sorted(map(tuple, calls[1:])) == [("a",), ("b",), ("c",)]
    assert [rec for rec, _ in out[:1]] == [{"id": "a"}] and out[2][0] == {"id": "c"}
    assert out[1][0]["status"] == 500 and "RecursionError" in out[1][0]["error"]["message"]


def test_callers_are_served_in_turn_so_a_large_chunk_is_not_starved_by_smaller_later_ones():
    """A chunk larger than an actor's capacity needs an idle actor; before, one-row calls arriving
    after it (a last partial chunk, retried rows) took the free slots and kept the actor busy."""
    from app.batch.config import PoolConfig
    from app.batch.pool import ActorPool, Member

    async def scenario():
        p = ActorPool("media", object, lambda i: (), PoolConfig(min_size=1, max_size=2, max_in_flight=8), 0)
        p.members = [Member("a", 8)]
        grows = []
        p._grow = lambda: grows.append(len(p._turns))  # would start a second actor
        first = await p.acquire(1)
        big = asyncio.ensure_future(p.acquire(16))
        await asyncio.sleep(0.01)
        small = asyncio.ensure_future(p.acquire(1))  # room for it, but the large chunk came first
        await asyncio.sleep(0.01)
        waiting = (big.done(), small.done())
        assert grows and all(n == 1 for n in grows)  # only the chunk without room asked for an actor
        await p.release(*first)
        got_big = await asyncio.wait_for(big, 5)
        await asyncio.sleep(0.01)
        small_while_big = small.done()
        await p.release(*got_big)
        got_small = await asyncio.wait_for(small, 5)
        return waiting, got_big[1], small_while_big, got_small[1], len(p._turns)

    assert asyncio.run(scenario()) == ((False, False), 8, False, 1, 0)


def test_one_rows_encoder_error_is_that_rows_answer_and_the_chunks_others_generate():
    """Non-fused stages: the encoder answers per row (embeddings, or that row's Failure or Busy), and
    the LLM stage passes a row's encoder answer on instead of generating it."""
    from app.batch.workers import Busy, EncoderWorker, Failure, LLMWorker, Prepared

    class Service:
        async def encode_async(self, payload):
            if payload == ["boom"]:
                raise ValueError("bad grid")
            if payload == ["full"]:
                raise ClientError("encoder overloaded", status=503, type="server_error")
            if payload == ["bad"]:
                raise ClientError("too many patches", param="messages")
            return [f"emb-{payload[0]}"]

    enc = EncoderWorker.__new__(EncoderWorker)
    enc.service = Service()
    items, encoded = asyncio.run(enc.encode_many([["a"], ["boom"], [], ["full"], ["bad"]]))
    assert items == 4 and encoded[0] == ["emb-a"] and encoded[2] == []
    assert isinstance(encoded[1], Failure) and encoded[1].status == 500 and "ValueError" in encoded[1].error["message"]
    assert isinstance(encoded[3], Busy) and encoded[3].message == "encoder overloaded"
    assert isinstance(encoded[4], Failure) and encoded[4].status == 400

    llm = LLMWorker.__new__(LLMWorker)

    async def generate(prepared, embeddings):
        return {"embeddings": embeddings}

    llm.generate = generate
    media_failed = Failure(400, {"message": "bad image"})
    prepared = [Prepared(None, {}, 1), Prepared(None, {}, 1), Prepared(None, {}, 0), Prepared(None, {}, 1),
                media_failed]
    out = asyncio.run(llm.generate_many(prepared, encoded))
    assert out[0] == {"embeddings": ["emb-a"]} and out[2] == {"embeddings": []}
    assert out[1] is encoded[1] and out[3] is encoded[3] and out[4] is media_failed


def test_rows_that_fail_for_the_servers_reasons_are_left_for_a_rerun_which_answers_each_once(
        tmp_path, monkeypatch, capsys):
    """`python -m app.batch` with the real driver and retries, the stages faked without Ray. In the first
    run one row's engine stays full, one chunk's actor stays unreachable, then the LLM pool's only actor
    dies and its replacements fail to start (the pool gives up). Before, those rows were written as
    `server_error` lines, so the rerun skipped them and they never got an answer; the job exited 0. Now
    they are not written, the job stops starting rows, exits 75 saying how many rows are left, and the
    rerun answers exactly those; the input's own errors are final, written once and never sent again."""
    import ray

    from app.batch import __main__ as cli
    from app.batch import job
    from app.batch.workers import Busy, Failure

    monkeypatch.setattr(job, "RETRY_DELAY_S", 0)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # no cluster: Stages below needs none
    monkeypatch.setattr(ray, "kill", lambda handle: None)
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    ids = [f"r{i:02d}" for i in range(16)]
    lines = [json.dumps({"id": rid, **body}) for rid in ids]
    lines[2] = "{oops"  # not JSON: a final error under the id line-3
    lines[3] = json.dumps({"id": "bad-media", **body})  # the media stage refuses it: a final error too
    src = write_lines(tmp_path / "in.jsonl", lines)
    every = {"line-3", "bad-media"} | {rid for rid in ids if rid not in ("r02", "r03")}
    out = tmp_path / "out"
    calls: list[str] = []
    faults = {"on": True}

    def answer(row):
        if faults["on"] and row.id == "r01":
            return Busy("engine full")  # every try: its retries run out
        if row.id == "bad-media":
            return job._error(row, Failure(400, {"message": "unsupported media", "code": "invalid_media"})), 0
        return {"id": row.id, "response": {}, "usage": {"completion_tokens": 1, "prompt_tokens": 3}}, 1

    class Stages(_one_pool_stages()):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.llm._grow = lambda: None  # a replacement's start is what fails below

        async def _once(self, rows):
            calls.extend(r.id for r in rows)
            m, taken = await self.llm.acquire(len(rows))
            dies = faults["on"] and "r07" in {r.id for r in rows}
            try:
                if dies:  # the only actor died; its replacements fail to start: the pool gives up
                    self.llm.failed, self.llm.start_failures = RuntimeError("CUDA out of memory"), 5
                    raise job._Retry("llm actor lost")
                if faults["on"] and "r05" in {r.id for r in rows}:
                    raise job._Retry("llm actor unavailable")  # for every try of this chunk (r04, r05)
                return [answer(r) for r in rows]
            finally:
                await self.llm.release(m, taken, dead=dies)

    monkeypatch.setattr(job, "Stages", Stages)
    argv = ["--input", str(src), "--output", str(out), "--chunk-rows", "2"]

    assert cli.main(argv) == 75  # RETRY_EXIT: EX_TEMPFAIL
    first, n_lines = _read_shards(out)
    report = json.loads((out / "report.json").read_text())
    message = capsys.readouterr().err
    assert not {"r01", "r04", "r05", "r06", "r07"} & set(first)  # the failed rows are not written as done
    assert {"r00", "line-3", "bad-media"} <= set(first) and n_lines == len(first)
    assert all(rec.get("status", 200) < 500 for rec in first.values())  # no server error is final
    assert report["left"] == len(every) - len(first) > 0 and report["failed"] == 2
    assert f"{report['left']} of 16 rows have no answer yet" in message and "run the same command" in message
    assert "PoolFailed" in report["left_error"] and "CUDA out of memory" in report["left_error"]
    assert "r15" not in calls  # the pool gave up: no more rows were started

    # the same trouble again: the rows not started still count the earlier run's among them as skipped
    assert cli.main(argv) == 75
    second, n_lines = _read_shards(out)
    report = json.loads((out / "report.json").read_text())
    assert n_lines == len(second) and report["skipped"] == len(first)
    assert report["done"] + report["failed"] + report["left"] == 16 - len(first) == len(every) - len(first)
    assert report["left"] == len(every) - len(second)
    assert f"{report['left']} of 16 rows have no answer yet" in capsys.readouterr().err

    faults["on"] = False
    before = len(calls)
    assert cli.main(argv) == 0
    final, n_lines = _read_shards(out)
    assert sorted(calls[before:]) == sorted(every - set(second))  # exactly the rows left, each once
    assert set(final) == every and n_lines == len(every)  # each row once in the output
    assert final["line-3"]["error"]["code"] == "invalid_json" and final["bad-media"]["status"] == 400
    assert calls.count("bad-media") == 1  # a client error is final: never sent again
    report = json.loads((out / "report.json").read_text())
    assert (report["skipped"], report["left"], report["left_error"]) == (len(second), 0, None)
    assert "no answer yet" not in capsys.readouterr().err


def _one_pool_stages():
    """job.Stages with one LLM pool of one actor and no Ray: the real run_chunk (retries) and failed_pool;
    a test gives `_once`, the stages' work for a chunk."""
    from app.batch import job
    from app.batch.config import PoolConfig
    from app.batch.pool import ActorPool, Member

    class OnePool(job.Stages):
        def __init__(self, cfg):
            self.cfg = cfg
            self.llm = ActorPool("llm", object, lambda i: (), PoolConfig(max_in_flight=4), 0)
            self.llm.members = [Member("actor", 4)]
            self.pools = {"llm": self.llm}

        async def start(self):
            pass

        async def encoder_stats(self):
            return {}

    return OnePool


def _read_shards(out) -> tuple[dict[str, dict], int]:
    """(records by id, lines in all shards)."""
    lines = [line for shard in sorted(out.glob("part-*.jsonl")) for line in shard.read_text().splitlines()]
    return {rec["id"]: rec for rec in map(json.loads, lines)}, len(lines)


def test_a_rows_own_unexpected_error_is_final_and_the_media_budgets_503_is_retried_in_the_run(
        tmp_path, monkeypatch, capsys):
    """Two rows' trouble that is not the cluster's: a row whose own call raises every time (one that
    cannot be pickled, say) would fail again on every rerun, so it is written as its final 500 and never
    sent again (left for a rerun, the job could never finish); a media stage out of room (the byte
    budget's 503) is the server's trouble for now, so the row is sent again in the same run and answered."""
    import ray

    from app.batch import __main__ as cli
    from app.batch import job
    from app.batch.workers import Busy

    monkeypatch.setattr(job, "RETRY_DELAY_S", 0)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "kill", lambda handle: None)
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    ids = [f"r{i}" for i in range(6)]
    src = write_lines(tmp_path / "in.jsonl", [json.dumps({"id": rid, **body}) for rid in ids])
    out = tmp_path / "out"
    calls: list[str] = []
    full = {"r4": 2}  # the media stage has no room for r4 twice, then has

    class Stages(_one_pool_stages()):
        async def _once(self, rows):
            calls.extend(r.id for r in rows)
            if "r2" in {r.id for r in rows}:
                raise TypeError("cannot pickle '_thread.lock' object")  # r2's own, every time
            answers = []
            for r in rows:
                if full.get(r.id):
                    full[r.id] -= 1
                    answers.append(Busy("media payloads in flight on this replica are at their limit"))
                else:
                    answers.append(({"id": r.id, "response": {}, "usage": {"completion_tokens": 1, "prompt_tokens": 3}}, 0))
            return answers

    monkeypatch.setattr(job, "Stages", Stages)
    argv = ["--input", str(src), "--output", str(out), "--chunk-rows", "2"]
    assert cli.main(argv) == 0  # nothing left for a rerun
    got, n_lines = _read_shards(out)
    assert set(got) == set(ids) and n_lines == len(ids)
    assert got["r2"]["status"] == 500 and got["r2"]["error"]["type"] == "server_error"
    assert "response" in got["r4"] and calls.count("r4") == 3  # two 503s, then answered in the same run
    report = json.loads((out / "report.json").read_text())
    assert (report["failed"], report["left"]) == (1, 0)
    before = calls.count("r2")
    assert cli.main(argv) == 0 and calls.count("r2") == before  # the rerun sends nothing again


def test_the_media_stage_answers_a_5xx_as_busy_and_the_llm_stage_passes_it_on():
    """`MediaWorker.prepare` returns Busy for a 5xx from preparing (the media budget's `overloaded`), a
    Failure for a client error; the LLM stage's `_many` hands a Busy row back untouched, for the driver
    to send again."""
    from app.batch.workers import Busy, Failure, LLMWorker, MediaWorker
    from app.errors import ClientError, Overloaded

    class Chat:
        def __init__(self, e):
            self.e = e

        async def prepare(self, body):
            raise self.e

    worker = MediaWorker.__new__(MediaWorker)
    worker.chat = Chat(Overloaded("media payloads in flight are at their limit"))
    busy, payload = asyncio.run(worker.prepare({}))
    assert isinstance(busy, Busy) and payload == []
    worker.chat = Chat(ClientError("bad image", param="messages"))
    failure, _ = asyncio.run(worker.prepare({}))
    assert isinstance(failure, Failure) and failure.status == 400

    async def never(p, x):
        raise AssertionError("a Busy row must not be generated")

    llm = LLMWorker.__new__(LLMWorker)
    assert asyncio.run(llm._many([busy, failure], never, [[], []])) == [busy, failure]
