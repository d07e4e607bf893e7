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
- `RAY_max_direct_call_object_size=524288`: call arguments and results up to 512 KB travel inside the
  call instead of through the shared-memory object store (Ray's default: 100 KB). A 448^2 JPEG's data URL
  (240 KB in the benchmark) goes from the Router to a media replica as one such argument; inline, the
  hop cost it 0.5-1.2 ms more than a 1 KB body, against 3.3-4.8 ms through the store (benchmarks/ray_hops.py
  on the CPU machine). The prepared rows (1.2 MB) and the embeddings still go through the store: 2 MB,
  which takes the rows inline too, was faster on the CPU machine and not on one H100, where the LLM
  replicas then held the GIL 23% more (deserialising the rows out of each call) and the serving processes
  used more CPU at most Poisson rates, for the same goodput (benchmarks/results/2026-12-02-h100-decode-and-goodput.md).

A variable already set in the environment wins, so `RAY_SERVE_THROUGHPUT_OPTIMIZED=0` turns the mode off.
"""

from __future__ import annotations

import os

SERVE_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_max_direct_call_object_size": str(512 * 1024),
}


def apply_serve_env() -> dict[str, str]:
    """Sets SERVE_ENV's variables that are not set yet, in this process (before it starts Ray); returns
    the values in effect."""
    for k, v in SERVE_ENV.items():
        os.environ.setdefault(k, v)
    return {k: os.environ[k] for k in SERVE_ENV}


if __name__ == "__main__":  # `env $(python -m deployments.ray_env) serve run ...` (the Makefile)
    print(" ".join(f"{k}={v}" for k, v in apply_serve_env().items()))
