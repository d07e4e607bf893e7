"""The environment a Ray cluster that serves this application should start with.

Ray Serve reads these when each of its processes starts (HTTP proxy, controller, replicas), so they
must be in the environment of whatever starts Ray: `make serve` and the benchmarks set them before
`serve run` / `ray.init`; on a cluster started by hand, export them before `ray start`.

- `RAY_SERVE_THROUGHPUT_OPTIMIZED=1`: Ray Serve's low-overhead mode (gRPC from the proxy to the Router,
  each replica's user code and handle router on one event loop, garbage collection frozen after start-up,
  request logs buffered). The Router's time is mostly Ray Serve's per-call machinery, not ours
  (benchmarks/RESULTS.md); this mode served 27-52% more requests per second at concurrency 8 on the
  CPU machine, and 13% more in one side-by-side H200 run (direct ingress on).
- `RAY_SERVE_ENABLE_DIRECT_INGRESS=0`: the mode would otherwise turn on direct ingress, which keeps an
  HTTP proxy on the head node only, expects an external load balancer in front of the Router replicas'
  own ports, and holds every stopping Router replica open for 30 s. Off, a proxy runs on every node as
  `proxy_location` says, and it was not slower on the CPU machine (RESULTS.md).
- `RAY_max_direct_call_object_size=2097152`: call arguments and results up to 2 MB travel inside the
  call instead of through the shared-memory object store (Ray's default: 100 KB), whose puts and gets go
  through the node's raylet. A 448^2 image's prepared rows (1.2 MB, from the Router or a media replica to
  the LLM replica) are one such argument: on the CPU machine its hop (dispatch and start) took 8.5-9.4 ms
  inline against 12.3-15.4 ms through the store, and the served app at concurrency 4 ran 20.1-21.2
  against 19.0-19.7 req/s (benchmarks/results/2026-12-02-replicas-routers-scale-up-h200.md). 512 KB (which
  only a data URL fitted) had served 10% more than 100 KB on an H200 (2026-11-23). The embeddings and a
  1024^2 image's rows (6 MB) still go through the store.

A variable already set in the environment wins, so `RAY_SERVE_THROUGHPUT_OPTIMIZED=0` turns the mode off.
"""

from __future__ import annotations

import os

SERVE_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_max_direct_call_object_size": str(2 * 1024 * 1024),
}


def apply_serve_env() -> dict[str, str]:
    """Sets SERVE_ENV's variables that are not set yet, in this process (before it starts Ray); returns
    the values in effect."""
    for k, v in SERVE_ENV.items():
        os.environ.setdefault(k, v)
    return {k: os.environ[k] for k in SERVE_ENV}


if __name__ == "__main__":  # `env $(python -m deployments.ray_env) serve run ...` (the Makefile)
    print(" ".join(f"{k}={v}" for k, v in apply_serve_env().items()))
