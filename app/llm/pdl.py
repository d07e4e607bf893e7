"""Programmatic dependent launch (Hopper and later) for the engine's own Triton kernels: opt-in, `llm.pdl`.

A single-stream decode step of 30B-A3B is about 600 kernels, most of them a few microseconds long, and
the GPU sits idle for 13% of the step between them (one H200, 2026-12-01, CUPTI), so the profile's
advice was fewer kernels or overlapping their edges. With programmatic dependent launch, a kernel
launched with the attribute may start while the kernel before it on the stream still runs: its blocks
are scheduled once every block of the one before has started, and it waits on the device
(`griddepcontrol.wait`) until that one has finished and its writes are visible. What overlaps is
the launch and scheduling latency, not any work.

Every kernel that takes part calls `enter(PDL)` as its first statement, before it reads anything a
kernel before it may have written. Calling it first also keeps the chain sound: a program that returns
early has waited too, so a grid never finishes before the grid it depends on, and two kernels back are
covered through the one in between. Kernels that do not take part (cuBLAS's, torch's) are launched as
usual and wait for the whole grid before them; a launch with the attribute after one of them waits for
it too. CUDA graphs record these launches as programmatic edges.

`enable` sets the switch for the process. The engine sets it before it captures its graphs, and every
wrapper reads it when it launches (`args()`: the kernel's `PDL` constexpr and the launch option). Off,
on a CPU, or before Hopper, nothing changes.
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
