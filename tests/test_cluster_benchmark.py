"""benchmarks/cluster_scaling.py's layouts: every node gets an equal share of the host's GPUs, cores and
object store, so one node and two hold the same in all (2026-11-27: with ray.cluster_utils' 150 MiB store
per node left as it was, two nodes served 1.3x one, the likely cause)."""

from __future__ import annotations

import pytest

from benchmarks.cluster_scaling import host_object_store_bytes, node_specs


@pytest.mark.parametrize("nodes", [1, 2, 4])
def test_the_layouts_split_the_same_host_evenly(nodes):
    store = 48 * 2**30
    specs = node_specs(4, nodes, 64, store)
    assert len(specs) == nodes
    assert sorted(",".join(s["devices"] for s in specs).split(",")) == ["0", "1", "2", "3"]
    assert {s["num_gpus"] for s in specs} == {4 // nodes} and {s["num_cpus"] for s in specs} == {64 // nodes}
    assert {s["object_store_bytes"] for s in specs} == {store // nodes}


def test_without_a_store_size_the_harness_default_is_kept():
    assert {s["object_store_bytes"] for s in node_specs(2, 2, 2)} == {None}


def test_the_host_store_is_what_ray_start_would_take_here():
    import psutil
    from ray._private.utils import resolve_object_store_memory

    got = host_object_store_bytes()
    assert got == resolve_object_store_memory(psutil.virtual_memory().total)
    assert 150 * 2**20 < got <= 0.3 * psutil.virtual_memory().total + 1
