"""How long Ray Serve's autoscaler takes to ask for a second LLM replica once load arrives, by the
autoscaling config's metrics settings (CPU machine, tiny model; the controller's logic is the same on GPUs).

In Ray 2.60 a handle and a replica record their requests in flight every min(0.2 x `look_back_period_s`,
`metrics_interval_s`) and push them to the controller every `metrics_interval_s` (default 10 s; the field
is marked deprecated in favour of environment variables that 2.60 does not read yet); the controller
averages the points of the last `look_back_period_s` (default 30 s). A step of load therefore waits for a
push, and then for the average to cross the target.

    python benchmarks/autoscale_reaction.py --variants "10 30" "1 10" --rounds 2 --out results.json

Each variant is "METRICS_INTERVAL_S LOOK_BACK_PERIOD_S"; each round deploys the app fresh per variant
(alternating), opens `--streams` long streamed answers at once, and reports the seconds from the load's
start to the controller's first decision for two replicas (a replica STARTING, from `serve.status()`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BODY = {"messages": [{"role": "user", "content": "tell me everything"}], "max_tokens": 8000, "temperature": 0,
        "stream": True, "ignore_eos": True}


def app_config(port: int, interval_s: float, look_back_s: float, cache_dir: str | None) -> dict:
    """serve_config.yaml with one CPU Router and media replica, and an LLM that autoscales 1-2 replicas at
    2 requests each, upscale_delay_s 0, with the variant's metrics settings."""
    conf = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    conf["http_options"] = {"host": "127.0.0.1", "port": port}
    app = conf["applications"][0]
    app["args"]["placement"].update({"num_cpus": 0.25})
    if cache_dir:
        app["args"]["cache_dir"] = cache_dir
    deps = {d["name"]: d for d in app["deployments"]}
    for name in ("Router", "MediaPreprocessor"):
        deps[name]["autoscaling_config"].update({"min_replicas": 1, "max_replicas": 1})
        deps[name]["ray_actor_options"] = {"num_cpus": 0.25}
    deps["LLM"]["autoscaling_config"] = {
        "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2, "upscale_delay_s": 0,
        "downscale_delay_s": 600, "metrics_interval_s": interval_s, "look_back_period_s": look_back_s,
        "policy": {"policy_function": "app.serving.autoscaling:LLMAutoscalingPolicy"}}
    return conf


def llm_replicas() -> int:
    from ray import serve

    states = serve.status().applications["vlm"].deployments["LLM"].replica_states
    return sum(n for s, n in states.items() if s in ("STARTING", "UPDATING", "RUNNING"))


def open_streams(port: int, n: int, stop: threading.Event) -> threading.Thread:
    async def client() -> None:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=300) as c:
            while not stop.is_set():
                try:
                    async with c.stream("POST", "/v1/chat/completions", json=BODY) as resp:
                        async for _ in resp.aiter_lines():
                            if stop.is_set():
                                return
                except httpx.HTTPError:
                    await asyncio.sleep(0.2)

    async def main() -> None:
        await asyncio.gather(*(client() for _ in range(n)))

    t = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    t.start()
    return t


def one_run(port: int, interval_s: float, look_back_s: float, streams: int, timeout_s: float,
            cache_dir: str | None) -> dict:
    import ray
    from ray import serve
    from ray.serve._private import api as serve_api
    from ray.serve.schema import ServeDeploySchema

    from deployments.ray_env import apply_serve_env

    apply_serve_env()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    stop = threading.Event()
    try:
        client = serve_api.serve_start(http_options={"host": "127.0.0.1", "port": port})
        client.deploy_apps(ServeDeploySchema.model_validate(app_config(port, interval_s, look_back_s, cache_dir)),
                           _blocking=True)
        assert llm_replicas() == 1
        t0 = time.perf_counter()
        open_streams(port, streams, stop)
        decided = None
        while time.perf_counter() - t0 < timeout_s:
            if llm_replicas() > 1:
                decided = time.perf_counter() - t0
                break
            time.sleep(0.1)
        return {"metrics_interval_s": interval_s, "look_back_period_s": look_back_s, "streams": streams,
                "decision_s": decided}
    finally:
        stop.set()
        serve.shutdown()
        ray.shutdown()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=["10 30", "1 10"],
                   help='each "METRICS_INTERVAL_S LOOK_BACK_PERIOD_S" (Ray 2.60\'s defaults: "10 30")')
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--streams", type=int, default=6, help="long streams opened at once (6 against 2 per replica)")
    p.add_argument("--timeout-s", type=float, default=90.0)
    p.add_argument("--port", type=int, default=8791)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    variants = [tuple(float(x) for x in v.split()) for v in a.variants]
    runs = []
    for r in range(a.rounds):
        for interval_s, look_back_s in variants:
            run = one_run(a.port, interval_s, look_back_s, a.streams, a.timeout_s, a.cache_dir)
            runs.append({"round": r, **run})
            print(json.dumps(runs[-1]), flush=True)
    summary = {}
    for interval_s, look_back_s in variants:
        got = [x["decision_s"] for x in runs if (x["metrics_interval_s"], x["look_back_period_s"]) ==
               (interval_s, look_back_s)]
        done = [g for g in got if g is not None]
        summary[f"{interval_s:g} {look_back_s:g}"] = {"decision_s": got,
                                                      "median_s": statistics.median(done) if done else None}
    out = {"runs": runs, "summary": summary}
    print(json.dumps(summary, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
