"""Joining the ranks of a tensor-parallel LLM replica (torch.distributed; no Ray here).

Rank 0 is the LLM replica itself; ranks 1..N-1 are followers it starts beside it
(deployments/tensor_parallel.py). Every rank calls `join` with the same address: NCCL for the
model's collectives on GPUs (gloo on the CPU) and a gloo group for the lockstep ticks
(app/llm/lockstep.py). Then each builds its engine with the returned `TensorParallel` and
`Channel`: rank 0's takes requests, the others follow its steps.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch

from ..llm.lockstep import Channel
from ..llm.parallel import TensorParallel
from ..llm.spec import TextSpec


@dataclass(frozen=True)
class Rendezvous:
    address: str  # host:port of rank 0's store
    size: int
    moe: str = "tp"
    all_reduce: str = "nccl"  # or "symm_mem": small all-reduces through symmetric memory (llm.tp_all_reduce)


def free_address(host: str) -> str:
    with socket.socket() as s:
        s.bind(("", 0))
        return f"{host}:{s.getsockname()[1]}"


def join(rv: Rendezvous, rank: int, device: torch.device, spec: TextSpec, dtype: torch.dtype,
         timeout_s: float = 600) -> tuple[TensorParallel, Channel]:
    """This process's rank of the group: the tensor-parallel view and the lockstep channel."""
    from datetime import timedelta

    import torch.distributed as dist

    cuda = device.type == "cuda"
    kw = {"device_id": device} if cuda else {}
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{rv.address}", rank=rank,
                            world_size=rv.size, timeout=timedelta(seconds=timeout_s), **kw)
    ticks = dist.new_group(backend="gloo") if cuda else None  # on the CPU the default group is gloo already
    tp = TensorParallel(rank, rv.size, moe=rv.moe)
    if cuda and rv.all_reduce == "symm_mem":
        from ..llm.symm_all_reduce import checked_symm_all_reduce

        tp.fast = checked_symm_all_reduce(None, device, dtype, rank)
    return tp, Channel(rank, ticks, None, device, spec.hidden, dtype)
