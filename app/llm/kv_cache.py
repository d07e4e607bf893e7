"""How many KV blocks a GPU holds, and the cache tensor itself.

The cache is one tensor [layers, 2, blocks x block_size, kv_heads, head_dim] (this rank's KV heads
under tensor parallelism), sized from the free GPU memory after the weights and the activations
of the largest step (`gpu_memory_utilization` of what is left), nothing reserved per request.
Every rank of a tensor-parallel group must hold the same number of blocks (the block manager is
rank 0's): each measures, and all take the smallest.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from .spec import TextSpec

log = logging.getLogger(__name__)


def bytes_per_block(spec: TextSpec, kv_heads: int, block_size: int, dtype: torch.dtype) -> int:
    return spec.layers * 2 * block_size * kv_heads * spec.head_dim * dtype.itemsize


def blocks_that_fit(device: torch.device, per_block: int, utilization: float, largest_step: Callable[[], None],
                    tokens: int) -> int:
    """Blocks that fit in `utilization` of the memory left after `largest_step()`'s peak activations."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    largest_step()
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    blocks = int(utilization * (free - peak) // per_block)
    log.info("KV cache: %d blocks (%.1f GiB; %.1f GiB free after weights, %.2f GiB peak activations at %d "
             "tokens)", blocks, blocks * per_block / 2**30, free / 2**30, peak / 2**30, tokens)
    if blocks < 2:
        raise RuntimeError("no GPU memory left for the KV cache")
    return blocks


def allocate(spec: TextSpec, kv_heads: int, blocks: int, block_size: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
    kv = torch.empty(spec.layers, 2, blocks * block_size, kv_heads, spec.head_dim, dtype=dtype, device=device)
    kv[:, :, :block_size].zero_()  # block 0: where padded rows write; read only by them
    return kv
