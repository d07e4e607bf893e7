"""Programmatic dependent launch (Hopper and later) for the engine's own Triton kernels: `llm.pdl`, on by default.

A single-stream decode step of 30B-A3B is about 600 kernels of a few microseconds, and the GPU sat idle
13% of the step between them (one H200, 2026-12-01). Launched with the attribute after one of these
kernels, a kernel may start once every block of that one has started (after cuBLAS's or torch's, at
its end), and waits on the device (`griddepcontrol.wait`) until it has finished and its writes are
visible: the launch latency overlaps, no work does.
Every taking-part kernel calls `enter(PDL)` before it reads anything a kernel may have written and before
any program may return, so no grid ends before the grid it depends on and the chain holds two kernels
back too; ahead of it come only offsets and reads of what no kernel writes (gemv's first weight tile,
which so overlaps the kernel before). Others launch as usual. `enable` sets the process's switch (the engine,
before it times or captures anything); each launch passes `args()` (docs/concepts/engine.md).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None
    enter = None

_ON = False


def enable(on: bool, device: torch.device | None = None) -> bool:
    """Turn programmatic dependent launch on (where the device supports it: compute capability 9 or later)
    or off for this process's engine kernels. -> whether it is on."""
    global _ON
    capable = (triton is not None and device is not None and device.type == "cuda"
               and torch.cuda.get_device_capability(device)[0] >= 9)
    _ON = bool(on) and capable
    return _ON


def on() -> bool:
    return _ON


def args() -> dict:
    """A taking-part kernel's launch keywords: its `PDL` constexpr, and Triton's `launch_pdl` option while
    the switch is on."""
    return {"PDL": True, "launch_pdl": True} if _ON else {"PDL": False}


if triton is not None:

    @triton.jit
    def enter(PDL: tl.constexpr):
        """A kernel's first statement: wait until the kernel before it has finished and its writes are
        visible, then let the next kernel launch (its blocks wait in their own `enter`)."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
