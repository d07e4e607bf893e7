"""The application on a real Ray cluster of two nodes on the CPU (tests/cluster_harness.py): the tiny model
deployed from serve_config.yaml as `serve run` deploys it, with a Router, a media replica and an LLM
replica on each node (`max_replicas_per_node: 1`, two of each) and the Routers' own port on.

1. Requests enter on each node: its Routers' own port and its Ray Serve proxy. Every answer (text and
   usage) equals the one-process reference (`helpers.local_chat`: no Ray, no batching, no cache), and
   requests whose media a replica on one node prepared were encoded by the LLM replica on the other
   (the item crossed nodes through Ray's object store), read from the replicas' request logs.
2. A node lost under load: 40 requests (128 tokens each) from 4 client threads, spread over both nodes'
   entry points, and 4 long answers (1500 tokens) that enter on the head's Router port; the worker node
   (one of the two LLM replicas, a Router, a media replica and a proxy) is killed (SIGKILL of its raylet,
   object store and workers) once 8 are answered and while its LLM replica is generating. The client
   does what a load balancer in front of the nodes does: a refused or broken connection, or a 502-504,
   is sent again to the next entry point. Counted: sent, answered, retried, failed (a clear 5xx after its
   tries) and lost (no answer within the client's timeout); the target is 0 lost and 0 failed, and every
   answer equals the reference. A long answer caught in the dying LLM replica must have been sent again
   by the head's Router (its `vlm_request_retries_total`). Then a new node joins, Serve places the
   missing replicas on it, and its ports answer as the others. The counts are printed; with
   CLUSTER_RESULTS=path they are written there as JSON (benchmarks/results/cluster_node_kill_cpu.json).
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import os
import re
import threading
import time
from pathlib import Path

import httpx
import pytest

from cluster_harness import (
    answers_health,
    local_cluster,
    metric_total,
    proxy_nodes,
    replica_nodes,
    serve_state,
    wait_for,
)
from helpers import mp4_bytes, png_bytes
from served import config_from_file

pytestmark = pytest.mark.integration
RESULTS = os.environ.get("CLUSTER_RESULTS")
ARGS = {"model": "embedded:tiny",
        "encoder": {"min_budget": 64, "max_budget": 1024, "autotune": False},
        # always the media replicas (never the Router itself), so that items travel between processes
        "media": {"router_local_below": 0, "max_frames_per_request": 10},
        "llm": {"max_num_seqs": 4},
        "placement": {"policy": "fused", "llm_replicas": 2, "num_cpus": 0.25},
        "retry": {"max_attempts": 6, "budget_s": 120, "backoff_s": 0.5},
        "router_http_host": "127.0.0.1"}
ONE_PER_NODE = {"max_replicas_per_node": 1}
START_BOUND_S = 240  # two nodes' replicas (each imports torch) on 2 loaded cores
RECOVERY_BOUND_S = 180
LOAD_TOKENS = 128
SENTINEL_TOKENS = 1500


def cluster_config(proxy_port: int, router_port: int, model_cache: str) -> dict:
    """serve_config.yaml with the test's args: two of each replica, at most one per node."""
    conf = config_from_file(proxy_port, ARGS | {"cache_dir": model_cache, "router_http_port": router_port},
                            {name: ONE_PER_NODE for name in ("Router", "MediaPreprocessor", "LLM")})
    assert conf["proxy_location"] == "EveryNode"  # a proxy on each node: what this test enters through
    for d in conf["applications"][0]["deployments"]:
        if d["name"] in ("Router", "MediaPreprocessor"):
            d["autoscaling_config"].update({"min_replicas": 2, "max_replicas": 2})
    return conf


