"""Tensor parallelism: which part of each weight a rank holds, and the collectives that join them.

A model too large for one GPU is split Megatron-style across N ranks (GPUs of one node), each holding
1/N of every large matrix, so a layer needs two all-reduces and nothing else:
- qkv and gate/up split by output rows (heads, units): each rank computes its own without talking;
- o and down split by input columns to match: each product is a partial sum, one all-reduce after;
- KV heads split like the query heads; with fewer KV heads than ranks each rank keeps (replicates)
  the one its query heads read;
- embedding and LM head split by vocabulary rows (a masked lookup, then an all-reduce; logits gathered);
- MoE layers split every expert's units (`moe: "tp"`) or give whole experts to ranks (`"ep"`); either
  ends in the same all-reduce. With N = 1 every helper is the identity, without torch.distributed.
Small all-reduces may go through symmetric memory instead of NCCL (`fast`: app/llm/symm_all_reduce.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch


@dataclass
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed process group of the `size` ranks (None: the default group)
    moe: Literal["tp", "ep"] = "tp"
    fast: Any = None  # a small-message all-reduce (symm_all_reduce.SymmetricAllReduce) used where it fits

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def part(self, n: int, what: str) -> tuple[int, int]:
        """This rank's [start, end) of `n` units split evenly (heads, MLP units, experts)."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) do not split over {self.size} tensor-parallel ranks")
        k = n // self.size
        return self.rank * k, (self.rank + 1) * k

    def padded_part(self, n: int) -> tuple[int, int, int]:
        """Vocabulary rows: (start, end, rows per rank), the last ranks' shares padded up to equal size."""
        k = -(-n // self.size)
        start = min(n, self.rank * k)
        return start, min(n, start + k), k

    def kv_heads(self, heads: int, kv_heads: int) -> tuple[int, int]:
        """(first KV head, KV heads) this rank keeps: a share when there are at least as many KV heads as
        ranks, else the single KV head its query heads read."""
        if kv_heads >= self.size:
            a, b = self.part(kv_heads, "key/value heads")
            return a, b - a
        q0, _ = self.part(heads, "attention heads")
        return q0 // (heads // kv_heads), 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's `x`, in place."""
        if self.size > 1:
            if self.fast is not None and self.fast.fits(x):
                return self.fast(x)
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def smallest(self, n: int, device: torch.device) -> int:
        """The smallest of every rank's `n` (sizes every rank must agree on, such as KV blocks)."""
        if self.size == 1:
            return n
        import torch.distributed as dist

        t = torch.tensor([n], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[T, n] on each rank -> [T, size * n], rank r's columns at r * n."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        out = torch.empty(self.size * x.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x.contiguous(), group=self.group)
        return out.view(self.size, *x.shape).permute(1, 0, 2).reshape(x.shape[0], -1)


SINGLE = TensorParallel()
