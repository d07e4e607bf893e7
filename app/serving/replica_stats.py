"""One answer for several replicas: `/v1/encoder/stats` and `/v1/llm/load` merge what every replica
reports (Ray Serve's `handle.broadcast`), so clients and the benchmark see the deployment, however
many replicas autoscaling runs. Counters are summed and ratios recomputed from the summed parts; the
per-replica reports stay under "replicas" (graph budgets and auto-tune tables only make sense there).
The GPU-time counters (app/gpu/timing.py) are summed too; how each replica measured them
(`*_gpu_clock`: CUDA events or the host clock) is listed once per kind.
"""

from __future__ import annotations

ENCODER_COUNTERS = ("graph_hits", "uniform_hits", "idle_captures", "idle_capture_ms", "eager_batches", "real_tokens",
                    "padded_tokens", "items", "batches", "pieces", "cancelled_pieces", "batch_tokens",
                    "batch_budget_tokens", "cache_hits", "cache_misses", "cache_entries", "cache_bytes",
                    "encoder_gpu_ms_total", "encoder_timed_batches", "encoder_gpu_interleaved", "encoder_gpu_dropped",
                    "encoder_gpu_pending")
ENGINE_GPU_COUNTERS = ("engine_gpu_ms_total", "engine_timed_steps", "engine_gpu_interleaved", "engine_gpu_dropped",
                       "engine_gpu_pending")
ENCODER_COUNTER_MAPS = ("eager_reasons", "per_budget")


def merge_encoder_stats(reports: list[dict]) -> dict:
    out: dict = {k: sum(r.get(k, 0) for r in reports) for k in ENCODER_COUNTERS}
    for name in ENCODER_COUNTER_MAPS:
        merged: dict = {}
        for r in reports:
            for k, v in r.get(name, {}).items():
                merged[k] = merged.get(k, 0) + v
        out[name] = merged
    tokens = out["real_tokens"] + out["padded_tokens"]
    out["padding_ratio"] = out["padded_tokens"] / tokens if tokens else 0.0
    out["items_per_batch"] = out["pieces"] / out["batches"] if out["batches"] else 0.0
    out["batch_fill"] = out["batch_tokens"] / out["batch_budget_tokens"] if out["batch_budget_tokens"] else 0.0
    waited = sum(r.get("queue_wait_ms_mean", 0.0) * r.get("pieces", 0) for r in reports)
    out["queue_wait_ms_mean"] = waited / out["pieces"] if out["pieces"] else 0.0
    out["queue_wait_ms_max"] = max((r.get("queue_wait_ms_max", 0.0) for r in reports), default=0.0)
    out["encoder_gpu_clock"] = _clocks(reports, "encoder_gpu_clock")
    out["num_replicas"] = len(reports)
    out["replicas"] = reports
    return out


def merge_llm_loads(reports: list[dict]) -> dict:
    """Engine load reports ({replica, running, waiting, kv_usage, ...}): requests summed, KV use averaged
    (every replica has a cache of its own) and its maximum; the engines' GPU-time counters summed."""
    kv = [float(r.get("kv_usage", 0.0)) for r in reports]
    return {"running": sum(int(r.get("running", 0)) for r in reports),
            "waiting": sum(int(r.get("waiting", 0)) for r in reports),
            "kv_usage": sum(kv) / len(kv) if kv else 0.0, "kv_usage_max": max(kv, default=0.0),
            **{k: sum(r.get(k, 0) for r in reports) for k in ENGINE_GPU_COUNTERS},
            "engine_gpu_clock": _clocks(reports, "engine_gpu_clock"),
            "num_replicas": len(reports),
            "replicas": sorted(reports, key=lambda r: str(r.get("replica", "")))}


def _clocks(reports: list[dict], key: str) -> str | None:
    """The replicas' GPU-time sources joined ("cuda_events"; "cuda_events,host_clock" if they differ);
    None when none reports one."""
    return ",".join(sorted({r[key] for r in reports if r.get(key)})) or None