def url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def bodies(max_tokens: int = 6) -> list[dict]:
    """Text, images, a video, both: the requests of the equality check (greedy); the load's run to
    `max_tokens` (ignore_eos), so that some are inside the LLM replicas when the node dies."""
    img = [{"type": "image_url", "image_url": {"url": url(png_bytes(48 + 8 * i, 64, seed=i), "image/png")}}
           for i in range(6)]
    vid = {"type": "video_url", "video_url": {"url": url(mp4_bytes(4, seed=3), "video/mp4")}}
    contents = ["Hello there", *[[im, {"type": "text", "text": f"what is {i}?"}] for i, im in enumerate(img)],
                [vid, {"type": "text", "text": "what happens?"}], [img[0], vid, {"type": "text", "text": "both"}]]
    extra = {"ignore_eos": True} if max_tokens > 6 else {}
    return [{"messages": [{"role": "user", "content": c}], "max_tokens": max_tokens, "temperature": 0, **extra}
            for c in contents]


@pytest.fixture(scope="module")
def reference(model_cache):
    """The one-process answers (helpers.local_chat) of `bodies()` and `bodies(LOAD_TOKENS)`, by index."""
    from app.checkpoints.model_builder import resolve_model
    from app.config import AppConfig
    from helpers import local_chat

    cfg = AppConfig(**(ARGS | {"cache_dir": model_cache}))
    chat = local_chat(cfg, resolve_model(cfg.model, cfg.cache_dir))

    async def one(body):
        return await chat.complete(*(await chat.prepare(copy.deepcopy(body))))

    out = {n: [asyncio.run(one(b)) for b in bodies(n)] for n in (6, LOAD_TOKENS)}
    out[SENTINEL_TOKENS] = [asyncio.run(one(bodies(SENTINEL_TOKENS)[0]))]
    return out


@pytest.fixture(scope="module")
def cluster(model_cache):
    pytest.importorskip("ray")
    from ray import serve
    from ray.serve._private import api as serve_api
    from ray.serve.schema import ServeDeploySchema

    from deployments.ray_env import SERVE_ENV

    with local_cluster(workers=1, env=dict(SERVE_ENV)) as c:
        conf = cluster_config(c.head.proxy_port, c.head.router_port, model_cache)
        t0 = time.perf_counter()
        client = serve_api.serve_start(http_options=conf["http_options"])  # what `serve run` does
        client.deploy_apps(ServeDeploySchema.model_validate(conf), _blocking=False)
        wait_for(app_running, START_BOUND_S, "the application to run on two nodes", describe=serve_state)
        for node in c.nodes:
            for which in ("router", "proxy"):
                wait_for(lambda n=node, w=which: answers_health(n.url(w)), START_BOUND_S, f"{node.name}'s {which} port")
        c.started_s = time.perf_counter() - t0
        try:
            yield c
        finally:
            serve.shutdown()


def log_dir() -> Path:
    import ray._private.worker as ray_worker

    return Path(ray_worker._global_node.get_logs_dir_path()) / "serve"


def app_running() -> bool:
    from ray import serve

    app = serve.status().applications.get("vlm")
    if app is not None and app.status == "DEPLOY_FAILED":
        raise AssertionError(f"the application failed to deploy: {app.message}")
    return app is not None and app.status == "RUNNING"


def same_answer(got: dict, want: dict) -> bool:
    return (got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
            and got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"]
            and got["usage"] == want["usage"])


def post(base: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=timeout)


def test_replicas_and_proxies_run_on_both_nodes(cluster):
    nodes = {n.node_id for n in cluster.nodes}
    placed = replica_nodes()
    for name in ("Router", "MediaPreprocessor", "LLM"):
        assert set(placed.get(name, {}).values()) == nodes, (name, placed)
    assert "VisionEncoder" not in placed  # fused: the LLM replicas encode
    assert proxy_nodes() >= nodes
    print(f"two-node app ready in {cluster.started_s:.1f} s")


def entry_points(cluster) -> list[str]:
    """Each node's Routers' own port and its proxy."""
    return [n.url(w) for n in cluster.nodes for w in ("router", "proxy")]


def test_answers_on_every_node_equal_the_one_process_answers(cluster, reference):
    from concurrent.futures import ThreadPoolExecutor

    reference = reference[6]
    jobs = [(i, base) for base in entry_points(cluster) for i in range(len(reference))]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda job: post(job[1], bodies()[job[0]]), jobs))
    for (i, base), resp in zip(jobs, got):
        assert resp.status_code == 200, (base, resp.text)
        assert same_answer(resp.json(), reference[i]), (base, i, resp.json(), reference[i])
    print(f"{len(jobs)} answers through {len(entry_points(cluster))} entry points equal the reference")
    crossed, joined = crossings()
    print(f"requests through the proxies, media prepared on one node and encoded on the other: {crossed} of {joined}")
    assert crossed >= 1, "no request's media crossed nodes"


