"""Replica counts on a Ray cluster of several nodes, from each node's own GPUs and cores (no Ray here).

Each node counts on its own, since cluster totals are wrong both ways when nodes differ (a CPU-only
node's cores would raise the cap of GPU nodes with few cores, and a GPU node could get no Router). A
node with GPUs holds the Routers' and media replicas' `per_gpu` per GPU, at most a quarter of *its*
cores, at least one (so every GPU node's `router_http_port` answers); a node without GPUs adds none
(on KubeRay the head runs with `num-cpus: 0`); without GPUs anywhere the floor is 1. The media
replicas' ceiling is half of each node's cores, summed. These are totals that Ray Serve spreads over
the nodes that fit them; the LLM replicas already follow each GPU (app/serving/placement.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeResources:
    gpus: int
    cpus: float


def live_nodes(ray_nodes: list[dict]) -> list[NodeResources]:
    """The live nodes of `ray.nodes()`'s answer, with their GPUs and CPUs."""
    return [NodeResources(int(n.get("Resources", {}).get("GPU", 0)), float(n.get("Resources", {}).get("CPU", 0)))
            for n in ray_nodes if n.get("Alive")]


def node_floor(per_gpu: int, node: NodeResources) -> int:
    """Replicas of a CPU deployment (Router, MediaPreprocessor) that one node's GPUs call for: `per_gpu`
    per GPU, at most a quarter of the node's cores, at least one on a node with GPUs; none without."""
    if node.gpus <= 0:
        return 0
    cap = int(node.cpus // 4) if node.cpus else per_gpu * node.gpus
    return max(1, min(per_gpu * node.gpus, cap))


def per_node_floors(per_gpu: int, nodes: list[NodeResources]) -> list[int]:
    return [node_floor(per_gpu, n) for n in nodes]


def replica_floor(per_gpu: int, nodes: list[NodeResources]) -> int:
    """The deployment's floor over the cluster: each node's, summed; 1 where no node has a GPU."""
    return max(1, sum(per_node_floors(per_gpu, nodes)))


def media_ceiling(nodes: list[NodeResources], floor: int) -> int:
    """The media replicas' autoscaling ceiling: half of each node's cores (one replica each), summed;
    on GPUs at least twice the floor."""
    halves = sum(int(n.cpus // 2) for n in nodes)
    has_gpus = any(n.gpus > 0 for n in nodes)
    return max(1, halves, 2 * floor if has_gpus else 1)


def llm_replicas_per_node(per_gpu: int, nodes: list[NodeResources], tensor_parallel: int = 1) -> list[int]:
    """LLM replicas each node holds under the fused/colocate placements: `per_gpu` per GPU, or one per
    whole tensor-parallel group of the node's GPUs (a group never spans nodes)."""
    if tensor_parallel > 1:
        return [n.gpus // tensor_parallel for n in nodes]
    return [n.gpus * per_gpu for n in nodes]


ROUTER_PORT_ENV = "VLM_ROUTER_HTTP_PORT"


def node_router_port(port: int, env: dict[str, str] | None = None) -> int:
    """The port this node's Routers serve on (`router_http_port`), unless the environment the node was
    started with (`VLM_ROUTER_HTTP_PORT=... ray start ...`) gives it another: several Ray nodes on one
    host each need one of their own, as Ray Serve's RAY_SERVE_WORKER_PROXY_HTTP_PORT gives each node's
    proxy (the multi-node tests run two nodes on one machine). On a real cluster every node uses the
    configured port."""
    value = (os.environ if env is None else env).get(ROUTER_PORT_ENV, "").strip()
    if not value:
        return port
    own = int(value)
    if not 1 <= own <= 65535:
        raise ValueError(f"{ROUTER_PORT_ENV}={value}: not a TCP port")
    return own
