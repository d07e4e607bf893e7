"""How a process that shares its GPU shares it: through CUDA's Multi-Process Service (MPS), whose server
runs the kernels of all its clients side by side, or in the driver's time slices, one process at a time.

The GPU presets run two fused LLM replicas per GPU (one process's host work caps it at about 0.6x of
two). Under time slices each replica's small decode kernels leave most of the GPU idle while the other
waits its turn. On one H200 (2026-12-02, both orders) MPS sustained 140 req/s of Poisson 448² traffic
within TTFT p99 200 ms where time slices failed (204 and 244 ms) and passed 120; TPOT p99 at 140 fell from
16.7-17.4 to 10.1-10.5 ms. MPS is the node's, started before a replica's CUDA context exists
(docs/guides/single-gpu.md), so a replica can only find out which it got, and say so: `describe` for
`/v1/llm/load`, and a warning for time slices.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"  # where the MPS control daemon and its clients meet (CUDA's default)


def pipe_dir(env: dict | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIR)


def daemon_listening(env: dict | None = None) -> bool:
    """Whether an MPS control daemon's pipe exists where this process's CUDA would look for it. The pipe
    can outlive its daemon, so this is the fallback when NVML cannot tell."""
    return (pipe_dir(env) / "control").exists()


def nvml_pids(nvml=None) -> tuple[set[int], set[int]] | None:
    """(MPS clients, compute processes): the process ids NVML lists on every GPU, as MPS clients and as
    ordinary compute processes; None where NVML cannot say (no nvidia-ml-py, no driver, or a driver
    without the queries)."""
    try:
        if nvml is None:
            import pynvml as nvml
        nvml.nvmlInit()
        try:
            mps, compute = set(), set()
            for i in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                mps.update(p.pid for p in nvml.nvmlDeviceGetMPSComputeRunningProcesses(handle))
                compute.update(p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle))
            return mps, compute
        finally:
            nvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - any failure of an optional probe means "cannot tell"
        return None


def describe(shares_gpu: bool, pid: int | None = None, nvml=None, env: dict | None = None) -> dict:
    """How this process shares its GPU, to be called once its CUDA context exists.
    -> {"mode": "alone" | "mps" | "time slices", "evidence": "nvml" | "pipe" | None (what decided it)}."""
    if not shares_gpu:
        return {"mode": "alone", "evidence": None}
    pid = os.getpid() if pid is None else pid
    listed = nvml_pids(nvml)
    if listed is not None and pid in listed[0]:
        return {"mode": "mps", "evidence": "nvml"}
    # NVML sees this process (its pid namespace is ours) as a compute process but not as an MPS client:
    # no MPS, whatever pipe is left. The control daemon's pipe outlived the daemon on the device (a call
    # after one that had quit MPS found it, and its replicas were not on NVML's list: 2026-12-02).
    if listed is not None and pid in listed[1]:
        return {"mode": "time slices", "evidence": "nvml"}
    # CUDA joins the daemon whenever it finds its pipe; NVML may list the host's process ids instead of
    # a container's, or nothing, or be missing
    if daemon_listening(env):
        return {"mode": "mps", "evidence": "pipe"}
    return {"mode": "time slices", "evidence": None}


def time_slice_warning(sharing: dict) -> str | None:
    """The start-up warning for a replica that shares its GPU by time slices; None otherwise."""
    if sharing["mode"] != "time slices":
        return None
    return ("this replica shares its GPU with other processes in time slices: start CUDA's MPS daemon on the "
            "node before Ray (nvidia-cuda-mps-control -d) so that their kernels run side by side; 1.17x the "
            "goodput of 448² images on one H200 (docs/guides/single-gpu.md, 'Two replicas on one GPU')")