CALL = re.compile(r"vlm_(MediaPreprocessor|LLM) (\w+) ([0-9a-f-]{36}) -- CALL (?:prepare|generate_from_media) OK")


def crossings() -> tuple[int, int]:
    """(requests whose media a replica on one node prepared and the LLM replica on another encoded,
    requests seen by both), joined on Ray Serve's request id in the replicas' logs, among the replicas
    alive now. Requests that came through a proxy carry one id through every call; those on the Routers'
    own port get one per call."""
    nodes = {rid: node for placed in replica_nodes().values() for rid, node in placed.items()}
    media: dict[str, set[str]] = {}
    llm: dict[str, set[str]] = {}
    for f in log_dir().glob("replica_vlm_*.log"):
        for deployment, replica, request in CALL.findall(f.read_text(errors="replace")):
            if replica in nodes:
                (media if deployment == "MediaPreprocessor" else llm).setdefault(request, set()).add(nodes[replica])
    joined = media.keys() & llm.keys()
    return sum(bool(media[r] - llm[r]) for r in joined), len(joined)


def redeploy(cluster, model_cache: str, **args) -> None:
    """The application again with `args` merged into the test's (a rolling update), every port answering."""
    from ray.serve._private import api as serve_api
    from ray.serve.schema import ServeDeploySchema

    from benchmarks.serve import deep_merge

    conf = cluster_config(cluster.head.proxy_port, cluster.head.router_port, model_cache)
    app = conf["applications"][0]
    app["args"] = deep_merge(app["args"], args)
    names = ("Router", "MediaPreprocessor", "LLM")
    old = {name: set(replica_nodes().get(name, {})) for name in names}
    serve_api.serve_start(http_options=conf["http_options"]).deploy_apps(ServeDeploySchema.model_validate(conf),
                                                                          _blocking=False)

    def replaced() -> bool:  # new args: every replica is new, two of each, and the app running
        now = replica_nodes()
        return app_running() and all(len(now.get(n, {})) == 2 and not set(now[n]) & old[n] for n in names)

    wait_for(replaced, START_BOUND_S, "the application to run again on two nodes",
             describe=serve_state)
    for node in cluster.nodes:
        for which in ("router", "proxy"):
            wait_for(lambda n=node, w=which: answers_health(n.url(w)), START_BOUND_S, f"{node.name}'s {which} port")


def test_with_prefer_local_node_a_request_stays_on_the_node_it_entered(cluster, reference, model_cache):
    """placement.prefer_local_node: the Routers' handles (and the LLM's own router, deployments/routing.py)
    take their node's replicas while those have room, so no request's media is prepared on one node and
    encoded on the other; the answers stay the reference's. Then the test's own config again."""
    reference = reference[6]
    redeploy(cluster, model_cache, placement={"prefer_local_node": True})
    try:
        proxies = [n.url("proxy") for n in cluster.nodes]
        for base in proxies:
            for i, body in enumerate(bodies()):
                resp = post(base, body)
                assert resp.status_code == 200 and same_answer(resp.json(), reference[i]), (base, i, resp.text)
        crossed, joined = crossings()
        print(f"prefer_local_node: media prepared on one node and encoded on the other: {crossed} of {joined}")
        assert joined >= len(bodies()) and crossed == 0  # every request with media, bar a few, and none crossed
    finally:
        redeploy(cluster, model_cache)


