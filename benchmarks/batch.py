"""Offline batch throughput in images/s: N requests of one 448^2 image each (32-word prompt, 16 output
tokens with `ignore_eos`, as benchmarks/serve.py's `image` workload), run through `app.batch` on this
machine's GPUs. Compare with the serving saturation throughput of benchmarks/serve.py on the same GPUs
(issue 15's target: >= 1.3x).

    python benchmarks/batch.py --num-gpus 4 --n 4000 --out $OUT/batch.json
    python benchmarks/batch.py --num-gpus 1 --n 2000 --media data      # images inline as data: URLs

The images are distinct (no embedding-cache hits). By default they are JPEG files under a file root,
the shape of a real captioning job (`--media data` puts them in the JSONL instead). Pool sizes:
one LLM and one encoder actor per GPU (colocated, as serving's `colocate`), media actors from
--media-actors. The rate is measured from the pools being ready to the last row written, so model
loading and graph capture are not in it; `startup_s` reports them.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import json
import os
import resource
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.media.synthetic import image_bytes  # noqa: E402
from benchmarks.serve import Workload, deep_merge, map_in_processes  # noqa: E402

GPU_PRESET = Path(__file__).resolve().parent.parent / "configs" / "qwen3-vl-2b-gpu.yaml"


def _request_line(work: Workload, images: Path, media: str, i: int) -> str:
    """Request i's JSONL line (the serving benchmark's body, with an id); with `files`, its image is
    written under `images` and the body names the file."""
    name = None
    if media == "files":
        name = f"{i:07d}.jpg"
        (images / name).write_bytes(image_bytes(work.image_size, work.image_size, i, "JPEG"))
    body = work.body(i, image_url=name)
    body.pop("stream_options", None)
    return json.dumps({"id": f"img-{i}", **body}) + "\n"


def write_requests(folder: Path, n: int, size: int, words: int, tokens: int, media: str) -> Path:
    """`n` requests, one image each, made in a pool of processes (about 9 ms per 448² JPEG: 16,000 took
    over two minutes in one process)."""
    work = Workload("image", image_size=size, prompt_words=words, output_tokens=tokens)
    images = folder / "images"
    images.mkdir(parents=True, exist_ok=True)
    path = folder / "requests.jsonl"
    lines = map_in_processes(functools.partial(_request_line, work, images, media), range(n))
    with path.open("w") as f:
        f.writelines(lines)
    return path


def batch_config(a: argparse.Namespace, file_root: str) -> dict:
    app = yaml.safe_load(GPU_PRESET.read_text())["applications"][0]["args"] if a.num_gpus else \
        {"model": "embedded:tiny"}
    app = deep_merge(app, {"model": a.model} if a.model else {})
    # A batch keeps the encoder's queue deep: wait a little longer for a batch to fill its budget.
    app = deep_merge(app, {"encoder": {"batch_wait_ms": a.encoder_wait_ms}})
    # the batch job's stages follow it (fused: no encoder pool; the preset's LLM actors per GPU)
    app["placement"] = app.get("placement", {}) | {"policy": a.placement} | (
        {"llm_replicas_per_gpu": a.llm_actors_per_gpu} if a.llm_actors_per_gpu else {})
    gpus = max(a.num_gpus, 1)
    fused = a.num_gpus and a.placement in ("auto", "fused")
    llm = gpus * (app["placement"].get("llm_replicas_per_gpu", 1) if fused else 1)
    cpus = 1 if a.num_gpus else 0.5  # the CPU run fits a 2-core machine
    return {"app": app, "file_root": file_root, "shard_rows": 1000, "progress_interval_s": 5,
            "media_pool": {"min_size": a.media_actors, "max_size": a.max_media_actors or a.media_actors,
                           "num_cpus": cpus, "max_in_flight": 8},
            "encoder_pool": {"min_size": gpus, "max_size": gpus, "num_cpus": cpus, "max_in_flight": 256},
            "llm_pool": {"min_size": llm, "max_size": llm, "num_cpus": cpus}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=4000, help="requests (one image each)")
    p.add_argument("--num-gpus", type=int, default=0, help="GPUs (0: the CPU with the tiny model)")
    p.add_argument("--model", help="default: the qwen3-vl-2b preset on GPUs, embedded:tiny on the CPU")
    p.add_argument("--image-size", type=int, default=448)
    p.add_argument("--prompt-words", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--media", choices=["files", "data"], default="files")
    p.add_argument("--media-actors", type=int, default=max(1, min(16, (os.cpu_count() or 2) // 4)))
    p.add_argument("--max-media-actors", type=int, default=0, help="default: --media-actors")
    p.add_argument("--encoder-wait-ms", type=float, default=20.0)
    p.add_argument("--placement", choices=["auto", "fused", "colocate"], default="auto",
                   help="app.serving.placement.policy (auto: fused on GPUs)")
    p.add_argument("--llm-actors-per-gpu", type=int, default=0,
                   help="fused LLM actors sharing each GPU (default: the GPU preset's llm_replicas_per_gpu)")
    p.add_argument("--workdir", default="/tmp/vlm-batch-bench", help="requests, images and output")
    p.add_argument("--out", help="write the result JSON here")
    a = p.parse_args()

    import ray

    from app.batch.config import BatchConfig
    from app.batch.job import run_job

    work = Path(a.workdir)
    t0 = time.perf_counter()
    requests = write_requests(work, a.n, a.image_size, a.prompt_words, a.output_tokens, a.media)
    print(f"wrote {a.n} requests in {time.perf_counter() - t0:.1f} s", flush=True)
    out = work / f"out-{int(time.time())}"
    cfg = BatchConfig(**batch_config(a, str(work / "images")))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if a.num_gpus and "CUDA_VISIBLE_DEVICES" not in os.environ:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(a.num_gpus))
    ray.init(include_dashboard=False, log_to_driver=False, num_gpus=a.num_gpus)
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    report = asyncio.run(run_job(cfg, str(requests), str(out)))
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    # the driver (this process) handles every row: if it nears one core, it is the bottleneck
    driver_cores = (cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime) / max(
        report["elapsed_s"] + report["startup_s"], 1e-9)
    images_per_s = report["media_items"] / report["elapsed_s"]
    result = {"images_per_s": round(images_per_s, 2), "requests": a.n, "num_gpus": a.num_gpus,
              "image_size": a.image_size, "output_tokens": a.output_tokens, "media": a.media,
              "media_actors": a.media_actors, "driver_cores": round(driver_cores, 2), "config": cfg.model_dump(), "report": report}
    print(f"\n| GPUs | requests | images/s | rows/s | output tok/s | startup s | encoder graph hit rate | "
          f"items/batch |\n|---|---|---|---|---|---|---|---|\n| {a.num_gpus} | {a.n} | {images_per_s:.1f} | "
          f"{report['rows_per_s']:.1f} | {report['completion_tokens_per_s']:.0f} | {report['startup_s']:.0f} | "
          f"{report['encoder']['graph_hit_rate']:.2f} | {report['encoder']['items_per_batch']:.1f} |")
    print(f"driver process: {driver_cores:.2f} cores on average (1.0 = one busy Python thread)")
    if report["failed"]:
        errors = collections.Counter(
            f"{r['status']} {r['error'].get('code')}: {r['error']['message'][:120]}"
            for f in sorted(out.glob("part-*.jsonl")) for r in map(json.loads, f.read_text().splitlines())
            if "error" in r)
        result["errors"] = dict(errors)
        print(f"WARNING: {report['failed']} rows failed; see {out}: {dict(errors.most_common(3))}", file=sys.stderr)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
