"""Placement policy: how many encoder and LLM replicas, and what share of a GPU each takes.

Ray gives a fractional GPU request the *best-fitting* GPU (the fullest), so fractional shares cannot
pair an encoder with an LLM on every GPU of a node. `colocate` therefore lets each LLM replica reserve
a whole GPU in Ray's accounting (so Ray spreads them one per GPU) and the encoders none: each pins
itself to the GPU of its rank (`pinned_gpu`). `split` is plain accounting: whole GPUs for the encoder,
the rest for the LLM. `fused` runs no VisionEncoder replicas: each LLM replica loads the tower and
hands embeddings to the engine on the GPU (app/serving/fused.py), with no host copy, no serialisation
and no second call per request.

No Ray import here: the builder (deployments/app.py) turns a Plan into deployment options.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import PlacementConfig


@dataclass(frozen=True)
class Plan:
    policy: str  # what ran: "cpu", "colocate", "fused" or "split"
    encoder_replicas: int
    encoder_num_gpus: float
    llm_replicas: int
    llm_num_gpus: float
    encoder_pins_gpu: bool  # colocate on GPUs: encoders take no GPU from Ray and pin one by rank

    @property
    def fused(self) -> bool:
        """The LLM replicas encode their requests' media themselves (no VisionEncoder replicas)."""
        return self.policy == "fused"

    def describe(self) -> str:
        pin = ", encoders pinned by rank" if self.encoder_pins_gpu else ""
        return (f"{self.policy}: {self.encoder_replicas} encoder x {self.encoder_num_gpus:g} GPU, "
                f"{self.llm_replicas} LLM x {self.llm_num_gpus:g} GPU{pin}")


# measured on one H200 against colocate (benchmarks/results/2026-11-23-serving-fused-placement.md);
# split unmeasured
AUTO_POLICY = "fused"


def _share(replicas: int, gpus: int) -> float:
    """GPU share per replica so that `replicas` fit on `gpus` without one spanning two GPUs."""
    return 1.0 if replicas <= gpus else 1.0 / math.ceil(replicas / gpus)


def _pick(value, default):
    return default if value == "auto" else value


def _wants_encoders(p: PlacementConfig) -> bool:
    """Settings for separate encoder replicas: they ask for them."""
    return p.encoder_replicas != "auto" or p.encoder_num_gpus != "auto"


def resolve_policy(p: PlacementConfig, gpus: int) -> str:
    """The policy that runs: `auto` is the measured best on GPUs (colocate when encoder replicas are
    configured) and "cpu" without GPUs; `fused` is kept on the CPU when asked for by name."""
    if p.policy == "fused":
        if _wants_encoders(p):
            raise ValueError("placement.policy 'fused' runs no encoder replicas: remove encoder_replicas and "
                             "encoder_num_gpus, or choose 'colocate'")
        return "fused"
    if gpus <= 0:
        return "cpu"
    if p.policy == "auto":
        return "colocate" if _wants_encoders(p) else AUTO_POLICY
    return p.policy


def tensor_parallel_groups(node_gpus: list[int], size: int) -> int:
    """LLM replicas of `size` GPUs each that fit the cluster: a group never spans nodes."""
    return sum(g // size for g in node_gpus)


def plan(p: PlacementConfig, gpus: int, node_gpus: list[int] | None = None) -> Plan:
    """The replica counts and GPU shares for a cluster with `gpus` GPUs (0: everything on the CPU);
    `node_gpus`: the GPUs of each node, for tensor-parallel groups (default: one node)."""
    per_gpu = p.llm_replicas_per_gpu
    policy = resolve_policy(p, gpus)
    tp = p.llm_tensor_parallel
    if tp > 1:
        if policy not in ("fused", "cpu"):
            raise ValueError(f"placement.llm_tensor_parallel {tp} runs under the fused placement (the tower in "
                             f"each group's first GPU), not {policy!r}")
        if gpus <= 0:
            return Plan(policy, 0 if policy == "fused" else _pick(p.encoder_replicas, 1), 0.0,
                        _pick(p.llm_replicas, 1), 0.0, False)
        groups = tensor_parallel_groups(node_gpus or [gpus], tp)
        if groups < 1:
            raise ValueError(f"placement.llm_tensor_parallel {tp}: no node has {tp} GPUs ({node_gpus or [gpus]})")
        return Plan("fused", 0, 0.0, _pick(p.llm_replicas, groups), 1.0, False)
    if policy == "fused":
        if gpus <= 0:
            return Plan("fused", 0, 0.0, _pick(p.llm_replicas, 1), _pick(p.llm_num_gpus, 0.0), False)
        llm = _pick(p.llm_replicas, gpus * per_gpu)
        return Plan("fused", 0, 0.0, llm, _pick(p.llm_num_gpus, _share(llm, gpus)), False)
    if policy == "cpu":
        enc, llm = _pick(p.encoder_replicas, 1), _pick(p.llm_replicas, 1)
        return Plan("cpu", enc, _pick(p.encoder_num_gpus, 0.0), llm, _pick(p.llm_num_gpus, 0.0), False)
    if policy == "split":
        if gpus < 2:
            raise ValueError(f"placement.policy 'split' needs at least 2 GPUs, the cluster has {gpus}")
        enc_gpus = _pick(p.encoder_gpus, 1)
        llm_gpus = _pick(p.llm_gpus, gpus - enc_gpus)
        if enc_gpus < 1 or llm_gpus < 1 or enc_gpus + llm_gpus > gpus:
            raise ValueError(f"placement split: encoder_gpus {enc_gpus} + llm_gpus {llm_gpus} must each be >= 1 "
                             f"and fit the cluster's {gpus} GPUs")
        enc, llm = _pick(p.encoder_replicas, enc_gpus), _pick(p.llm_replicas, llm_gpus * per_gpu)
        return Plan("split", enc, _pick(p.encoder_num_gpus, _share(enc, enc_gpus)),
                    llm, _pick(p.llm_num_gpus, _share(llm, llm_gpus)), False)
    enc, llm = _pick(p.encoder_replicas, gpus), _pick(p.llm_replicas, gpus * per_gpu)
    enc_share = _pick(p.encoder_num_gpus, 0.0)
    return Plan("colocate", enc, enc_share, llm, _pick(p.llm_num_gpus, _share(llm, gpus)), enc_share == 0)


def llm_memory_share(gpu_memory_utilization: float, share: float) -> float:
    """Each LLM replica's `llm.gpu_memory_utilization`, for replicas of `share` of a GPU: replicas that
    share a GPU split the KV budget by their GPU share. Each sizes its cache from the memory free when
    it starts, and replicas of one GPU may start at the same moment: with the whole fraction each, two
    of them would take it twice."""
    return gpu_memory_utilization * share if 0 < share < 1 else gpu_memory_utilization


def pinned_gpu(local_rank: int, node_gpus: int, visible: str | None) -> str | None:
    """The CUDA_VISIBLE_DEVICES value for a pinned replica: the node's GPUs in turn by the replica's
    rank on the node. `visible` is the variable as the process inherited it (None: unset, all GPUs)."""
    ids = [v for v in visible.split(",") if v.strip()] if visible is not None else [str(i) for i in range(node_gpus)]
    return ids[local_rank % len(ids)] if ids else None