class Load:
    """Requests sent from `threads` client threads. Each job is (body, the reference answer, entry points):
    it goes to its first entry point; a refused or broken connection or a 502/503/504 is sent again to
    the next one (what a load balancer in front of the nodes does), within the request's `deadline_s`.
    A read that takes longer than `timeout_s` counts the request as lost (the client never heard back)."""

    RETRYABLE = {502, 503, 504}

    def __init__(self, jobs: list[tuple[dict, dict, list[str]]], threads: int, timeout_s: float = 60,
                 deadline_s: float = 150, answered_event_at: int = 8):
        self.jobs, self.threads, self.timeout_s, self.deadline_s = jobs, threads, timeout_s, deadline_s
        self.outcomes: dict[int, dict] = {}
        self.lock = threading.Lock()
        self.next = 0
        self.answered = threading.Event()  # set once `answered_event_at` requests are answered
        self.answered_event_at = answered_event_at

    def _take(self) -> int | None:
        with self.lock:
            if self.next >= len(self.jobs):
                return None
            self.next += 1
            return self.next - 1

    def _one(self, i: int) -> dict:
        body, want, entries = self.jobs[i]
        start, attempts, errors = time.monotonic(), 0, []

        def done(outcome: str) -> dict:
            return {"outcome": outcome, "attempts": attempts, "errors": errors, "s": time.monotonic() - start}

        while True:
            base = entries[attempts % len(entries)]
            attempts += 1
            try:
                resp = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=self.timeout_s)
                if resp.status_code == 200:
                    return done("answered" if same_answer(resp.json(), want) else "wrong")
                errors.append(f"{base}: {resp.status_code}")
                if resp.status_code not in self.RETRYABLE:
                    return done("failed")
            except httpx.TimeoutException as e:
                errors.append(f"{base}: {type(e).__name__}")
                return done("lost")
            except httpx.TransportError as e:  # refused, reset, closed mid-answer: the node is gone
                errors.append(f"{base}: {type(e).__name__}")
            if time.monotonic() - start > self.deadline_s:
                return done("failed")
            time.sleep(0.5)

    def _worker(self) -> None:
        while (i := self._take()) is not None:
            out = self._one(i)
            with self.lock:
                self.outcomes[i] = out
                if sum(o["outcome"] == "answered" for o in self.outcomes.values()) >= self.answered_event_at:
                    self.answered.set()

    def run(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._worker, daemon=True) for _ in range(self.threads)]
        for t in threads:
            t.start()
        return threads

    def counts(self) -> dict:
        outs = list(self.outcomes.values())
        by = {k: sum(o["outcome"] == k for o in outs) for k in ("answered", "wrong", "failed", "lost")}
        return {"sent": len(self.jobs), **by, "retried": sum(o["attempts"] > 1 for o in outs),
                "extra_attempts": sum(o["attempts"] - 1 for o in outs),
                "never_finished": len(self.jobs) - len(outs),
                "max_request_s": round(max((o["s"] for o in outs), default=0.0), 2)}


def running_on(entry, node_id: str) -> int:
    """Requests running or waiting in the LLM replicas on `node_id` (`/v1/llm/load` through `entry`)."""
    nodes = replica_nodes().get("LLM", {})
    try:
        load = httpx.get(f"{entry.url()}/v1/llm/load", timeout=10).json()
    except httpx.HTTPError:
        return 0
    return sum(r["running"] + r["waiting"] for r in load["replicas"] if nodes.get(r["replica"]) == node_id)


def router_retries(node) -> int:
    """Requests the node's Routers sent again after a replica failed (`vlm_request_retries_total`, from the
    node's metrics agent, which exports every few seconds: wait for a first count). Not from the Routers'
    per-request log lines: with `router_http_port` on, their log file stops once the shared port starts."""
    deadline = time.monotonic() + 60
    while True:
        n = metric_total(node, "ray_vlm_request_retries_total")
        if n or time.monotonic() > deadline:
            return int(n)
        time.sleep(2)


