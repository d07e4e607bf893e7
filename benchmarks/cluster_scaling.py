"""Two Ray nodes of half the GPUs each against one node with all of them, on one host (issue 42): the
same application, the same closed-loop load, each layout on a fresh cluster (tests/cluster_harness.py).

Each node is a raylet of its own, started with its own `CUDA_VISIBLE_DEVICES` and half the host's
cores; the head holds no GPU and no CPU, so only Serve's controller and a proxy live there. The load
enters on every worker node's Router port (`router_http_port`, as a load balancer in front of the nodes
would spread it), split evenly; the figure is all answers over the longest node's timed part. Result:
`cluster.json` and `cluster.md` with throughput and TTFT per layout and the ratio two nodes / one,
written again after every layout (a timeout loses at most the layout in flight, and that one's phases so
far are kept). Every phase of a layout is printed as it ends, with the seconds since the start, and its
duration kept in the layout's `phases_s`. `--layouts 2` runs one layout only; with `--deadline-s` a layout
is skipped (and recorded as such) when less time is left than the previous layout took.

    python benchmarks/cluster_scaling.py --serve-config configs/qwen3-vl-2b-gpu.yaml --gpus 4 --rate 500 --out-dir $OUT/cluster
    python benchmarks/cluster_scaling.py --smoke --out-dir /tmp/cluster   # CPU: tiny model, fake GPUs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the multi-node harness the cluster tests use

from benchmarks.monitor import Monitor  # noqa: E402
from benchmarks.serve import Workload, file_config, run_load, wait_listening, wait_running  # noqa: E402
from cluster_harness import UNBUFFERED_LOGS, LocalCluster, environment, replica_nodes  # noqa: E402

T_START = time.perf_counter()
NAMES = {1: "one_node", 2: "two_nodes"}


def layout_name(nodes: int) -> str:
    return NAMES.get(nodes, f"{nodes}_nodes")


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T_START:7.1f} s] {msg}", flush=True)


class Phases:
    """A layout's phases, each printed when it starts and when it ends (flushed: a run killed by a
    timeout shows what it was in); their durations in `durations_s`, and the one in flight in `current`."""

    def __init__(self, label: str):
        self.label, self.durations_s, self.current, self.stopped_in = label, {}, None, None
        self.t0 = self._last = time.perf_counter()

    def start(self, name: str) -> None:
        if self.current is not None:  # the previous one never ended (an exception): kept as where it stopped
            self.stopped_in = self.current
            self.durations_s[f"{self.current} (stopped)"] = round(time.perf_counter() - self._last, 3)
        self.current, self._last = name, time.perf_counter()
        log(f"{self.label}: {name} ...")
        if name != "shutdown":
            on_sigterm.install()  # again: Ray sets its own when a node starts and at ray.init

    def done(self, detail: str = "") -> float:
        d = time.perf_counter() - self._last
        self.durations_s[self.current] = round(d, 3)
        log(f"{self.label}: {self.current} done in {d:.1f} s" + (f" ({detail})" if detail else ""))
        self.current = None
        return d

    def total_s(self) -> float:
        return time.perf_counter() - self.t0

    def record(self) -> dict:
        """The durations so far (the phase in flight, if any, as stopped) and where it stopped, if it did."""
        rec = {"phases_s": dict(self.durations_s), "total_s": round(self.total_s(), 3)}
        if self.current is not None:
            rec["phases_s"][f"{self.current} (stopped)"] = round(time.perf_counter() - self._last, 3)
        if self.stopped_in is not None or self.current is not None:
            rec["in_phase"] = self.stopped_in or self.current
        return rec


class OnSigterm:
    """The SIGTERM handler (`timeout`'s): the results so far written at once, the layout in flight with
    the phases it finished and the one it was in, then SystemExit, so that its cluster is stopped. Written
    here rather than on the way out: GNU timeout signals the whole process group too, so a second SIGTERM
    (and Ray's processes dying under it) may cut the way out short."""

    def __init__(self):
        self.a, self.results, self.name, self.out = None, None, None, None

    def __call__(self, signum, frame) -> None:
        log(f"signal {signum}")
        if self.a is not None and self.name is not None:
            self.results[self.name] = finished(self.out) | {"stopped": f"signal {signum}"}
            write_results(self.a, self.results)
            self.name = None  # written: once is enough
        sys.exit(128 + signum)

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is not self:
            signal.signal(signal.SIGTERM, self)


on_sigterm = OnSigterm()


def host_object_store_bytes() -> int:
    """The object store one `ray start` would take on this host (30% of its memory, capped by /dev/shm
    and 200 GB): the layouts split it, so one node and two have the same in all. `ray.cluster_utils`
    alone gives every node 150 MiB, so that one node had half the store of two. Given its share (151 GiB),
    one node still served 370.55 req/s on four H100s against 379.03 with 150 MiB (2026-11-27): the store
    was not why it served less than two nodes, but the comparison is fair only with equal stores."""
    import psutil
    from ray._private.utils import resolve_object_store_memory

    return resolve_object_store_memory(psutil.virtual_memory().total)


def node_specs(gpus: int, nodes: int, cpus: int, object_store_bytes: int | None = None) -> list[dict]:
    """Per worker node: its GPUs (CUDA_VISIBLE_DEVICES), GPU count, cores and object store bytes (None:
    the harness's default); the host's split evenly."""
    per = gpus // nodes
    store = None if object_store_bytes is None else object_store_bytes // nodes
    return [{"devices": ",".join(str(g) for g in range(i * per, (i + 1) * per)), "num_gpus": per,
             "num_cpus": cpus // nodes, "object_store_bytes": store} for i in range(nodes)]


def deploy(cluster: LocalCluster, serve_config: str, args: dict, routers: int, media: int,
           cpus: float | None = None) -> str:
    """The config file as `serve run` deploys it, on the cluster: `routers` Routers and `media` media
    replicas in all, fixed (no autoscaling during the run), the same share on every worker node (so that
    each node's port answers), the Routers' own port on every node. `cpus`: their CPU reservation
    instead of the file's. Returns the application's name without waiting for it (wait_running)."""
    import yaml
    from ray.serve._private import api as serve_api
    from ray.serve.schema import ServeDeploySchema

    nodes = len(cluster.workers)
    fixed = {name: {"autoscaling_config": {"min_replicas": count, "max_replicas": count, "initial_replicas": count},
                    "max_replicas_per_node": -(-count // nodes),
                    **({"ray_actor_options": {"num_cpus": cpus}} if cpus is not None else {})}
             for name, count in (("Router", routers), ("MediaPreprocessor", media))}
    # every node serves the Routers' own port; which one is set per node (VLM_ROUTER_HTTP_PORT)
    conf = file_config(yaml.safe_load(Path(serve_config).read_text()),
                       {"router_http_port": 8000, "router_http_host": "127.0.0.1"} | args, cluster.head.proxy_port,
                       fixed)
    conf["proxy_location"] = "EveryNode"
    app = conf["applications"][0]
    for d in app["deployments"]:
        if d["name"] in fixed:
            d.pop("num_replicas", None)  # the fixed counts above instead
    client = serve_api.serve_start(http_options=conf["http_options"])
    client.deploy_apps(ServeDeploySchema.model_validate(conf), _blocking=False)
    return app["name"]


def in_threads(fn, calls: list[tuple]) -> list:
    """`fn(*c)` for every c at the same time, a daemon thread each, the results in order (the first
    exception raised again). Daemon threads: a SIGTERM (the caller's `timeout`) ends the process without
    waiting for a load in flight, as a pool's threads would make it."""
    results: list = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int, c: tuple) -> None:
        try:
            results[i] = fn(*c)
        except BaseException as e:  # raised again in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, c), daemon=True, name=f"load-{i}") for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def warm_up(urls: list[str], wl: Workload, a, seed: int) -> dict:
    """Each node's `--warmup` requests, the media seeds run_load's own warm-up would take (seed + i *
    1e6, ...), but `--warmup-concurrency` at a time instead of one after another (256 in a row, twice a
    layout, were a large part of it). Not measured."""
    def one(i: int, url: str) -> dict:
        return asdict(asyncio.run(run_load(url, wl, a.warmup, max(1, min(a.warmup_concurrency, a.warmup)), warmup=0,
                                           progress=False, seed_offset=seed + i * 1_000_000)))

    reports = in_threads(one, list(enumerate(urls)))
    return {"requests": sum(r["successful"] + r["failed"] for r in reports),
            "failed": sum(r["failed"] for r in reports), "duration_s": max(r["duration_s"] for r in reports)}


def load_all(urls: list[str], wl: Workload, a, seed: int, rate: float | None = None) -> list[dict]:
    """The load split over the nodes' entry points, run at the same time (a thread each): the closed loop,
    or with `rate` Poisson arrivals at that total rate. The timed requests are the ones they were with
    run_load's own warm-up (media seeds after the warm-up's: warm_up sent those)."""
    def one(i: int, url: str) -> dict:
        concurrency = None if rate else max(1, a.concurrency // len(urls))
        report = asyncio.run(run_load(url, wl, a.requests // len(urls), concurrency,
                                      request_rate=rate / len(urls) if rate else None, warmup=0,
                                      progress=False, seed_offset=seed + i * 1_000_000 + a.warmup,
                                      processes=min(a.load_processes, concurrency or a.load_processes)))
        return asdict(report)

    return in_threads(one, list(enumerate(urls)))


def summary(reports: list[dict]) -> dict:
    """All nodes' answers over the longest node's timed part, and each node's TTFT."""
    ok = sum(r["successful"] for r in reports)
    return {"successful": ok, "failed": sum(r["failed"] for r in reports),
            "request_throughput": ok / max(r["duration_s"] for r in reports),
            "duration_s": max(r["duration_s"] for r in reports),
            "per_node_throughput": [r["request_throughput"] for r in reports],
            "ttft_ms_p50_per_node": [r["ttft_ms"]["median"] for r in reports],
            "ttft_ms_p99_per_node": [r["ttft_ms"]["p99"] for r in reports]}


def monitor_record(m) -> dict:
    """What the JSON keeps of a load's benchmarks/monitor.py summary (the whole load, warm-up excluded,
    ramp and drain included): GPU busy per GPU, host CPU, cores and busiest thread per process group."""
    return {"gpu_busy_pct": [round(u, 1) for u in m.gpu_mean], "gpu_source": m.gpu_source,
            "host_busy": round(m.host_busy, 3), "host_cores": m.host_cores,
            "groups": {k: {"processes": g["processes"], "cores": round(g["cores"], 2),
                           "busiest_thread": round(g["busiest_thread"], 2)} for k, g in m.groups.items()},
            "verdict": m.verdict}


def node_processes(cluster: LocalCluster) -> list:
    """The worker nodes' raylets and everything under them (replicas, their own children): the
    processes that should be gone before the next layout takes the GPUs."""
    import psutil
    from ray._private import ray_constants

    procs = []
    for w in cluster.workers:
        for info in w.node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, []):
            try:
                p = psutil.Process(info.process.pid)
                procs += [p, *p.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
    return procs


def shut_down(cluster: LocalCluster, procs: list, out: dict) -> None:
    """The cluster stopped, then its worker nodes' processes waited for (a replica still holding a GPU
    would shrink the next layout's KV cache), killed after 60 s; how many outlived the shutdown in
    `out["leftover_processes"]`."""
    import psutil

    # A SIGTERM that stopped the layout may come again (GNU timeout signals the child, then its process
    # group): the cluster is stopped first, or its raylets and replicas could outlive the run.
    previous = signal.signal(signal.SIGTERM,
                             lambda signum, frame: log(f"signal {signum} during the shutdown: finishing it"))
    try:
        cluster.shutdown()
    finally:
        signal.signal(signal.SIGTERM, previous)
    alive = [p for p in procs if p.is_running()]
    if alive:
        t0 = time.perf_counter()
        _, still = psutil.wait_procs(alive, timeout=60)
        for p in still:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        out["leftover_processes"] = {"after_shutdown": len(alive), "gone_after_s": round(time.perf_counter() - t0, 3),
                                     "killed_after_60s": len(still)}


def run_layout(a, nodes: int, out: dict) -> dict:
    """One layout on a fresh cluster, filling `out` as it goes (so a caller that is interrupted still has
    the phases done); `out["phases"]` is its Phases."""
    from deployments.ray_env import apply_serve_env

    ph = out["phases"] = Phases(layout_name(nodes))
    out.update(nodes=nodes, gpus=a.gpus)
    apply_serve_env()  # as `make serve` starts Ray
    ph.start("cluster start")
    # Serve's own request-log buffering, as `make serve` runs it, unless asked for the tests' line-by-line logs
    cluster = LocalCluster(head_cpus=0, env=None if a.unbuffered_logs else {UNBUFFERED_LOGS: None})
    out["request_logs"] = "line by line" if a.unbuffered_logs else "Serve's buffering"
    procs: list = []
    try:
        # None (--smoke's default: the tiny model, CI's machine): the harness's small store
        specs = node_specs(a.gpus, nodes, a.cpus, None if a.object_store_gib is None else int(a.object_store_gib * 2**30))
        store = specs[0]["object_store_bytes"]
        out["object_store_gib_per_node"] = None if store is None else round(store / 2**30, 2)
        for spec in specs:
            env = {} if a.smoke else {"CUDA_VISIBLE_DEVICES": spec["devices"]}
            with environment(env):
                cluster.add_worker(spec["num_cpus"], spec["num_gpus"], object_store_memory=spec["object_store_bytes"])
        ph.done(f"head and {nodes} worker node{'s' * (nodes > 1)}")
        ph.start("connect")
        cluster.connect()
        ph.done()
        ph.start("deploy call")
        name = deploy(cluster, a.serve_config, json.loads(a.app_args), a.routers, a.media, a.replica_cpus)
        deploy_call_s = ph.done()
        ph.start("running")
        wait_running(name, timeout_s=900)
        urls = [w.url("router") for w in cluster.workers]
        for url in urls:  # each node's Routers listen on their own port once they have warmed
            wait_listening(urlsplit(url).port, timeout_s=300)
        out["ready_s"] = deploy_call_s + ph.done()
        procs = node_processes(cluster)
        wl = Workload("image", a.image_size, output_tokens=a.output_tokens)
        loads = [("closed_loop", nodes * 10_000_000, None)]
        if a.rate:
            loads.append(("poisson", nodes * 10_000_000 + 500_000, a.rate))
        for load, seed, rate in loads:
            if a.warmup:
                ph.start(f"{load} warm-up")
                w = out.setdefault("warmup", {})[load] = warm_up(urls, wl, a, seed)
                ph.done(f"{w['requests']} requests, {w['failed']} failed, "
                        f"{w['requests'] / max(w['duration_s'], 1e-9):.1f} req/s")
            ph.start(load)
            with Monitor() as mon:  # which stage saturates: GPU busy per GPU, CPU per process group
                reports = load_all(urls, wl, a, seed, rate)
            r = out[load] = summary(reports) | {"monitor": monitor_record(mon.summary())}
            ph.done(f"{r['request_throughput']:.2f} req/s, {r['successful']} ok, {r['failed']} failed, "
                    f"timed part {r['duration_s']:.1f} s; " + "; ".join(r["monitor"]["verdict"]))
        placed = {dep: sorted(replicas.values()) for dep, replicas in replica_nodes().items()}
        out["replica_nodes"] = {dep: len(set(ns)) for dep, ns in placed.items()}
        out["replicas"] = {dep: len(ns) for dep, ns in placed.items()}
    finally:
        ph.start("shutdown")
        shut_down(cluster, procs, out)
        left = out.get("leftover_processes")
        ph.done(f"{left['after_shutdown']} node processes outlived it by {left['gone_after_s']:.1f} s, "
                f"{left['killed_after_60s']} killed" if left else "")
    return out


def finished(out: dict) -> dict:
    """A layout's record as written: its phases as durations (and the one it was in, if it stopped)."""
    rec = {k: v for k, v in out.items() if k != "phases"}
    ph = out.get("phases")
    return rec | ph.record() if ph is not None else rec


def write_file(path: Path, text: str) -> None:
    """Whole or not at all (a SIGTERM's handler may write the same file while this one is at it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def busy_cells(r: dict) -> str:
    """The table's GPU and process cells for one load (blank where no monitor ran)."""
    m = r.get("monitor")
    if not m:
        return " | "
    top = max(m["groups"].items(), key=lambda kv: kv[1]["cores"], default=None)
    gpus = ", ".join(f"{u:.0f}" for u in m["gpu_busy_pct"]) or "none"
    return gpus + " | " + (f"{top[0]} ({top[1]['cores']:.1f}, {top[1]['busiest_thread']:.2f})" if top else "")


def write_results(a, results: dict) -> None:
    """cluster.json and cluster.md from the layouts so far; the ratio once one node and two are both done."""
    done = {k: v for k, v in results.items() if isinstance(v, dict) and "closed_loop" in v and "stopped" not in v}
    if "one_node" in done and "two_nodes" in done:
        results["ratio_two_over_one"] = (done["two_nodes"]["closed_loop"]["request_throughput"]
                                         / max(done["one_node"]["closed_loop"]["request_throughput"], 1e-9))
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_file(out / "cluster.json", json.dumps(results, indent=1))
    lines = ["| layout | load | req/s | per node | TTFT p50 / p99 ms per node | failed | ready s | GPU busy % | "
             "busiest process group (cores, busiest thread) |", "|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for name, rec in results.items():
        if not isinstance(rec, dict):
            continue
        for load in ("closed_loop", "poisson"):
            r = rec.get(load)
            if r is None:
                continue
            ttft = ", ".join(f"{m:.0f} / {q:.0f}" for m, q in zip(r["ttft_ms_p50_per_node"], r["ttft_ms_p99_per_node"]))
            label = load if load == "closed_loop" else f"Poisson {a.rate or 0:g}"
            lines.append(f"| {name} ({a.gpus} GPUs) | {label} | "
                         f"{r['request_throughput']:.2f} | " + ", ".join(f"{x:.1f}" for x in r["per_node_throughput"])
                         + f" | {ttft} | {r['failed']} | {rec.get('ready_s', float('nan')):.0f} | {busy_cells(r)} |")
        if "skipped" in rec:
            notes.append(f"{name}: skipped: {rec['skipped']}")
        elif "stopped" in rec:
            notes.append(f"{name}: stopped in phase '{rec.get('in_phase')}' after {rec.get('total_s', 0):.0f} s: "
                         f"{rec['stopped']}")
        if rec.get("phases_s"):
            notes.append(f"{name} phases (s): " + ", ".join(f"{k} {v:.1f}" for k, v in rec["phases_s"].items())
                         + f"; total {rec.get('total_s', 0):.1f}")
    if "ratio_two_over_one" in results:
        notes.append(f"two nodes / one node, closed loop: {results['ratio_two_over_one']:.3f}")
    text = "\n".join(lines) + ("\n\n" + "\n\n".join(notes) if notes else "") + "\n"
    write_file(out / "cluster.md", text)
    log(f"wrote {out / 'cluster.json'} and cluster.md ({', '.join(k for k in results if k != 'ratio_two_over_one')})")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--serve-config", default=str(ROOT / "configs" / "qwen3-vl-2b-gpu.yaml"))
    p.add_argument("--app-args", default="{}", help="JSON deep-merged into the application's args")
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--cpus", type=int, default=os.cpu_count() or 2, help="the host's cores, split over the nodes")
    p.add_argument("--object-store-gib", type=float, default=None,
                   help="the object stores' GiB in all, split over the nodes (default: what one `ray start` would "
                        "take on this host; with --smoke, ray.cluster_utils' 150 MiB a node)")
    p.add_argument("--layouts", default="1 2", help="worker node counts, run in this order (e.g. '2' for one layout)")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="seconds from the start: a layout is skipped when less is left than the previous one took")
    p.add_argument("--concurrency", type=int, default=1024)
    p.add_argument("--rate", type=float, default=None, help="also Poisson arrivals at this total rate (req/s)")
    p.add_argument("--requests", type=int, default=8192, help="timed, in all (2026-11-27: 4,096, four per client "
                   "at c=1024: mostly ramp and tail)")
    p.add_argument("--warmup", type=int, default=256, help="per node, before each load")
    p.add_argument("--warmup-concurrency", type=int, default=64, help="per node (1: one after another)")
    p.add_argument("--image-size", type=int, default=448)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--load-processes", type=int, default=2, help="per node")
    p.add_argument("--routers", type=int, default=None, help="Routers in all, split over the nodes (default: 3 per GPU, "
                   "the app's router_replicas_per_gpu; 2026-11-27's run had 4 in all, 256 requests in flight each)")
    p.add_argument("--media", type=int, default=None, help="media replicas in all, split over the nodes (default: "
                   "4 per GPU, the app's media_replicas_per_gpu)")
    p.add_argument("--replica-cpus", type=float, default=None, help="the Routers' and media replicas' CPU reservation")
    p.add_argument("--unbuffered-logs", action="store_true", help="replicas write request logs line by line, as the "
                   "tests' clusters do (2026-11-27's runs did; the default is Serve's own buffering)")
    p.add_argument("--smoke", action="store_true", help="CPU: the tiny model, two fake GPUs, a few requests")
    p.add_argument("--out-dir", default="benchmarks/cluster_results")
    a = p.parse_args(argv)
    if a.smoke:
        a.serve_config, a.gpus, a.cpus = str(ROOT / "serve_config.yaml"), 2, 2
        a.concurrency, a.requests, a.warmup, a.image_size, a.output_tokens, a.load_processes = 2, 8, 1, 64, 4, 1
        a.routers, a.media, a.replica_cpus, a.rate = 2, 2, 0.25, a.rate or 4.0
        a.app_args = json.dumps({"placement": {"policy": "fused", "num_cpus": 0.25}, "warmup": False}
                                | json.loads(a.app_args))
    a.routers = a.routers or 3 * a.gpus
    a.media = a.media or 4 * a.gpus
    if a.object_store_gib is None and not a.smoke:
        a.object_store_gib = host_object_store_bytes() / 2**30
    layouts = [int(x) for x in a.layouts.replace(",", " ").split()]
    for n in layouts:
        if n < 1 or a.gpus % n:
            p.error(f"--layouts: {n} nodes do not split {a.gpus} GPUs evenly")
    results: dict = {}
    on_sigterm.a, on_sigterm.results = a, results
    on_sigterm.install()
    last_s = None
    for n in layouts:
        name = layout_name(n)
        left = None if a.deadline_s is None else a.deadline_s - (time.perf_counter() - T_START)
        if left is not None and (left <= 0 or (last_s is not None and left < last_s)):
            why = f"{left:.1f} s left of --deadline-s {a.deadline_s:g}" + (
                f", the previous layout took {last_s:.1f} s" if last_s is not None else "")
            results[name] = {"nodes": n, "gpus": a.gpus, "skipped": why}
            log(f"{name}: skipped ({why})")
            write_results(a, results)
            continue
        out: dict = {}
        on_sigterm.name, on_sigterm.out = name, out
        try:
            run_layout(a, n, out)
        except BaseException as e:
            on_sigterm.name = None
            results.setdefault(name, finished(out) | {"stopped": f"{type(e).__name__}: {e}"})
            log(f"{name}: stopped: {type(e).__name__}: {e}")
            write_results(a, results)
            raise
        on_sigterm.name = None
        results[name] = finished(out)
        last_s = results[name]["total_s"]
        log(f"{name}: done in {last_s:.1f} s")
        write_results(a, results)
    print((Path(a.out_dir) / "cluster.md").read_text(), flush=True)
    return results


if __name__ == "__main__":
    main()
