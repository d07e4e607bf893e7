"""Ray Data or Ray core actors for app.batch? The same rows through the same stage classes
(app/batch/workers.py) both ways, on this machine (the CPU and the tiny model by default):

- `actors`: app.batch.job.run_job (autoscaled core actor pools, each row its own calls, many rows in
  flight per actor);
- `data`: Ray Data `map_batches` with one actor pool per stage (ActorPoolStrategy); each call gets a
  batch of rows and returns when all of them are done, so the LLM's continuous batching sees at most
  one batch's rows at a time.

    python benchmarks/batch_designs.py --n 200 --batch-size 16

Ray Data needs pandas and pyarrow (not in the GPU machine's dependency bundle).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.batch import write_requests  # noqa: E402

APP = {"model": "embedded:tiny", "encoder": {"min_budget": 64, "max_budget": 2048, "batch_wait_ms": 20}}


class _Stage:
    """A worker with an event loop of its own, so its async methods (and the encoder's batcher and the
    engine's streams, which bind to a loop) keep one loop across Ray Data's synchronous calls."""

    def __init__(self, make):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.worker = make()

    def gather(self, coros):
        async def all_():
            return await asyncio.gather(*coros)
        return asyncio.run_coroutine_threadsafe(all_(), self.loop).result()


class MediaStage(_Stage):
    def __init__(self):
        from app.batch.workers import MediaWorker

        super().__init__(lambda: MediaWorker(APP, FILE_ROOT))

    def __call__(self, batch):
        outs = self.gather([self.worker.prepare(json.loads(b)) for b in batch["body"]])
        return {"id": batch["id"], "prep": [pickle.dumps(o) for o in outs]}


class EncoderStage(_Stage):
    def __init__(self):
        from app.batch.workers import EncoderWorker

        super().__init__(lambda: EncoderWorker(APP))

    def __call__(self, batch):
        preps = [pickle.loads(p) for p in batch["prep"]]

        async def one(prepared, payload):
            return (await self.worker.encode(payload))[1] if payload else []
        encs = self.gather([one(*p) for p in preps])
        return {"id": batch["id"], "prep": [pickle.dumps(p[0]) for p in preps],
                "enc": [pickle.dumps(e) for e in encs]}


class LLMStage(_Stage):
    def __init__(self):
        from app.batch.workers import LLMWorker

        super().__init__(lambda: LLMWorker(APP))

    def __call__(self, batch):
        outs = self.gather([self.worker.generate(pickle.loads(p), pickle.loads(e))
                            for p, e in zip(batch["prep"], batch["enc"])])
        return {"id": batch["id"], "out": [json.dumps(o, default=str) for o in outs]}


FILE_ROOT = __import__("os").environ.get("VLM_BATCH_FILE_ROOT", "")


def run_data(requests: Path, batch_size: int) -> dict:
    import ray
    from ray.data import ActorPoolStrategy

    lines = [json.loads(x) for x in requests.read_text().splitlines()]
    t0 = time.perf_counter()
    ds = ray.data.from_items([{"id": x.pop("id"), "body": json.dumps(x)} for x in lines])
    opts = {"batch_size": batch_size, "num_cpus": 0.5, "batch_format": "numpy"}
    ds = ds.map_batches(MediaStage, compute=ActorPoolStrategy(size=1), **opts)
    ds = ds.map_batches(EncoderStage, compute=ActorPoolStrategy(size=1), **opts)
    ds = ds.map_batches(LLMStage, compute=ActorPoolStrategy(size=1), **opts)
    rows = ds.take_all()
    wall = time.perf_counter() - t0
    assert len(rows) == len(lines)
    return {"design": "ray_data", "rows": len(rows), "wall_s": round(wall, 2), "rows_per_s_wall": len(rows) / wall}


def run_actors(requests: Path, out: Path) -> dict:
    from app.batch.config import BatchConfig
    from app.batch.job import run_job

    cfg = BatchConfig(app=APP, file_root=FILE_ROOT, media_pool={"num_cpus": 0.5, "max_size": 1},
                      encoder_pool={"num_cpus": 0.5}, llm_pool={"num_cpus": 0.5})
    t0 = time.perf_counter()
    report = asyncio.run(run_job(cfg, str(requests), str(out)))
    wall = time.perf_counter() - t0
    return {"design": "actors", "rows": report["done"], "wall_s": round(wall, 2), "rows_per_s_wall": report["done"] / wall,
            "startup_s": report["startup_s"], "rows_per_s_after_startup": report["rows_per_s"]}


def main() -> None:
    global FILE_ROOT
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=16, help="Ray Data rows per call (the CPU engine runs 8)")
    p.add_argument("--workdir", default="/tmp/vlm-batch-designs")
    p.add_argument("--out")
    a = p.parse_args()
    import os

    import ray

    work = Path(a.workdir)
    requests = write_requests(work, a.n, a.image_size, 32, 16, "files")
    FILE_ROOT = str(work / "images")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # FILE_ROOT must reach Ray Data's actors, which import this module afresh
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"VLM_BATCH_FILE_ROOT": FILE_ROOT}})
    results = [run_actors(requests, work / f"out-{int(time.time())}"), run_data(requests, a.batch_size)]
    for r in results:
        print(json.dumps(r))
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
