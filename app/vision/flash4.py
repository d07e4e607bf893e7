"""FlashAttention-4's forward for the towers' dense attention inside CUDA graphs, where the optional
package is installed and the config asks for it (`encoder.dense_attention: flash4`; Hopper or
Blackwell, bf16/fp16). Numbers: benchmarks/results/2026-11-24-flashattention-4-dense-attention.md.

Why: equal-length sequences (a 1024^2 image is one of 4096 tokens) take one dense attention call per
layer, cuDNN's Hopper kernel by default, and cuDNN pads the head: 72-wide heads (the 8B tower) cost it
as much as 128-wide ones; FlashAttention-4's SM90/SM100 forward (`flash_attn.cute`, in NVIDIA's CuTe
DSL) is faster there. Only in graphs: each call goes through the DSL's Python launcher, which slowed
serving when eager batches used it too; in a graph it runs once, at capture (eager batches keep
PyTorch's SDPA). Off by default: `flash-attn-4` is a beta package whose compiler (nvidia-cutlass-dsl)
is a large wheel that compiles each kernel variant at its first call, and at the 2B tower's 64-wide
heads it served no faster.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

CHOICES = ("sdpa", "flash4")


@functools.cache
def _flash_attn_func() -> Callable | None:
    try:
        from flash_attn.cute import flash_attn_func
    except Exception:  # noqa: BLE001 - not installed, or its compiler library is missing
        return None
    return flash_attn_func


def unsupported_reason(head_dim: int, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why FlashAttention-4 cannot run this tower's attention here, or None when it can."""
    if device.type != "cuda":
        return f"it needs a CUDA device, not {device.type}"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"it takes bfloat16 or float16, not {dtype}"
    major = torch.cuda.get_device_capability(device)[0]
    if major not in (9, 10):
        return f"its forward here is for Hopper (sm90) and Blackwell (sm100), not sm{major}x"
    if head_dim % 8 or head_dim > 256:
        return f"head size {head_dim} is not a multiple of 8 up to 256"
    if _flash_attn_func() is None:
        return "the optional package flash-attn-4 is not installed (the project's `flash4` extra: pip install -e '.[flash4]')"
    return None


def resolve(choice: str, head_dim: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a tower's graphs use FlashAttention-4 for their dense attention (`encoder.dense_attention`).
    'flash4' where it cannot run is an error at start that says why, not a silent fallback."""
    if choice not in CHOICES:
        raise ValueError(f"dense_attention must be one of {CHOICES}, not {choice!r}")
    if choice == "sdpa":
        return False
    reason = unsupported_reason(head_dim, device, dtype)
    if reason:
        raise RuntimeError(f"encoder.dense_attention is 'flash4', but FlashAttention-4 cannot run: {reason}")
    return True


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q, k, v [sequences, length, heads, head_dim] (any strides with a unit last one) -> out of that
    shape, contiguous. Softmax scale 1/sqrt(head_dim), no mask."""
    fn = _flash_attn_func()
    if fn is None:
        raise RuntimeError("flash-attn-4 is not installed")
    return fn(q, k, v)[0]
