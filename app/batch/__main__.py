"""`python -m app.batch --input requests.jsonl --output out/ [--model M] [--config batch.yaml]`.

Connects to the Ray cluster named by `--address` or RAY_ADDRESS (as under `ray job submit`), else
starts a local one. A rerun with the same arguments resumes: ids already in the output are skipped.
Rows that a server-side failure left without an answer (a pool that gave up, retries run out) are not
in the output: the job then exits with RETRY_EXIT and says how many, and a rerun answers them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

RETRY_EXIT = 75  # EX_TEMPFAIL (sysexits.h): a temporary failure; the same command, run again, finishes the job


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m app.batch", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="JSONL (one chat-completion body with an 'id' per line) or .parquet")
    p.add_argument("--output", required=True, help="folder for part-NNNNN.jsonl shards and report.json")
    p.add_argument("--config", help="YAML/JSON BatchConfig (its app: block is serve_config.yaml's args:)")
    p.add_argument("--model", help="overrides app.model, e.g. embedded:tiny or a checkpoint path")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="overrides app.device")
    p.add_argument("--cache-dir", help="overrides app.cache_dir (embedded checkpoints)")
    p.add_argument("--file-root", help="directory that file paths and file:// URLs may read from")
    p.add_argument("--shard-rows", type=int, help="rows per output shard")
    p.add_argument("--chunk-rows", type=int, help="rows per call to a stage's actor (default 16)")
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else a new local cluster)")
    p.add_argument("--num-cpus", type=float, help="CPUs of a new local cluster")
    p.add_argument("--num-gpus", type=int, help="GPUs of a new local cluster")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import ray

    from .config import BatchConfig
    from .job import run_job

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = BatchConfig.load(args.config, model=args.model, device=args.device, cache_dir=args.cache_dir,
                           file_root=args.file_root, shard_rows=args.shard_rows,
                           chunk_rows=args.chunk_rows)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not ray.is_initialized():
        local = {} if (args.address or os.environ.get("RAY_ADDRESS")) else \
            {"num_cpus": args.num_cpus, "num_gpus": args.num_gpus, "include_dashboard": False}
        ray.init(address=args.address, log_to_driver=False, **local)
    report = asyncio.run(run_job(cfg, args.input, args.output))
    print(json.dumps(report, indent=2), file=sys.stdout)
    if report["left"]:
        print(f"{report['left']} of {report['rows']} rows have no answer yet: server-side failures, not their "
              f"input (the last: {report['left_error']}). The answered rows are kept; run the same command "
              f"again to answer the {report['left']} left.", file=sys.stderr)
        return RETRY_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
