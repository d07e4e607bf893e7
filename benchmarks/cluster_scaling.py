"""Two Ray nodes of half the GPUs each against one node with all of them, on one host (issue 42): the
same application, the same closed-loop load, each layout on a fresh cluster (tests/cluster_harness.py).

Each node is a raylet of its own, started with its own `CUDA_VISIBLE_DEVICES` and half the host's
cores; the head holds no GPU and no CPU, so only Serve's controller and a proxy live there. The load
enters on every worker node's Router port (`router_http_port`, as a load balancer in front of the nodes
would spread it), split evenly; the figure is all answers over the longest node's timed part. Result:
`cluster.json` and `cluster.md` with throughput and TTFT per layout and the ratio two nodes / one.

    python benchmarks/cluster_scaling.py --serve-config configs/qwen3-vl-2b-gpu.yaml --gpus 4 --rate 500 --out-dir $OUT/cluster
    python benchmarks/cluster_scaling.py --smoke --out-dir /tmp/cluster   # CPU: tiny model, fake GPUs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the multi-node harness the cluster tests use

from benchmarks.serve import Workload, deep_merge, run_load, wait_running  # noqa: E402
from cluster_harness import LocalCluster, environment, replica_nodes  # noqa: E402


def node_specs(gpus: int, nodes: int, cpus: int) -> list[dict]:
    """Per worker node: its GPUs (CUDA_VISIBLE_DEVICES), GPU count and cores; the host's split evenly."""
    per = gpus // nodes
    return [{"devices": ",".join(str(g) for g in range(i * per, (i + 1) * per)), "num_gpus": per,
             "num_cpus": cpus // nodes} for i in range(nodes)]


def deploy(cluster: LocalCluster, serve_config: str, args: dict, routers: int, cpus: float | None = None) -> None:
    """The config file as `serve run` deploys it, on the cluster: `routers` Routers and as many media
    replicas in all, the same share on every worker node (so that each node's port answers), the
    Routers' own port on every node. `cpus`: their CPU reservation instead of the file's."""
    import yaml
    from ray.serve._private import api as serve_api
    from ray.serve.schema import ServeDeploySchema

    conf = yaml.safe_load(Path(serve_config).read_text())
    conf["http_options"] = {"host": "127.0.0.1", "port": cluster.head.proxy_port}
    conf["proxy_location"] = "EveryNode"
    app = conf["applications"][0]
    # every node serves the Routers' own port; which one is set per node (VLM_ROUTER_HTTP_PORT)
    app["args"] = deep_merge(app.get("args") or {}, {"router_http_port": 8000, "router_http_host": "127.0.0.1"}
                             | args)
    nodes = len(cluster.workers)
    for d in app["deployments"]:
        if d["name"] in ("Router", "MediaPreprocessor"):
            d.pop("num_replicas", None)
            d["autoscaling_config"] = {**d.get("autoscaling_config", {}), "min_replicas": routers,
                                       "max_replicas": routers, "initial_replicas": routers}
            d["max_replicas_per_node"] = -(-routers // nodes)
            if cpus is not None:
                d["ray_actor_options"] = {**d.get("ray_actor_options", {}), "num_cpus": cpus}
    client = serve_api.serve_start(http_options=conf["http_options"])
    client.deploy_apps(ServeDeploySchema.model_validate(conf), _blocking=False)
    wait_running(app["name"], timeout_s=900)


def load_all(urls: list[str], wl: Workload, a, seed: int, rate: float | None = None) -> list[dict]:
    """The load split over the nodes' entry points, run at the same time (a thread each): the closed loop,
    or with `rate` Poisson arrivals at that total rate."""
    def one(i: int, url: str) -> dict:
        concurrency = None if rate else max(1, a.concurrency // len(urls))
        report = asyncio.run(run_load(url, wl, a.requests // len(urls), concurrency,
                                      request_rate=rate / len(urls) if rate else None, warmup=a.warmup,
                                      progress=False, seed_offset=seed + i * 1_000_000,
                                      processes=min(a.load_processes, concurrency or a.load_processes)))
        return asdict(report)

    with ThreadPoolExecutor(len(urls)) as pool:
        return list(pool.map(one, range(len(urls)), urls))


def summary(reports: list[dict]) -> dict:
    """All nodes' answers over the longest node's timed part, and each node's TTFT."""
    ok = sum(r["successful"] for r in reports)
    return {"successful": ok, "failed": sum(r["failed"] for r in reports),
            "request_throughput": ok / max(r["duration_s"] for r in reports),
            "per_node_throughput": [r["request_throughput"] for r in reports],
            "ttft_ms_p50_per_node": [r["ttft_ms"]["median"] for r in reports],
            "ttft_ms_p99_per_node": [r["ttft_ms"]["p99"] for r in reports]}


def run_layout(a, nodes: int) -> dict:
    from deployments.ray_env import apply_serve_env

    apply_serve_env()  # as `make serve` starts Ray
    cluster = LocalCluster(head_cpus=0)
    try:
        for spec in node_specs(a.gpus, nodes, a.cpus):
            env = {} if a.smoke else {"CUDA_VISIBLE_DEVICES": spec["devices"]}
            with environment(env):
                cluster.add_worker(spec["num_cpus"], spec["num_gpus"])
        cluster.connect()
        t0 = time.perf_counter()
        deploy(cluster, a.serve_config, json.loads(a.app_args), a.routers, a.replica_cpus)
        ready_s = time.perf_counter() - t0
        wl = Workload("image", a.image_size, output_tokens=a.output_tokens)
        urls = [w.url("router") for w in cluster.workers]
        out = {"nodes": nodes, "gpus": a.gpus, "ready_s": ready_s,
               "closed_loop": summary(load_all(urls, wl, a, seed=nodes * 10_000_000))}
        if a.rate:
            out["poisson"] = summary(load_all(urls, wl, a, seed=nodes * 10_000_000 + 500_000, rate=a.rate))
        placed = {dep: sorted(replicas.values()) for dep, replicas in replica_nodes().items()}
        out["replica_nodes"] = {dep: len(set(ns)) for dep, ns in placed.items()}
        out["replicas"] = {dep: len(ns) for dep, ns in placed.items()}
        return out
    finally:
        cluster.shutdown()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--serve-config", default=str(ROOT / "configs" / "qwen3-vl-2b-gpu.yaml"))
    p.add_argument("--app-args", default="{}", help="JSON deep-merged into the application's args")
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--cpus", type=int, default=os.cpu_count() or 2, help="the host's cores, split over the nodes")
    p.add_argument("--concurrency", type=int, default=1024)
    p.add_argument("--rate", type=float, default=None, help="also Poisson arrivals at this total rate (req/s)")
    p.add_argument("--requests", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=256)
    p.add_argument("--image-size", type=int, default=448)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--load-processes", type=int, default=2, help="per node")
    p.add_argument("--routers", type=int, default=4, help="Routers (and media replicas) in all, split over the nodes")
    p.add_argument("--replica-cpus", type=float, default=None, help="the Routers' and media replicas' CPU reservation")
    p.add_argument("--smoke", action="store_true", help="CPU: the tiny model, two fake GPUs, a few requests")
    p.add_argument("--out-dir", default="benchmarks/cluster_results")
    a = p.parse_args(argv)
    if a.smoke:
        a.serve_config, a.gpus, a.cpus = str(ROOT / "serve_config.yaml"), 2, 2
        a.concurrency, a.requests, a.warmup, a.image_size, a.output_tokens, a.load_processes = 2, 8, 1, 64, 4, 1
        a.routers, a.replica_cpus, a.rate = 2, 0.25, a.rate or 4.0
        a.app_args = json.dumps({"placement": {"policy": "fused", "num_cpus": 0.25}, "warmup": False}
                                | json.loads(a.app_args))
    results = {"one_node": run_layout(a, 1), "two_nodes": run_layout(a, 2)}
    results["ratio_two_over_one"] = (results["two_nodes"]["closed_loop"]["request_throughput"]
                                     / max(results["one_node"]["closed_loop"]["request_throughput"], 1e-9))
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cluster.json").write_text(json.dumps(results, indent=1))
    lines = ["| layout | load | req/s | per node | TTFT p50 / p99 ms per node | failed | ready s |",
             "|---|---|---|---|---|---|---|"]
    for name in ("one_node", "two_nodes"):
        for load in ("closed_loop", "poisson"):
            r = results[name].get(load)
            if r is None:
                continue
            ttft = ", ".join(f"{m:.0f} / {q:.0f}" for m, q in zip(r["ttft_ms_p50_per_node"], r["ttft_ms_p99_per_node"]))
            lines.append(f"| {name} ({a.gpus} GPUs) | {load if load == 'closed_loop' else f'Poisson {a.rate:g}'} | "
                         f"{r['request_throughput']:.2f} | " + ", ".join(f"{x:.1f}" for x in r["per_node_throughput"])
                         + f" | {ttft} | {r['failed']} | {results[name]['ready_s']:.0f} |")
    lines.append(f"\ntwo nodes / one node, closed loop: {results['ratio_two_over_one']:.3f}")
    (out / "cluster.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return results


if __name__ == "__main__":
    main()
