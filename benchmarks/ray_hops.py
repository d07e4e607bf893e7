"""What Ray Serve's hops cost with nothing else in them: the floor under time to first token.

A request to the application crosses the HTTP proxy, the Router (which reads the body from the proxy),
a MediaPreprocessor call (its argument: the image's data URL) and the return of the prepared rows. This
script serves a stand-in for exactly that path, with no work in it: an ingress that reads the body,
parses it and calls a second deployment with the URL, which returns at once with rows of the given
size. One client sends requests one at a time, and each stage's wall clock is read on the same machine.

Columns (median ms): proxy->ingress (the client's send to the ingress handler starting), body (reading
the request body from the proxy), parse, dispatch (the handle call until its object reference exists),
to start (the call to the callee starting), back (the callee's start to its result in the ingress),
total (the client's whole request).

    python3 benchmarks/ray_hops.py --body-bytes 1000 240000 --return-bytes 1200000
    RAY_SERVE_THROUGHPUT_OPTIMIZED=0 RAY_max_direct_call_object_size=102400 python3 benchmarks/ray_hops.py  (Ray's defaults)
    python3 benchmarks/ray_hops.py --direct   (direct ingress: the client talks to the ingress replica's own
                                               HTTP port, no proxy; proxy->ingress is then client->ingress)
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import ray
from fastapi import FastAPI, Request
from ray import serve

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deployments.ray_env import apply_serve_env  # noqa: E402

api = FastAPI()


@serve.deployment(max_ongoing_requests=64)
class Callee:
    async def prepare(self, url: str, return_bytes: int):
        return time.time(), np.zeros(return_bytes, np.uint8)


@serve.deployment(max_ongoing_requests=64)
@serve.ingress(api)
class Ingress:
    def __init__(self, callee):
        self.callee = callee.options(_by_reference=True)  # as the Router's handles

    @api.post("/hop")
    async def hop(self, request: Request):
        t0 = time.time()
        body = await request.body()
        t1 = time.time()
        d = json.loads(body)
        t2 = time.time()
        obj = await self.callee.prepare.remote(d["url"], d["return_bytes"])._to_object_ref()
        t3 = time.time()
        started, _ = await obj
        t4 = time.time()
        return {"t0": t0, "body": t1 - t0, "parse": t2 - t1, "dispatch": t3 - t2, "to start": started - t2,
                "back": t4 - started}


def direct_port(first: int = 30000, last: int = 31000) -> int:
    """The ingress replica's own HTTP port under direct ingress (Ray allocates it from this range)."""
    import socket

    for port in range(first, last):
        with socket.socket() as sock:
            sock.settimeout(0.05)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return port
    raise RuntimeError("no direct-ingress port is listening")


def main() -> None:
    import requests

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--body-bytes", type=int, nargs="+", default=[1000, 240000])
    p.add_argument("--return-bytes", type=int, default=1_200_000, help="a 448^2 image's uint8 rows")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--port", type=int, default=8799)
    p.add_argument("--direct", action="store_true", help="direct ingress: requests go to the replica's own port")
    a = p.parse_args()
    if a.direct:
        os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] = "1"
    env = apply_serve_env()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": a.port})
    serve.run(Ingress.bind(Callee.bind()), name="hops", route_prefix="/")
    port = direct_port() if a.direct else a.port
    print(f"RAY_SERVE_THROUGHPUT_OPTIMIZED={env['RAY_SERVE_THROUGHPUT_OPTIMIZED']}, direct ingress "
          f"{env['RAY_SERVE_ENABLE_DIRECT_INGRESS']} (requests to port {port}), rows back {a.return_bytes} bytes, "
          f"{a.requests} requests one at a time, {os.cpu_count()} cores\n")
    cols = ["proxy->ingress", "body", "parse", "dispatch", "to start", "back", "total"]
    print("| body bytes | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols))
    with requests.Session() as s:
        for size in a.body_bytes:
            body = json.dumps({"url": "a" * size, "return_bytes": a.return_bytes}).encode()
            rows = []
            for i in range(a.requests + 5):
                t = time.time()
                resp = s.post(f"http://127.0.0.1:{port}/hop", data=body, headers={"content-type": "application/json"})
                resp.raise_for_status()
                r = resp.json()
                r["proxy->ingress"], r["total"] = r["t0"] - t, time.time() - t
                if i >= 5:  # warm-up
                    rows.append(r)
            print(f"| {size} | " + " | ".join(f"{1e3 * statistics.median(r[c] for r in rows):.2f}" for c in cols) + " |")
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
