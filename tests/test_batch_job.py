"""The batch job on Ray (CPU, tiny model): 200 mixed rows, a SIGKILL and a resume, and equality with
the HTTP server. One Ray cluster for the module; the server runs on it beside the job's actors."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from deployments.ray_env import apply_serve_env
from helpers import mp4_bytes, png_bytes

pytestmark = pytest.mark.integration
PORT = 8775
ROOT = Path(__file__).resolve().parents[1]
APP_ARGS = {"model": "embedded:tiny", "encoder": {"min_budget": 64, "max_budget": 1024, "batch_wait_ms": 20},
            "media": {"max_input_pixels": 1_000_000, "max_items_per_request": 4, "max_frames_per_request": 10}}
N_ROWS, MALFORMED = 200, 5


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def user(content, **kw) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0, **kw}


# The body that is also sent to the HTTP server (with log-probabilities, two seeded choices, a JSON
# schema and a tool the prompt lists: batch rows carry them too).
PROBE = user([{"type": "image_url", "image_url": {"url": data_url(png_bytes(72, 104, seed=42), "image/png")}},
              {"type": "text", "text": "Is there a cat?"}], max_tokens=8, logprobs=True, top_logprobs=2,
             n=2, temperature=1.0, seed=9,
             response_format={"type": "json_schema", "json_schema": {"name": "yn", "schema": {"enum": ["yes", "no"]}}},
             tools=[{"type": "function", "function": {"name": "zoom", "description": "Zoom into the image",
                                                      "parameters": {"type": "object"}}}])


def dataset(tmp: Path) -> tuple[Path, Path, set[str]]:
    """200 lines: images (data URLs and files under the root), videos, text only, the probe, and 5
    malformed lines. Returns the input, the file root and the ids of the malformed lines."""
    root = tmp / "media"
    root.mkdir()
    images = [png_bytes(48 + 16 * (i % 4), 64 + 16 * (i % 3), seed=i) for i in range(8)]
    videos = [mp4_bytes(6 + 2 * (i % 2), seed=i) for i in range(4)]
    for i, img in enumerate(images[:4]):
        (root / f"img{i}.png").write_bytes(img)
    lines = []
    for i in range(N_ROWS - MALFORMED - 1):
        text = {"type": "text", "text": f"Row {i}: what is shown?"}
        if i % 4 == 0:
            content = [{"type": "image_url", "image_url": {"url": data_url(images[i % 8], "image/png")}}, text]
        elif i % 4 == 1:
            url = f"img{i % 4}.png" if i % 8 == 1 else f"file://{root}/img{i % 4}.png"
            content = [text, {"type": "image_url", "image_url": {"url": url}}]
        elif i % 4 == 2:
            content = [{"type": "video_url", "video_url": {"url": data_url(videos[i % 4], "video/mp4")}}, text]
        else:
            content = f"Row {i}: tell me something."
        lines.append(json.dumps({"id": f"req-{i}", **user(content)}))
    lines.insert(97, json.dumps({"id": "probe", **PROBE}))
    bad = {
        "line-11": "{\"id\": \"broken\", \"messages\": [",  # not JSON: its id cannot be read
        "bad-image": json.dumps({"id": "bad-image", **user([{"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(b"not an image at all").decode()}}])}),
        "escape": json.dumps({"id": "escape", **user([{"type": "image_url", "image_url": {
            "url": "../../etc/passwd"}}])}),
        "bad-part": json.dumps({"id": "bad-part", **user([{"type": "audio", "audio": "x"}])}),
        "no-messages": json.dumps({"id": "no-messages", "max_tokens": 3}),
    }
    for pos, line in zip((10, 50, 120, 160, 190), bad.values()):
        lines.insert(pos, line)
    assert lines[10].startswith("{\"id\": \"broken\"")
    path = tmp / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, root, set(bad)


def batch_config(tmp: Path, root: Path, model_cache: str, shard_rows: int) -> Path:
    # The batch defaults keep the encoder's window even when it was idle; 100 ms (not the server's 20)
    # so that on a loaded 2-core CI machine, where media trickles in, items of different rows still
    # meet in one batch (the assertions on items_per_batch below).
    app = APP_ARGS | {"cache_dir": model_cache, "encoder": APP_ARGS["encoder"] | {"batch_wait_ms": 100}}
    cfg = {"app": app, "file_root": str(root), "shard_rows": shard_rows,
           "flush_interval_s": 600, "progress_interval_s": 1,
           "media_pool": {"min_size": 1, "max_size": 2, "num_cpus": 0.5, "max_in_flight": 4},
           "encoder_pool": {"num_cpus": 0.5}, "llm_pool": {"num_cpus": 0.5}}
    path = tmp / f"batch-{shard_rows}.json"
    path.write_text(json.dumps(cfg))
    return path


def read_output(out: Path) -> tuple[list[dict], dict[str, bytes]]:
    shards = {f.name: f.read_bytes() for f in sorted(out.glob("part-*.jsonl"))}
    return [json.loads(line) for data in shards.values() for line in data.splitlines()], shards


@pytest.fixture(scope="module")
def cluster(model_cache, tmp_path_factory):
    ray = pytest.importorskip("ray")
    from ray import serve

    from deployments.app import build_app

    apply_serve_env()  # as `make serve` starts Ray
    ray.init(num_cpus=5, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    serve.run(build_app(APP_ARGS | {"cache_dir": model_cache}), name="vlm", route_prefix="/")
    tmp = tmp_path_factory.mktemp("batch")
    path, root, bad = dataset(tmp)
    try:
        yield {"tmp": tmp, "input": path, "root": root, "bad": bad, "model_cache": model_cache,
               "address": ray.get_runtime_context().gcs_address}
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def full_run(cluster):
    """The whole input in one run, in this process (connected to the module's cluster)."""
    from app.batch.config import BatchConfig
    from app.batch.job import run_job

    cfg = BatchConfig.load(str(batch_config(cluster["tmp"], cluster["root"], cluster["model_cache"], 64)))
    out = cluster["tmp"] / "full"
    log = io.StringIO()
    report = asyncio.run(run_job(cfg, str(cluster["input"]), str(out), progress_stream=log))
    return report, out, log.getvalue()


def test_two_hundred_mixed_rows_each_answered_once(cluster, full_run):
    report, out, log = full_run
    rows, shards = read_output(out)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == N_ROWS
    assert list(shards) == ["part-00000.jsonl", "part-00001.jsonl", "part-00002.jsonl", "part-00003.jsonl"]
    errors = {r["id"]: r for r in rows if "error" in r}
    assert set(errors) == cluster["bad"]
    assert {k: (v["status"], v["error"]["code"]) for k, v in errors.items()} == {
        "line-11": (400, "invalid_json"), "bad-image": (400, "invalid_image"), "escape": (400, "invalid_media_url"),
        "bad-part": (400, "unsupported_content_type"), "no-messages": (400, None)}
    assert errors["line-11"]["line"] == 11 and errors["no-messages"]["error"]["param"] == "messages"
    kinds = {"image": 0, "video": 0, "text": 0}
    for r in rows:
        if "error" in r:
            continue
        resp, u = r["response"], r["usage"]
        assert resp["object"] == "chat.completion" and resp["usage"] == u and resp["model"] == "tiny"
        n = 2 if r["id"] == "probe" else 1
        assert [c["index"] for c in resp["choices"]] == list(range(n))
        assert all(c["finish_reason"] in ("stop", "length") for c in resp["choices"])
        assert 0 < u["completion_tokens"] <= 6 * n
        d = u["prompt_tokens_details"]
        assert d["image_tokens"] + d["video_tokens"] == d["vision_embeddings"]
        kinds["image" if d["image_tokens"] else "video" if d["video_tokens"] else "text"] += 1
    assert kinds == {"image": 99, "video": 48, "text": 48}  # 98 image rows + the probe
    assert (report["done"], report["failed"], report["skipped"]) == (N_ROWS - MALFORMED, MALFORMED, 0)
    assert report["media_items"] == 147 and report["completion_tokens"] == sum(
        r["usage"]["completion_tokens"] for r in rows if "usage" in r)
    enc = report["encoder"]
    assert enc["graph_hits"] + enc["eager_batches"] == enc["batches"] > 0
    # items of different rows shared batches (file images repeat: some come from the cache)
    assert enc["items_per_batch"] > 1.0 and enc["cache_hits"] > 0
    assert json.loads((out / "report.json").read_text())["done"] == N_ROWS - MALFORMED
    assert "rows/s" in log and "ETA" in log and f"{N_ROWS}/{N_ROWS} rows" in log


def test_a_rerun_of_a_finished_job_skips_everything(cluster, full_run):
    from app.batch.config import BatchConfig
    from app.batch.job import run_job

    _, out, _ = full_run
    before = read_output(out)[1]
    cfg = BatchConfig.load(str(batch_config(cluster["tmp"], cluster["root"], cluster["model_cache"], 64)))
    report = asyncio.run(run_job(cfg, str(cluster["input"]), str(out), progress_stream=io.StringIO()))
    assert (report["done"], report["failed"], report["skipped"]) == (0, 0, N_ROWS)
    assert read_output(out)[1] == before


def test_batch_answer_equals_the_http_servers(cluster, full_run):
    rows = {r["id"]: r for r in read_output(full_run[1])[0]}
    got = httpx.post(f"http://127.0.0.1:{PORT}/v1/chat/completions", json=PROBE, timeout=120)
    assert got.status_code == 200, got.text
    want, ours = got.json(), rows["probe"]["response"]
    assert ours["usage"]["prompt_tokens_details"]["image_tokens"] > 0
    assert ours["usage"] == want["usage"] and ours["model"] == want["model"]
    without_tools = httpx.post(f"http://127.0.0.1:{PORT}/v1/chat/completions", timeout=120,
                               json={k: v for k, v in PROBE.items() if k != "tools"}).json()
    assert ours["usage"]["prompt_tokens"] > without_tools["usage"]["prompt_tokens"]  # the tool is listed in both
    # the same tokens in both choices; their log-probabilities equal up to float32 rounding (batched
    # here, alone there)
    lp_ours, lp_want = ([c.pop("logprobs")["content"] for c in r["choices"]] for r in (ours, want))
    assert ours["choices"] == want["choices"] and len(ours["choices"]) == 2
    assert all(json.loads(c["message"]["content"]) in ("yes", "no") and c["finish_reason"] == "stop"
               and "tool_calls" not in c["message"] for c in ours["choices"])
    assert sum(map(len, lp_ours)) == sum(map(len, lp_want)) == ours["usage"]["completion_tokens"]

    def close(a: dict, b: dict) -> bool:
        return (a["token"], a["bytes"]) == (b["token"], b["bytes"]) and abs(a["logprob"] - b["logprob"]) <= 1e-4

    for a, b in zip(sum(lp_ours, []), sum(lp_want, []), strict=True):
        assert close(a, b) and len(a["top_logprobs"]) == 2
        assert all(close(x, y) for x, y in zip(a["top_logprobs"], b["top_logprobs"], strict=True))


def test_a_fused_job_encodes_in_its_llm_actors_and_answers_the_same(cluster, full_run):
    """Serving's `fused` placement in the batch job: no encoder pool, the LLM actors encode; the
    answers (and usage) of the first 80 rows equal the three-stage run's."""
    from app.batch.config import BatchConfig
    from app.batch.job import run_job

    tmp = cluster["tmp"]
    head = tmp / "head.jsonl"
    head.write_text("".join(cluster["input"].read_text().splitlines(keepends=True)[:80]))
    conf = json.loads(batch_config(tmp, cluster["root"], cluster["model_cache"], 64).read_text())
    conf["app"]["placement"] = {"policy": "fused"}
    path = tmp / "batch-fused.json"
    path.write_text(json.dumps(conf))
    out = tmp / "fused"
    report = asyncio.run(run_job(BatchConfig.load(str(path)), str(head), str(out), progress_stream=io.StringIO()))
    assert set(report["pools"]) == {"media", "llm"}
    assert report["encoder"]["batches"] > 0 and report["encoder"]["items_per_batch"] > 1.0
    want = {r["id"]: r for r in read_output(full_run[1])[0]}
    rows = read_output(out)[0]
    assert len(rows) == report["done"] + report["failed"] > 60
    for r in rows:
        if "error" in r:
            assert r["error"] == want[r["id"]]["error"]
        else:
            assert r["response"]["choices"] == want[r["id"]]["response"]["choices"]
            assert r["usage"] == want[r["id"]]["usage"]


def test_sigkill_then_resume_completes_without_duplicates(cluster, full_run):
    tmp = cluster["tmp"]
    out = tmp / "killed"
    cfg = batch_config(tmp, cluster["root"], cluster["model_cache"], 16)
    cmd = [sys.executable, "-m", "app.batch", "--input", str(cluster["input"]), "--output", str(out),
           "--config", str(cfg), "--address", cluster["address"]]
    log = open(tmp / "killed.log", "wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 150
    while not (out / "part-00002.jsonl").exists():
        assert proc.poll() is None, (tmp / "killed.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "no shards within 150 s"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "report.json").exists()  # killed before the end
    partial, before = read_output(out)
    assert 3 * 16 <= len(partial) < N_ROWS and len({r["id"] for r in partial}) == len(partial)

    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout[done.stdout.index("{"):])
    rows, after = read_output(out)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == N_ROWS
    assert set(ids) == {r["id"] for r in read_output(full_run[1])[0]}
    assert all(after[name] == data for name, data in before.items())  # earlier shards untouched
    assert report["skipped"] == len(partial) and report["done"] + report["failed"] == N_ROWS - len(partial)
    assert not list(out.glob(".*.tmp"))


def test_a_pool_grows_while_calls_wait_and_shrinks_when_idle(cluster):
    from app.batch.config import PoolConfig
    from app.batch.pool import ActorPool

    class Sleeper:  # defined here, so Ray ships it by value
        def ready(self) -> bool:
            return True

        async def work(self, seconds: float) -> int:
            await asyncio.sleep(seconds)
            return os.getpid()

    async def scenario():
        pool = ActorPool("test", Sleeper, lambda i: (), PoolConfig(min_size=1, max_size=2, num_cpus=0,
                                                                    max_in_flight=2, idle_s=0.5), 0)
        await pool.start()
        assert len(pool.members) == 1

        async def call():
            m, taken = await pool.acquire()
            try:
                return await m.handle.work.remote(3.0)
            finally:
                await pool.release(m, taken)

        pids = await asyncio.gather(*(call() for _ in range(6)))  # three times one actor's slots
        sizes = (pool.peak, len(set(pids)))
        await asyncio.sleep(0.6)
        await pool.shrink()
        after = len(pool.members)
        await pool.close()
        return sizes, after

    (peak, actors_used), after = asyncio.run(scenario())
    assert peak == 2 and actors_used == 2 and after == 1
