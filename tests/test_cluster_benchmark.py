"""benchmarks/cluster_scaling.py's layouts: every node gets an equal share of the host's GPUs, cores and
object store, so one node and two hold the same in all (ray.cluster_utils gives each node 150 MiB, so one
node had half the store of two); each load keeps which stage was busy; a benchmark's cluster can unset
what the tests' clusters set."""

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


def test_a_benchmark_cluster_can_unset_what_the_tests_clusters_set(monkeypatch):
    from cluster_harness import UNBUFFERED_LOGS, environment

    monkeypatch.setenv(UNBUFFERED_LOGS, "1")
    monkeypatch.delenv("VLM_TEST_ONLY_VAR", raising=False)
    with environment({UNBUFFERED_LOGS: None, "VLM_TEST_ONLY_VAR": "x"}):
        import os

        assert UNBUFFERED_LOGS not in os.environ and os.environ["VLM_TEST_ONLY_VAR"] == "x"
    assert os.environ[UNBUFFERED_LOGS] == "1" and "VLM_TEST_ONLY_VAR" not in os.environ
    monkeypatch.delenv(UNBUFFERED_LOGS)
    with environment({UNBUFFERED_LOGS: None}):  # unset before, unset inside: still unset after
        assert UNBUFFERED_LOGS not in os.environ
    assert UNBUFFERED_LOGS not in os.environ


def test_each_load_keeps_which_stage_was_busy():
    from benchmarks.cluster_scaling import busy_cells, monitor_record
    from benchmarks.monitor import MonitorSummary, verdict

    s = MonitorSummary(20.0, "nvml", [0, 1], [97.04, 41.96], [], 64, 0.3512,
                       groups={"Router": {"processes": 12, "cores": 9.876, "busiest_thread": 0.912},
                               "LLM": {"processes": 8, "cores": 7.5, "busiest_thread": 0.6}})
    s.verdict = verdict(s)
    rec = monitor_record(s)
    assert rec["gpu_busy_pct"] == [97.0, 42.0] and rec["host_busy"] == 0.351
    assert rec["groups"]["Router"] == {"processes": 12, "cores": 9.88, "busiest_thread": 0.91}
    assert rec["verdict"] == ["GPU 0 saturated: 97% busy"]
    assert busy_cells({"monitor": rec}) == "97, 42 | Router (9.9, 0.91)"
    assert busy_cells({}) == " | "
