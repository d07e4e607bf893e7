"""Batch jobs submitted to a running multi-node Ray cluster with `ray job submit` (CPU, tiny model).

The cluster is started node by node with `ray start` (tests/cluster_harness.py: RayStartCluster): a head with
the dashboard, whose job server `ray job submit` talks to, and no CPUs (so that the job's actors run on the
workers, as on KubeRay), and two workers of 2 CPUs each with their own temp dirs and custom resources.
1. A small job runs to completion; every row is answered once, as the one-process pipeline answers it.
2. A longer job loses the worker that holds its LLM actor mid-job (SIGKILL of that node's raylet and
   every process of it); the job's retries (app/batch/job.py: a chunk whose actor died, or whose media
   were on the lost node, is sent again) finish it on the other worker, with every row answered exactly
   once and none failed. With CLUSTER_JOB_RESULTS=path the figures are written there
   (benchmarks/results/cluster_job_node_kill_cpu.json).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import json
import os
import re
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml

from cluster_harness import RayStartCluster, wait_for
from helpers import png_bytes

pytestmark = pytest.mark.integration
APP = {"model": "embedded:tiny", "encoder": {"min_budget": 64, "max_budget": 1024}, "placement": {"policy": "fused"}}
TOKENS = 24
JOB_BOUND_S = 240
RESULTS = os.environ.get("CLUSTER_JOB_RESULTS")  # the JSON of the node-loss run, when asked


def body(i: int) -> dict:
    url = "data:image/png;base64," + base64.b64encode(png_bytes(48 + 8 * (i % 3), 64, seed=i % 5)).decode()
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": f"row {i}: what is it?"}]}],
            "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}


def write_input(path: Path, rows: int) -> set[str]:
    path.write_text("".join(json.dumps({"id": f"r{i}", **body(i)}) + "\n" for i in range(rows)))
    return {f"r{i}" for i in range(rows)}


def write_config(path: Path, model_cache: str) -> None:
    path.write_text(yaml.safe_dump({
        "app": APP | {"cache_dir": model_cache}, "shard_rows": 8, "chunk_rows": 4, "flush_interval_s": 2,
        "progress_interval_s": 1, "max_retries": 5,
        "media_pool": {"min_size": 1, "max_size": 1, "num_cpus": 1, "max_in_flight": 8},
        "llm_pool": {"min_size": 1, "max_size": 1, "num_cpus": 1}}))


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("ray")
    try:
        import ray.dashboard.modules.job.job_head  # noqa: F401  (the job server is part of the dashboard)
    except ImportError as e:  # ray without the `default` extra
        pytest.skip(f"the Ray dashboard (job server) is not installed: {e}")
    c = RayStartCluster(head_cpus=0)
    try:
        c.add_worker("worker-a", 2)
        c.add_worker("worker-b", 2)
        yield c
    finally:
        c.shutdown()


def submit(cluster: RayStartCluster, tmp: Path, model_cache: str, rows: int) -> tuple[str, Path, set[str]]:
    """`ray job submit --no-wait` of `python -m app.batch`; returns the submission id, output dir and ids."""
    ids = write_input(tmp / "in.jsonl", rows)
    write_config(tmp / "batch.yaml", model_cache)
    sid = f"vlm-batch-{uuid.uuid4().hex[:8]}"
    out = tmp / "out"
    cmd = ["ray", "job", "submit", f"--address={cluster.dashboard_url}", f"--submission-id={sid}", "--no-wait",
           "--", "python", "-m", "app.batch", "--config", str(tmp / "batch.yaml"), "--input", str(tmp / "in.jsonl"),
           "--output", str(out)]
    done = subprocess.run(cmd, env=cluster.env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return sid, out, ids


def cli(cluster: RayStartCluster, *args: str) -> str:
    """A `ray` command against the cluster's dashboard, in the cluster's environment (token authentication
    is read per process: this test process's Ray client may have fixed another mode already)."""
    done = subprocess.run(["ray", *args, f"--address={cluster.dashboard_url}"], env=cluster.env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def status(cluster: RayStartCluster, sid: str) -> str:
    """PENDING, RUNNING, SUCCEEDED, FAILED or STOPPED (`ray job status` says the last three as a sentence)."""
    text = cli(cluster, "job", "status", sid)
    ended = re.search(r"Job '[^']+' (succeeded|failed|was stopped|stopped)", text)
    if ended:
        return {"succeeded": "SUCCEEDED", "failed": "FAILED"}.get(ended.group(1), "STOPPED")
    found = re.search(r"Status for job '[^']+': (\w+)", text)
    return found.group(1) if found else text[-200:]


def logs(cluster: RayStartCluster, sid: str) -> str:
    return cli(cluster, "job", "logs", sid)


def finish(cluster: RayStartCluster, sid: str) -> float:
    t0 = time.monotonic()
    final = wait_for(lambda: (s := status(cluster, sid)) in ("SUCCEEDED", "FAILED", "STOPPED") and s, JOB_BOUND_S,
                     f"job {sid} to end", every_s=1)
    assert final == "SUCCEEDED", logs(cluster, sid)[-4000:]
    return time.monotonic() - t0


def answers(out: Path) -> list[dict]:
    """The rows written so far (whole shards only: each is renamed into place when complete)."""
    return [json.loads(line) for shard in sorted(out.glob("part-*.jsonl")) for line in shard.read_text().splitlines()]


def check_every_row_once(out: Path, ids: set[str]) -> dict:
    records = answers(out)
    counts = collections.Counter(r["id"] for r in records)
    assert set(counts) == ids and set(counts.values()) == {1}, {k: v for k, v in counts.items() if v != 1}
    failed = [r for r in records if "response" not in r]
    assert not failed, failed[:3]
    report = json.loads((out / "report.json").read_text())
    assert report["done"] == len(ids) and report["failed"] == 0, report
    return report


def reference_texts(model_cache: str, rows: list[int]) -> dict[int, str]:
    from app.checkpoints.model_builder import resolve_model
    from app.config import AppConfig
    from helpers import local_chat

    cfg = AppConfig(**(APP | {"cache_dir": model_cache}))
    chat = local_chat(cfg, resolve_model(cfg.model, cfg.cache_dir))

    async def one(b):
        return (await chat.complete(*(await chat.prepare(b))))["choices"][0]["message"]["content"]

    return {i: asyncio.run(one(body(i))) for i in rows}


def test_a_job_submitted_to_the_cluster_runs_to_completion(cluster, tmp_path, model_cache):
    sid, out, ids = submit(cluster, tmp_path, model_cache, rows=8)
    took = finish(cluster, sid)
    check_every_row_once(out, ids)
    want = reference_texts(model_cache, list(range(8)))
    got = {int(r["id"][1:]): r["response"]["choices"][0]["message"]["content"] for r in answers(out)}
    assert got == want
    print(f"8-row job on the cluster: {took:.1f} s from submission")


def actor_node(cluster: RayStartCluster, class_name: str) -> str | None:
    out = cli(cluster, "list", "actors", "--format=json", f"--filter=class_name={class_name}", "--filter=state=ALIVE")
    actors = json.loads(out[out.index("["):]) if "[" in out else []
    return actors[0]["node_id"] if actors else None


def node_names(cluster: RayStartCluster) -> dict[str, str]:
    """Ray node id -> our node name (the custom resource each node was started with)."""
    out = cli(cluster, "list", "nodes", "--format=json", "--detail", "--filter=state=ALIVE")
    return {n["node_id"]: next(ours.name for ours in cluster.nodes if ours.name in n["resources_total"])
            for n in json.loads(out[out.index("["):])}


def test_a_node_lost_mid_job_every_row_answered_exactly_once(cluster, tmp_path, model_cache):
    rows = 960  # 30-40 s of work at the tiny model's pace here: the kill lands mid-job
    names = node_names(cluster)
    sid, out, ids = submit(cluster, tmp_path, model_cache, rows=rows)
    t0 = time.monotonic()
    llm_node = wait_for(lambda: actor_node(cluster, "LLMWorker"), JOB_BOUND_S, "the job's LLM actor", every_s=1)
    victim = next(n for n in cluster.nodes if n.name == names[llm_node])
    wait_for(lambda: len(answers(out)) >= 16, JOB_BOUND_S, "the job's first rows", every_s=0.2)
    done_at_kill = len(answers(out))
    assert done_at_kill < rows, "the job ended before the kill: give it more rows"
    assert victim.name != "head"
    killed = cluster.kill(victim)
    kill_at = time.monotonic() - t0
    took = finish(cluster, sid)
    report = check_every_row_once(out, ids)
    text = logs(cluster, sid)
    deaths = len(re.findall(r"pool: an actor died", text))
    print(f"{victim.name} (LLM actor) killed ({killed} processes) {kill_at:.1f} s into the job, at "
          f"{done_at_kill}/{rows} rows; the job finished {took:.1f} s later with {report['done']} rows answered "
          f"once each, {report['failed']} failed; pool deaths logged: {deaths}")
    if RESULTS:
        Path(RESULTS).write_text(json.dumps({
            "what": "tests/test_cluster_jobs.py::test_a_node_lost_mid_job_every_row_answered_exactly_once: `ray job "
                    "submit` of python -m app.batch (tiny model, fused, one media and one LLM actor) to a cluster "
                    "started with `ray start` on the 2-core CPU machine (a head with the job server and no CPUs, "
                    "two workers of 2 CPUs); the worker holding the LLM actor SIGKILLed (raylet and every process "
                    "of it) once 16 rows were written",
            "ray": __import__("ray").__version__, "rows": rows, "rows_written_at_kill": done_at_kill,
            "kill_at_s": round(kill_at, 2), "finished_after_kill_s": round(took, 2), "answered_once": report["done"],
            "failed": report["failed"], "rows_answered_twice": 0, "actor_deaths_logged": deaths,
            "date": time.strftime("%Y-%m-%d")}, indent=2) + "\n")
