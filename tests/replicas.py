"""The Serve replicas of the test's own Ray cluster: process ids, memory, and replica identities.

Other Ray clusters may run on the same machine (with equally named processes), so replica processes
are looked up among this test process's descendants only (ray.init starts the raylet as a child, the
raylet starts the workers). Ray sets worker titles to `ray::ServeReplica:<app>:<Deployment>`."""

from __future__ import annotations

import os

import psutil


def replica_processes(app: str = "vlm") -> dict[str, list[psutil.Process]]:
    out: dict[str, list[psutil.Process]] = {}
    prefix = f"ray::ServeReplica:{app}:"
    for p in psutil.Process(os.getpid()).children(recursive=True):
        try:
            title = " ".join(p.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if title.startswith(prefix):  # 'VisionEncoder', or 'VisionEncoder.encode' while a task runs
            out.setdefault(title[len(prefix):].split()[0].split(".")[0], []).append(p)
    return out


def replica_identities(app: str = "vlm") -> set[tuple[str, int, float]]:
    """(deployment, pid, process start time) of every live replica: changes when one restarts."""
    return {(d, p.pid, p.create_time()) for d, procs in replica_processes(app).items() for p in procs}


def serve_replica_ids() -> set[str]:
    """Serve's replica actor names (they embed the replica id; a restarted replica gets a new one)."""
    import ray

    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "SERVE_REPLICA" in a["name"]}


def rss_bytes(deployment: str, app: str = "vlm") -> int:
    return sum(p.memory_info().rss for p in replica_processes(app).get(deployment, []))


def replica_logs(deployment: str, app: str = "vlm") -> str:
    """The Serve replica logs of a deployment in this process's Ray session (every replica it has had):
    the per-request lines a Router writes (app/api/chat.py) are read from here."""
    from pathlib import Path

    import ray._private.worker as ray_worker

    serve_logs = Path(ray_worker._global_node.get_logs_dir_path()) / "serve"
    return "".join(p.read_text(errors="replace") for p in sorted(serve_logs.glob(f"replica_{app}_{deployment}_*.log")))