def test_a_node_lost_under_load_loses_no_request(cluster, reference):
    worker = cluster.workers[0]
    assert worker.node_id in replica_nodes()["LLM"].values()
    entries = entry_points(cluster)
    n = len(bodies())
    load = Load([(bodies(LOAD_TOKENS)[i % n], reference[LOAD_TOKENS][i % n], entries[i % 4:] + entries[:i % 4])
                 for i in range(40)], threads=4)
    # Long answers that enter on the head's Router port: the LLM routing puts some in the worker's replica,
    # where the node's death catches them mid-answer, and the head's Router must send them to the other
    sentinels = Load([(bodies(SENTINEL_TOKENS)[0], reference[SENTINEL_TOKENS][0], [cluster.head.url()])] * 4, threads=4)
    t0 = time.monotonic()
    threads = load.run()
    assert load.answered.wait(120), "the load never got going"
    threads += sentinels.run()
    # kill while the worker's LLM replica is generating
    time.sleep(1.0)
    inside = wait_for(lambda: running_on(cluster.head, worker.node_id), 30, "requests in the worker's LLM replica",
                      every_s=0.05)
    kill_at = time.monotonic() - t0
    kill_s = cluster.remove(worker)  # SIGKILL: raylet, object store, workers (a Router, media, LLM, proxy)
    for t in threads:
        t.join(load.deadline_s + load.timeout_s)
    load_s = time.monotonic() - t0
    counts = {k: v + sentinels.counts()[k] if k != "max_request_s" else max(v, sentinels.counts()[k])
              for k, v in load.counts().items()}
    problems = {i: o for i, o in [*load.outcomes.items(), *((f"s{i}", o) for i, o in sentinels.outcomes.items())]
                if o["outcome"] != "answered"}
    retries = router_retries(cluster.head)
    print(f"node killed {kill_at:.1f} s into the load ({kill_s:.1f} s to kill) with {inside} requests in its LLM "
          f"replica; {counts}; the Routers sent {retries} again to the other LLM replica")
    assert counts["never_finished"] == 0 and counts["lost"] == 0, problems
    assert counts["answered"] == counts["sent"], problems
    assert retries >= 1, "no request was caught inside the dying LLM replica"

    # Serve puts the missing replicas (and a proxy) on a node that joins
    t1 = time.monotonic()
    new = cluster.add_worker(2, object_store_memory=200 * 2**20)  # the harness's size, not cluster_utils' 150 MiB
    import ray

    store = {n["NodeID"]: n["Resources"].get("object_store_memory") for n in ray.nodes() if n["Alive"]}
    assert store[new.node_id] == 200 * 2**20, store
    nodes = {n.node_id for n in cluster.nodes}
    wait_for(lambda: all(set(replica_nodes().get(d, {}).values()) == nodes
                         for d in ("Router", "MediaPreprocessor", "LLM")), RECOVERY_BOUND_S, "replicas on the new node",
             describe=serve_state)
    for which in ("router", "proxy"):
        wait_for(lambda w=which: answers_health(new.url(w)), RECOVERY_BOUND_S, f"the new node's {which} port")
    recovery_s = time.monotonic() - t1
    for which in ("router", "proxy"):
        for i in (0, 1, len(bodies()) - 1):
            resp = post(new.url(which), bodies()[i])
            assert resp.status_code == 200 and same_answer(resp.json(), reference[6][i]), resp.text
    print(f"a new node's replicas ready and answering in {recovery_s:.1f} s")
    if RESULTS:
        Path(RESULTS).write_text(json.dumps({
            "what": "tests/test_cluster.py::test_a_node_lost_under_load_loses_no_request: the tiny model on a "
                    "two-node ray.cluster_utils cluster on the 2-core CPU machine (a Router, a media and an LLM "
                    "replica per node, fused placement, Routers' own port on); 40 requests of 128 tokens from 4 "
                    "client threads over both nodes' Router ports and proxies, and 4 of 1500 tokens on the head's "
                    "Router port; the worker node SIGKILLed once 8 were answered, while its LLM replica held "
                    "requests; the client sends a refused/broken connection or a 502-504 again to the next entry "
                    "point; lost = no answer within the client's 60 s timeout",
            "ray": __import__("ray").__version__, "counts": counts, "lost": counts["lost"] + counts["never_finished"],
            "router_retries": retries, "kill_at_s": round(kill_at, 2), "in_killed_llm_replica": inside, "load_s": round(load_s, 2),
            "recovery_with_new_node_s": round(recovery_s, 2), "app_start_s": round(cluster.started_s, 2),
            "date": time.strftime("%Y-%m-%d")}, indent=2) + "\n")
