"""A model of many routers sharing a stale view of the LLM replicas' load, to compare app.serving.routing's
choices without GPUs: `python benchmarks/routing_model.py [--routers 12 --replicas 8 --clients 1024]`.

Closed loop: each client sends a request, waits for its answer, pauses (`--think-ms`, the media stage)
and sends again, through router `client % routers`. Each replica batches continuously: an engine step
takes `step_ms + per_seq_ms * running` and a request needs `--steps` of them (prefill, then decodes).
Replicas report (running, waiting) every `--period-s`, at staggered times; each router also counts the
requests it has in flight at each replica, as Ray's per-handle cache does. The routers score replicas
with app.serving.routing's own ReplicaLoad and `choose`, so the model runs the code that serves.

Printed per policy: requests per second and each replica's busy share. The step costs are rough fits to
the 2B shape on an H200; the point is the gap between policies, not the figures.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.serving.routing import ReplicaLoad, choose  # noqa: E402


def simulate(sample: int, routers: int = 12, replicas: int = 8, clients: int = 1024, seconds: float = 12.0,
             period_s: float = 1.0, steps: int = 17, step_ms: float = 8.0, per_seq_ms: float = 0.12,
             max_seqs: int = 256, think_ms: float = 50.0, dt: float = 0.002, seed: int = 0) -> dict:
    rng = random.Random(seed)
    running: list[list[list[int]]] = [[] for _ in range(replicas)]  # [steps left, router, client]
    waiting: list[deque] = [deque() for _ in range(replicas)]
    until_step = [0.0] * replicas
    reported = [(0, 0)] * replicas
    next_report = [rng.random() * period_s for _ in range(replicas)]
    in_flight = [[0] * replicas for _ in range(routers)]
    ready = [rng.random() * think_ms / 1e3 for _ in range(clients)]
    idle = set(range(clients))
    busy = [0.0] * replicas
    done, t = 0, 0.0
    while t < seconds:
        for c in [c for c in idle if ready[c] <= t]:
            r = c % routers
            loads = {k: ReplicaLoad(in_flight[r][k], *reported[k]) for k in range(replicas)}
            k = choose(loads, sample, rng=rng)[0]
            in_flight[r][k] += 1
            waiting[k].append([steps, r, c])
            idle.discard(c)
        for k in range(replicas):
            while waiting[k] and len(running[k]) < max_seqs:
                running[k].append(waiting[k].popleft())
            if not running[k]:
                until_step[k] = 0.0
            else:
                busy[k] += dt
                until_step[k] -= dt
                if until_step[k] <= 0:
                    until_step[k] += (step_ms + per_seq_ms * len(running[k])) / 1e3
                    for req in running[k]:
                        req[0] -= 1
                        if req[0] == 0:
                            done += 1
                            in_flight[req[1]][k] -= 1
                            ready[req[2]] = t + think_ms / 1e3
                            idle.add(req[2])
                    running[k] = [req for req in running[k] if req[0] > 0]
            if t >= next_report[k]:
                reported[k] = (len(running[k]), len(waiting[k]))
                next_report[k] += period_s
        t += dt
    return {"req_per_s": done / seconds, "busy": [b / seconds for b in busy]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--routers", type=int, default=12)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--clients", type=int, default=1024)
    p.add_argument("--seconds", type=float, default=12.0)
    p.add_argument("--period-s", type=float, default=1.0)
    p.add_argument("--think-ms", type=float, default=50.0)
    p.add_argument("--samples", type=int, nargs="+", default=[0, 2, 3], help="0 ranks every replica")
    p.add_argument("--seeds", type=int, default=2)
    a = p.parse_args()
    print("| replicas drawn per request | req/s (per seed) | replicas busy, mean (min-max) |\n|---|---|---|")
    for sample in a.samples:
        runs = [simulate(sample, a.routers, a.replicas, a.clients, a.seconds, a.period_s, think_ms=a.think_ms,
                         seed=s) for s in range(a.seeds)]
        busy = [b for r in runs for b in r["busy"]]
        rates = ", ".join(f"{r['req_per_s']:.0f}" for r in runs)
        print(f"| {sample or 'all (ranked)'} | {rates} | "
              f"{100 * sum(busy) / len(busy):.0f}% ({100 * min(busy):.0f}-{100 * max(busy):.0f}%) |")


if __name__ == "__main__":
    main()
