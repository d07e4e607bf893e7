"""A mixture-of-experts feed-forward block (Qwen3-VL-MoE, Qwen3-MoE): route each token to its top-k
experts, run them, sum their outputs weighted by the router.

The router is transformers' (moe_routing.py), so greedy answers match the reference.
The experts run in `fused_moe`: one grouped GEMM launch for gate/up and one for down over tokens
sorted by expert, instead of a Python loop over the experts a step hits; nothing synchronises
with the host, so the block lives inside the decode and step CUDA graphs.

Under tensor parallelism each rank runs its share (parallel.py): every expert's units ("tp"), or
its whole experts ("ep", the others' ids routed out of range so they count nothing); the caller
all-reduces the partial sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fused_moe import fused_moe
from .gemv import Linear
from .moe_routing import route_tokens
from .parallel import TensorParallel
from .spec import TextSpec


def route(h: torch.Tensor, router_weight: torch.Tensor, spec: TextSpec, linear: Linear = F.linear
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (expert ids [T, k], weights [T, k] in h's dtype). `linear` computes the logits (F.linear, or the
    model's GemvTable.linear)."""
    return route_tokens(h, router_weight, spec.experts_per_token, spec.norm_topk, linear)


def moe_forward(h: torch.Tensor, router_weight: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                spec: TextSpec, tp: TensorParallel, sum_k: bool = True, linear: Linear = F.linear) -> torch.Tensor:
    """h [T, hidden] -> this rank's part of the block's output [T, hidden] (with `sum_k` False, possibly
    [T, k, hidden] unsummed: `fused_moe`). gate_up [experts, 2 units, hidden] and down [experts, hidden,
    units] are the rank's experts (or the rank's units of all)."""
    ids, weights = route(h, router_weight, spec, linear)
    if tp.enabled and tp.moe == "ep":
        first = tp.rank * gate_up.shape[0]
        ids = ids - first  # experts held elsewhere fall outside [0, held) and count nothing here
    return fused_moe(h, gate_up, down, ids, weights, sum_k=sum_k)
