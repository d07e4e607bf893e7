"""Encoder -> LLM hand-off: pass the encoder's DeploymentResponse to the LLM handle directly, or
await the embeddings in the router and send them again. Two stand-in deployments carry
embeddings of the real sizes (main + 3 deepstack features, bf16), so only the transfer differs.

    python benchmarks/handoff.py --tokens 196 784 3136 --hidden 2048 --runs 30
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from ray import serve


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Encoder:
    """Returns the same pre-made embeddings each call: only serialisation and transfer are timed."""

    def __init__(self):
        self.made = {}

    def encode(self, tokens: int, hidden: int):
        if (tokens, hidden) not in self.made:
            t = torch.randn(tokens, hidden).to(torch.bfloat16)
            self.made[tokens, hidden] = [(t, [t.clone() for _ in range(3)])]
        return self.made[tokens, hidden]


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Consumer:
    def consume(self, encoded) -> int:
        main, deepstack = encoded[0]
        return main.numel() + sum(d.numel() for d in deepstack)


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Driver:
    def __init__(self, encoder, consumer):
        self.encoder, self.consumer = encoder, consumer

    async def run(self, mode: str, tokens: int, hidden: int, runs: int) -> list[float]:
        out = []
        for _ in range(runs):
            t0 = time.perf_counter()
            enc = self.encoder.encode.remote(tokens, hidden)
            if mode == "through_router":
                enc = await enc
            await self.consumer.consume.remote(enc)
            out.append((time.perf_counter() - t0) * 1e3)
        return out


def main() -> None:
    import ray

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, nargs="+", default=[196, 784, 3136])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--runs", type=int, default=30)
    a = p.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    handle = serve.run(Driver.bind(Encoder.bind(), Consumer.bind()), name="handoff", route_prefix=None)
    print("| merged tokens | MB per item | direct hand-off ms (p99) | through the router ms (p99) | ratio |")
    print("|---|---|---|---|---|")
    for tokens in a.tokens:
        mb = tokens * a.hidden * 2 * 4 / 2**20
        res = {}
        for mode in ("direct", "through_router"):
            handle.run.remote(mode, tokens, a.hidden, 3).result()  # warm-up
            xs = sorted(handle.run.remote(mode, tokens, a.hidden, a.runs).result())
            res[mode] = (statistics.median(xs), xs[int(0.99 * (len(xs) - 1))])
        d, r = res["direct"], res["through_router"]
        print(f"| {tokens} | {mb:.1f} | {d[0]:.2f} ({d[1]:.2f}) | {r[0]:.2f} ({r[1]:.2f}) | {r[0] / d[0]:.2f}x |",
              flush=True)
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
