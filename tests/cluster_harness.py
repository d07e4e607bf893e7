"""A real Ray cluster of several nodes on one machine, for tests: `ray.cluster_utils.Cluster`, each node
a raylet of its own with its own CPUs, GPUs and custom resources, that a test can remove (its raylet and
workers killed) and add again.

Several nodes on one host share its address, so each node gets ports of its own, set in the
environment its processes start with:
- Ray Serve's HTTP proxy on a worker node binds `RAY_SERVE_WORKER_PROXY_HTTP_PORT` (the head's binds
  `http_options.port`);
- the Routers' own port (`router_http_port`) on each node is `VLM_ROUTER_HTTP_PORT` (app/serving/cluster.py).
On a real cluster every node has its own address and uses the configured ports.

The cluster lives in a temporary directory of its own (`RAY_TMPDIR`), so the address file Ray writes
for `ray.init(address="auto")` (`ray_current_cluster`) never lands in /tmp/ray, where a later
`serve run` would try to join this cluster after it is gone (../shared/NOTES.md).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

# Ray's own variables for the processes of every node (deployments/ray_env.py adds the app's). Tests
# read replicas' request logs while they run, so those are written line by line; a benchmark passes
# `env={UNBUFFERED_LOGS: None}` to keep Serve's own buffering (1,000 lines in its throughput mode).
UNBUFFERED_LOGS = "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE"
CLUSTER_ENV = {"RAY_USAGE_STATS_ENABLED": "0", UNBUFFERED_LOGS: "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def environment(values: dict[str, str | None]) -> Iterator[None]:
    """`values` in os.environ inside the block (processes started there inherit them; None: unset),
    restored after."""
    saved = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


@dataclass
class ClusterNode:
    name: str  # the test's name for it: "head", "worker-1", ...
    node: object  # ray._private.node.Node
    proxy_port: int
    router_port: int
    metrics_port: int  # Ray's metrics agent on the node (Prometheus text at /metrics)
    resources: dict = field(default_factory=dict)

    @property
    def node_id(self) -> str:
        return self.node.node_id

    @property
    def head(self) -> bool:
        return self.name == "head"

    def url(self, which: str = "router") -> str:
        return f"http://127.0.0.1:{self.router_port if which == 'router' else self.proxy_port}"


class LocalCluster:
    """A head node and workers added with `add_worker`; `remove` kills one (not the head: the GCS and
    the test's driver live there)."""

    def __init__(self, head_cpus: float = 2, env: dict[str, str | None] | None = None):
        from ray.cluster_utils import Cluster

        self.temp_dir = tempfile.mkdtemp(prefix="vlmc-", dir="/tmp")  # short: Ray's socket paths must fit
        self.env = CLUSTER_ENV | {"RAY_TMPDIR": self.temp_dir} | (env or {})
        self.nodes: list[ClusterNode] = []
        self._count = 0
        proxy, router, metrics = free_port(), free_port(), free_port()
        with environment(self.env | {"VLM_ROUTER_HTTP_PORT": str(router)}):
            self.cluster = Cluster(initialize_head=True, head_node_args={
                "num_cpus": head_cpus, "resources": {"head": 1}, "include_dashboard": False,
                "metrics_export_port": metrics})
        self.nodes.append(ClusterNode("head", self.cluster.head_node, proxy, router, metrics, {"head": 1}))

    @property
    def address(self) -> str:
        return self.cluster.address

    @property
    def head(self) -> ClusterNode:
        return self.nodes[0]

    @property
    def workers(self) -> list[ClusterNode]:
        return self.nodes[1:]

    def add_worker(self, num_cpus: float = 2, num_gpus: int = 0, resources: dict | None = None,
                   object_store_memory: int | None = None) -> ClusterNode:
        """`object_store_memory` (bytes): None keeps `ray.cluster_utils`' default of 150 MiB a node, which
        suits the tiny model; a real model's images need what `ray start` would give (cluster_scaling.py)."""
        self._count += 1
        name = f"worker-{self._count}"
        proxy, router, metrics = free_port(), free_port(), free_port()
        resources = {name: 1} | (resources or {})
        with environment(self.env | {"RAY_SERVE_WORKER_PROXY_HTTP_PORT": str(proxy),
                                     "VLM_ROUTER_HTTP_PORT": str(router)}):
            store = {} if object_store_memory is None else {"object_store_memory": object_store_memory}
            node = self.cluster.add_node(num_cpus=num_cpus, num_gpus=num_gpus, resources=resources,
                                         metrics_export_port=metrics, **store)
        added = ClusterNode(name, node, proxy, router, metrics, resources)
        self.nodes.append(added)
        return added

    def remove(self, node: ClusterNode, graceful: bool = False) -> float:
        """Kills the node's raylet, object store and workers (SIGKILL unless `graceful`); seconds taken."""
        if node.head:
            raise ValueError("the head node holds the GCS and the driver: remove a worker")
        t0 = time.perf_counter()
        self.cluster.remove_node(node.node, allow_graceful=graceful)
        self.nodes.remove(node)
        return time.perf_counter() - t0

    def connect(self) -> None:
        import ray

        with environment(self.env):
            ray.init(address=self.address, log_to_driver=False)

    def shutdown(self) -> None:
        import ray

        try:
            if ray.is_initialized():
                ray.shutdown()
            self.cluster.shutdown()
        finally:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


@contextlib.contextmanager
def local_cluster(workers: int = 1, head_cpus: float = 2, worker_cpus: float = 2,
                  env: dict[str, str] | None = None) -> Iterator[LocalCluster]:
    """A head and `workers` worker nodes, the driver connected; everything stopped at the end."""
    c = LocalCluster(head_cpus, env)
    try:
        for _ in range(workers):
            c.add_worker(worker_cpus)
        c.connect()
        yield c
    finally:
        c.shutdown()


# ---------------------------------------------------------------- where Serve's replicas run
def replica_nodes(app: str = "vlm") -> dict[str, dict[str, str]]:
    """Alive Serve replicas: deployment -> {replica id: node id} (from the GCS actor table: no dashboard)."""
    import ray

    out: dict[str, dict[str, str]] = {}
    prefix = f"SERVE_REPLICA::{app}#"
    for info in ray._private.state.actors().values():
        name = info.get("Name") or ""
        if info.get("State") != "ALIVE" or not name.startswith(prefix):
            continue
        deployment, replica = name[len(prefix):].split("#", 1)
        out.setdefault(deployment, {})[replica] = info["Address"]["NodeID"]
    return out


def proxy_nodes() -> set[str]:
    import ray

    return {info["Address"]["NodeID"] for info in ray._private.state.actors().values()
            if info.get("State") == "ALIVE" and (info.get("Name") or "").startswith("SERVE_PROXY_ACTOR")}


def wait_for(condition, timeout_s: float, what: str, every_s: float = 0.5, describe=None):
    """`condition()` until truthy; past `timeout_s` an AssertionError that carries `describe()`, the state
    that explains the wait (a CI log has nothing else to go on)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            said = ""
            if describe is not None:
                try:
                    said = f"\n{describe()}"
                except Exception as e:  # noqa: BLE001 - the timeout is the failure; its account is a bonus
                    said = f"\n(describing the wait failed: {e!r})"
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}{said}")
        time.sleep(every_s)


def serve_state(app: str = "vlm") -> str:
    """Serve's own account of `app`: each deployment's status and message, and where its replicas run."""
    from ray import serve

    try:
        status = serve.status().applications.get(app)
    except Exception as e:  # noqa: BLE001 - a diagnostic must not hide the timeout it explains
        return f"serve.status() failed: {e!r}"
    if status is None:
        return f"Serve knows no application {app!r}"
    lines = [f"application {app}: {status.status} {status.message}".rstrip()]
    for name, d in status.deployments.items():
        lines.append(f"  {name}: {d.status} {d.message}".rstrip())
    lines.append(f"  alive replicas by node: {replica_nodes(app)}")
    return "\n".join(lines)


def metric_total(node: ClusterNode, name: str) -> float:
    """A counter summed over its labels, as the node's metrics agent exports it (0 if not yet exported)."""
    import httpx

    try:
        text = httpx.get(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=10).text
    except httpx.HTTPError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def answers_health(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


# ---------------------------------------------------------------- `ray start` nodes (a job server on the head)
@dataclass
class StartedNode:
    name: str
    temp_dir: str
    resources: dict
    raylet_pid: int | None = None


class RayStartCluster:
    """Nodes started with `ray start`, as on a real cluster: a head with the dashboard (and so the job
    server that `ray job submit` talks to) and workers, each with its own temp dir, ports, CPUs and custom
    resources. Never `ray stop` (it stops every Ray instance of this user on the machine, other tests'
    too): each node's processes are found by its temp dir and ended by process id."""

    def __init__(self, head_cpus: float = 0, env: dict[str, str] | None = None):
        # token authentication (Ray's default for new clusters) on every node and client alike; a
        # worker's `ray start` does not turn it on by itself
        self.env = os.environ | CLUSTER_ENV | {"RAY_AUTH_MODE": "token"} | (env or {})
        self.env.pop("RAY_ADDRESS", None)
        self.root = tempfile.mkdtemp(prefix="vlmj-", dir="/tmp")
        self.gcs_port, self.dashboard_port = free_port(), free_port()
        self.nodes: list[StartedNode] = []
        self._start("head", ["--head", f"--port={self.gcs_port}", "--include-dashboard=true",
                             "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}",
                             f"--ray-client-server-port={free_port()}"], head_cpus, {"head": 1})

    @property
    def gcs_address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def _start(self, name: str, args: list[str], num_cpus: float, resources: dict) -> StartedNode:
        import json
        import subprocess

        temp_dir = os.path.join(self.root, name)
        os.makedirs(temp_dir)
        cmd = ["ray", "start", *args, f"--num-cpus={int(num_cpus)}", f"--resources={json.dumps(resources)}",
               f"--temp-dir={temp_dir}", "--disable-usage-stats", "--min-worker-port=0", "--max-worker-port=0",
               f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
               f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
               f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}"]
        node = StartedNode(name, temp_dir, resources)
        self.nodes.append(node)  # so that shutdown finds what a failed start left
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=180)
        if done.returncode != 0:
            raise RuntimeError(f"`ray start` of {name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        node.raylet_pid = next((p.pid for p in self.processes(node) if "raylet/raylet" in " ".join(p.cmdline())), None)
        return node

    def add_worker(self, name: str, num_cpus: float = 2, resources: dict | None = None) -> StartedNode:
        return self._start(name, [f"--address={self.gcs_address}"], num_cpus, {name: 1} | (resources or {}))

    def processes(self, node: StartedNode) -> list:
        """The node's processes (their command lines name its temp dir) and all their descendants."""
        import psutil

        found: dict[int, psutil.Process] = {}
        for p in psutil.process_iter(["pid", "cmdline"]):
            if node.temp_dir in " ".join(p.info["cmdline"] or []):
                found[p.pid] = p
                try:
                    found |= {c.pid: c for c in p.children(recursive=True)}
                except psutil.NoSuchProcess:
                    pass
        return list(found.values())

    def kill(self, node: StartedNode) -> int:
        """SIGKILL the node's raylet and every process of it (workers included), as a lost machine;
        returns how many processes."""
        import psutil

        procs = self.processes(node)
        raylet = [p for p in procs if p.pid == node.raylet_pid]
        for p in raylet + [p for p in procs if p.pid != node.raylet_pid]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(procs, timeout=10)
        self.nodes.remove(node)
        return len(procs)

    def shutdown(self) -> None:
        import psutil

        for node in reversed(list(self.nodes)):  # workers first, the head (GCS) last
            procs = self.processes(node)
            for p in procs:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.terminate()
            _, alive = psutil.wait_procs(procs, timeout=15)
            for p in alive:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            self.nodes.remove(node)
        shutil.rmtree(self.root, ignore_errors=True)
