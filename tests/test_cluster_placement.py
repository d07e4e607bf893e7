"""Replica counts on a cluster of several nodes follow each node's own GPUs and cores (app/serving/cluster.py), not
the cluster's totals divided evenly; pure functions over per-node resources, no Ray."""

from __future__ import annotations

import itertools

import pytest

from app.config import AppConfig
from app.serving.cluster import (
    NodeResources,
    live_nodes,
    llm_replicas_per_node,
    media_ceiling,
    node_router_port,
    per_node_floors,
    replica_floor,
)
from app.serving.placement import plan

N = NodeResources


def totals_floor(per_gpu: int, gpus: int, cpus: float) -> int:
    """The rule the builder applied to the cluster's totals before (one node's rule, still exact for one)."""
    if gpus <= 0:
        return 1
    return max(1, min(per_gpu * gpus, int(cpus // 4) if cpus else per_gpu * gpus))


def test_one_node_keeps_the_single_node_rule():
    for per_gpu, gpus, cpus in itertools.product((1, 3, 4), (0, 1, 2, 4, 8), (0, 2, 8, 16, 64, 128)):
        assert replica_floor(per_gpu, [N(gpus, cpus)]) == totals_floor(per_gpu, gpus, cpus), (per_gpu, gpus, cpus)
        assert media_ceiling([N(gpus, cpus)], replica_floor(per_gpu, [N(gpus, cpus)])) == \
            max(1, int(cpus // 2), 2 * totals_floor(per_gpu, gpus, cpus) if gpus > 0 else 1)


def test_a_cpu_only_nodes_cores_do_not_raise_the_gpu_nodes_floor():
    """8 GPUs on a node of 16 cores beside a 64-core node without GPUs: the GPU node holds at most a
    quarter of its own cores (4 Routers), where the totals (8 GPUs, 80 cores) asked for 20."""
    nodes = [N(8, 16), N(0, 64)]
    assert per_node_floors(3, nodes) == [4, 0]
    assert replica_floor(3, nodes) == 4
    assert totals_floor(3, 8, 80) == 20


def test_every_gpu_node_gets_at_least_one():
    """Two GPU nodes of 2 cores each: one Router each (each node's router_http_port answers), where a
    quarter of the totals' 4 cores was 1 for the whole cluster."""
    nodes = [N(1, 2), N(1, 2)]
    assert per_node_floors(3, nodes) == [1, 1]
    assert replica_floor(3, nodes) == 2
    assert totals_floor(3, 2, 4) == 1


def test_kuberay_head_without_cpus_or_gpus_adds_nothing():
    """A KubeRay head started with num-cpus 0 and GPU workers of 8 cores and 1 GPU each."""
    nodes = [N(0, 0), N(1, 8), N(1, 8)]
    assert per_node_floors(3, nodes) == [0, 2, 2]
    assert replica_floor(4, nodes) == 4
    assert media_ceiling(nodes, replica_floor(4, nodes)) == 8


def test_uneven_gpu_nodes():
    nodes = [N(4, 64), N(2, 64), N(1, 8)]
    assert per_node_floors(3, nodes) == [12, 6, 2]
    assert replica_floor(3, nodes) == 20
    assert per_node_floors(4, nodes) == [16, 8, 2]


def test_cluster_without_gpus_runs_one():
    assert replica_floor(3, [N(0, 2), N(0, 2)]) == 1
    assert media_ceiling([N(0, 2), N(0, 2)], 1) == 2


def test_media_ceiling_is_half_of_each_nodes_cores():
    """Two 3-core nodes hold one 1-core media replica each at half their cores: 2, not 6 // 2 = 3."""
    assert media_ceiling([N(0, 3), N(0, 3)], 1) == 2
    assert media_ceiling([N(1, 3), N(1, 3)], 2) == 4  # on GPUs at least twice the floor


def test_llm_replicas_follow_each_nodes_gpus():
    nodes = [N(4, 64), N(2, 32), N(0, 16)]
    assert llm_replicas_per_node(2, nodes) == [8, 4, 0]
    # the placement's total is the per-node sum (its GPU share fits each GPU)
    pl = plan(AppConfig(placement={"policy": "fused", "llm_replicas_per_gpu": 2}).placement, 6, [4, 2, 0])
    assert pl.llm_replicas == sum(llm_replicas_per_node(2, nodes)) and pl.llm_num_gpus == 0.5


def test_tensor_parallel_groups_never_span_nodes():
    """Two nodes of 3 GPUs: one group of 2 on each (the totals' 6 // 2 = 3 would put one across nodes)."""
    nodes = [N(3, 32), N(3, 32)]
    assert llm_replicas_per_node(1, nodes, tensor_parallel=2) == [1, 1]
    p = AppConfig(placement={"policy": "fused", "llm_tensor_parallel": 2}).placement
    assert plan(p, 6, [3, 3]).llm_replicas == 2
    with pytest.raises(ValueError, match="no node has 4 GPUs"):
        plan(AppConfig(placement={"policy": "fused", "llm_tensor_parallel": 4}).placement, 6, [3, 3])


def test_deployment_options_take_each_nodes_resources():
    pytest.importorskip("ray")
    from deployments.app import deployment_options

    nodes = [N(0, 0), N(8, 16), N(0, 64)]
    opts, pl = deployment_options(AppConfig(), 8, 80, [0, 8, 0], nodes)
    assert opts["Router"]["autoscaling_config"]["min_replicas"] == 4
    assert opts["MediaPreprocessor"]["autoscaling_config"]["min_replicas"] == 4
    assert opts["MediaPreprocessor"]["autoscaling_config"]["max_replicas"] == 40  # 16 // 2 + 64 // 2
    assert pl.llm_replicas == 8
    # without per-node resources: one node of the totals, as before
    opts, _ = deployment_options(AppConfig(), 8, 80)
    assert opts["Router"]["autoscaling_config"]["min_replicas"] == 20


def test_live_nodes_reads_ray_nodes():
    ray_nodes = [{"Alive": True, "Resources": {"CPU": 16.0, "GPU": 2.0, "memory": 1e9}},
                 {"Alive": False, "Resources": {"CPU": 64.0, "GPU": 8.0}},
                 {"Alive": True, "Resources": {"node:10.0.0.2": 1.0}}]
    assert live_nodes(ray_nodes) == [N(2, 16.0), N(0, 0.0)]


def test_a_node_may_give_its_routers_their_own_port():
    assert node_router_port(8000, {}) == 8000
    assert node_router_port(8000, {"VLM_ROUTER_HTTP_PORT": " "}) == 8000
    assert node_router_port(8000, {"VLM_ROUTER_HTTP_PORT": "18001"}) == 18001
    with pytest.raises(ValueError, match="not a TCP port"):
        node_router_port(8000, {"VLM_ROUTER_HTTP_PORT": "70000"})


def test_the_builder_warns_when_ray_runs_replicas_code_on_threads_of_their_own(monkeypatch):
    """deployments.app.warn_without_low_overhead_mode: Ray Serve's constant for where replicas' code runs,
    as the cluster's environment set it, decides the warning."""
    pytest.importorskip("ray")
    from ray.serve._private import constants

    import deployments.app as app_module

    said = []
    monkeypatch.setattr(app_module.log, "warning", lambda msg, *a: said.append(msg % a))
    monkeypatch.setattr(constants, "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD", True)
    assert app_module.warn_without_low_overhead_mode() is True
    assert len(said) == 1 and "low-overhead mode" in said[0] and "deployments.ray_env" in said[0]
    monkeypatch.setattr(constants, "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD", False)
    assert app_module.warn_without_low_overhead_mode() is False and len(said) == 1
