"""Triton's compiled kernels kept under `cache_dir`, beside the model cache and the tower's auto-tune table.

Why: on a fresh machine an LLM replica's graph captures took 12-14 s of its start (engine and tower),
against 1.6-2.4 s per capture in a redeploy on the same machine (2026-12-01). Most of the difference is
likely the first compile of the Triton kernels, which the redeploy found in ~/.triton/cache; no compile
was timed alone. A container's home dies with it, while `cache_dir` is where a deployment mounts a
writable volume that outlives pods (docs/guides/cluster.md). Triton's cache key holds the GPU target and
Triton's own version, so a volume that several GPU models or images share stays correct. A
TRITON_CACHE_DIR already set wins.
"""

from __future__ import annotations

import logging
import os

from ..checkpoints.model_builder import cache_root

log = logging.getLogger(__name__)


def use_kernel_cache(cache_dir: str | None) -> str | None:
    """Point this process's Triton compiles at `<cache_dir>/triton` (before the first compile) unless
    TRITON_CACHE_DIR is set; returns the directory in use. A `cache_dir` that cannot be written (a
    read-only mount of prepared checkpoints) leaves Triton's own default (~/.triton/cache), with a
    warning, and returns None: `/v1/llm/load` then reports `kernel_cache: null`."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return os.environ["TRITON_CACHE_DIR"]
    path = cache_root(cache_dir).resolve() / "triton"
    try:
        path.mkdir(parents=True, exist_ok=True)
        writable = os.access(path, os.W_OK)
    except OSError:
        writable = False
    if not writable:
        log.warning("cannot write %s: Triton keeps its compiled kernels in its own default directory", path)
        return None
    os.environ["TRITON_CACHE_DIR"] = str(path)
    return str(path)
