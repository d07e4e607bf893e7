"""The batch driver's own CPU per row, with real Ray calls and stand-in stage actors that do almost
nothing (a media actor that parses the request, an LLM actor that waits 0.5 s), so only the driver's
work is left to measure: `python benchmarks/batch_driver.py --rows 4000 --chunk-rows 1 16`.

Under `fused` (the GPU default) a row costs the driver two actor calls (media, then LLM) plus its
share of the pools' bookkeeping and the shard writer; on four H200s that capped a row-by-row job at
488 rows/s, as on two. Printed per chunk size: rows/s, and the driver's CPU milliseconds per row
(getrusage of this process, Ray's threads in it included).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from app.api.schemas import parse_chat_request  # noqa: E402
from app.batch.workers import LLMWorker, MediaWorker, Prepared  # noqa: E402

ANSWER = {"id": "chatcmpl-0", "object": "chat.completion", "created": 0, "model": "m",
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "word " * 16},
                       "finish_reason": "length", "logprobs": None}],
          "usage": {"prompt_tokens": 322, "completion_tokens": 16, "total_tokens": 338}}


class StandInMedia:
    """Parses the request as the media stage does; the prompt and patch rows are stand-ins of the
    2B shape's size for one 448² image (330 prompt tokens, 1,024 rows of 1,536 bytes)."""

    prepare_many = MediaWorker.prepare_many

    def __init__(self, config: dict, file_root: str | None = None):
        pass

    def ready(self) -> bool:
        return True

    async def prepare(self, body: dict):
        req = parse_chat_request(body, 16, 4, False)
        gen = {"input_ids": list(range(330)), "mm_token_type_ids": [0] * 330, "grids": [(1, 32, 32)],
               "media_keys": ["k" * 64], "max_tokens": 16}
        return Prepared(req, gen, 1), [(np.zeros((1024, 1536), np.uint8), (1, 32, 32), "k")]


class StandInLLM:
    generate_from_media_many = LLMWorker.generate_from_media_many
    _many = LLMWorker._many

    def __init__(self, config: dict, fused: bool = False):
        pass

    def ready(self) -> bool:
        return True

    def capacity(self) -> int:
        return 512

    async def generate_from_media(self, prepared, payload) -> dict:
        await asyncio.sleep(0.5)
        return ANSWER

    def encoder_stats(self) -> dict:
        return {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4000)
    p.add_argument("--chunk-rows", type=int, nargs="+", default=[1, 16])
    a = p.parse_args()

    import ray

    import app.batch.job as job
    from app.batch.config import BatchConfig, PoolConfig

    job.MediaWorker, job.LLMWorker = StandInMedia, StandInLLM
    job.resolve_policy = lambda placement, gpus: "fused"  # the GPU default's shape: media, then LLM
    work = Path(tempfile.mkdtemp())
    body = {"model": "bench", "max_tokens": 16, "temperature": 0, "ignore_eos": True, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "0000001.jpg"}},
                                     {"type": "text", "text": "describe the scene " * 8}]}]}
    with open(work / "in.jsonl", "w") as f:
        f.writelines(json.dumps({"id": f"img-{i}", **body}) + "\n" for i in range(a.rows))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    print("| rows per stage call | rows/s | driver CPU ms per row |\n|---|---|---|")
    for chunk in a.chunk_rows:
        cfg = BatchConfig(chunk_rows=chunk, progress_interval_s=60,
                          media_pool=PoolConfig(min_size=2, max_size=2, num_cpus=0, max_in_flight=64),
                          llm_pool=PoolConfig(min_size=1, max_size=1, num_cpus=0))
        cpu0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        with open(os.devnull, "w") as quiet:
            report = asyncio.run(job.run_job(cfg, str(work / "in.jsonl"), str(work / f"out-{chunk}"), quiet))
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime
        assert report["done"] == a.rows, report
        print(f"| {chunk} | {report['rows_per_s']:.0f} | {1e3 * cpu / a.rows:.2f} |  ({time.perf_counter() - t0:.0f} s)")
    ray.shutdown()


if __name__ == "__main__":
    main()
