"""Batch job configuration (pydantic, unknown fields refused as in AppConfig).

The serving configuration (`AppConfig`) is embedded whole under `app`, so a batch job decodes,
encodes and generates exactly as the server does with the same file. What is batch-only: the pools'
sizes and resources, the shard size, the root that file paths may read from, and retries.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import Field, model_validator

from ..config import AppConfig, _Strict


class PoolConfig(_Strict):
    """One stage's actor pool. It starts `min_size` actors and adds one at a time (at most one still
    starting) while rows wait for a free slot, up to `max_size`; an actor idle for `idle_s` above
    `min_size` is removed. An actor that cannot be placed yet stays pending, which is what asks a Ray
    autoscaler for another node."""

    min_size: int = Field(1, ge=1, description="actors started with the job and kept while it runs")
    max_size: int = Field(1, ge=1, description="most actors the pool grows to while rows wait for a slot")
    num_cpus: float = Field(0.5, ge=0, description="CPUs each actor reserves in Ray")
    num_gpus: float | None = Field(None, ge=0, description="None on a GPU cluster: LLM actors take a whole GPU "
                                   "each, encoder actors share them (colocated, pinned in turn); 0 without GPUs")
    max_in_flight: int = Field(8, ge=1, description="rows each actor holds at once (a chunk of more rows takes "
                               "a whole idle actor)")
    idle_s: float = Field(30.0, gt=0, description="an actor idle this long above min_size is removed")

    @model_validator(mode="after")
    def _check(self) -> PoolConfig:
        if self.min_size > self.max_size:
            raise ValueError("min_size must not exceed max_size")
        return self


def _media_pool() -> PoolConfig:
    # One media actor decodes with `media.worker_threads` threads; two chunks of rows (chunk_rows) keep
    # them busy while the other chunk's answers go back.
    return PoolConfig(min_size=1, max_size=4, num_cpus=1.0, num_gpus=0, max_in_flight=32)


def _encoder_pool() -> PoolConfig:
    # Many items queued at once let the encoder's batcher pack each batch up to the largest budget.
    return PoolConfig(min_size=1, max_size=1, num_cpus=0.5, max_in_flight=64)


def _llm_pool() -> PoolConfig:
    # max_in_flight is raised to the engine's max_num_seqs + what may wait (job.py), so continuous
    # batching always has a full batch and a queue behind it.
    return PoolConfig(min_size=1, max_size=1, num_cpus=0.5, max_in_flight=16)


# A batch job wants full encoder batches, not early first tokens: a longer window, kept even after an
# idle spell (the media stage often feeds the encoder slower than it encodes). Keys a file sets win.
BATCH_ENCODER_DEFAULTS = {"batch_wait_ms": 20.0, "batch_wait_when_idle": True}


class BatchConfig(_Strict):
    app: AppConfig = Field(AppConfig(encoder=BATCH_ENCODER_DEFAULTS), description="the serving config whole "
                           "(serve_config.yaml's args:), so a job answers as the server does; here "
                           "encoder.batch_wait_ms defaults to 20 and encoder.batch_wait_when_idle to true "
                           "(full batches, not early first tokens)")
    media_pool: PoolConfig = Field(default_factory=_media_pool, description="CPU actors that fetch, decode and "
                                   "patchify each row's media and build its prompt")
    encoder_pool: PoolConfig = Field(default_factory=_encoder_pool, description="vision encoder actors (none "
                                     "under the fused placement, where the LLM actors encode)")
    llm_pool: PoolConfig = Field(default_factory=_llm_pool, description="LLM engine actors; max_in_flight is "
                                 "raised to the engine's max_num_seqs plus its queue")
    shard_rows: int = Field(1000, ge=1, description="rows per output shard")
    chunk_rows: int = Field(16, ge=1, description="rows per call to a stage's actor: one Ray call costs the "
                            "driver about 2 ms of its one thread, which capped row-by-row jobs near 490 rows/s. "
                            "A chunk's answers return together, so its LLM slots are held until its longest "
                            "row ends: rows of very different max_tokens fill the engine better in smaller chunks")
    flush_interval_s: float = Field(60.0, gt=0, description="a partial shard is written after this long, so a "
                                    "kill loses at most this much work")
    file_root: str | None = Field(None, description="directory that file paths and file:// URLs may read from; "
                                  "None refuses file media")
    max_retries: int = Field(3, ge=0, description="per chunk for a dead actor, per row for an overloaded engine")
    progress_interval_s: float = Field(5.0, gt=0, description="seconds between progress lines on the driver's log")

    @classmethod
    def load(cls, path: str | None, **overrides) -> BatchConfig:
        """A YAML or JSON file (its `app:` block is serve_config.yaml's `args:`), then CLI overrides."""
        data: dict = {}
        if path:
            text = Path(path).read_text()
            if path.endswith((".yaml", ".yml")):
                import yaml

                data = yaml.safe_load(text) or {}
            else:
                data = json.loads(text)
        app = dict(data.get("app") or {})
        for key in ("model", "device", "cache_dir"):
            if overrides.get(key) is not None:
                app[key] = overrides[key]
        if app or "app" in data:
            app["encoder"] = BATCH_ENCODER_DEFAULTS | dict(app.get("encoder") or {})
            data["app"] = app
        for key in ("file_root", "shard_rows", "chunk_rows"):
            if overrides.get(key) is not None:
                data[key] = overrides[key]
        return cls(**data)
