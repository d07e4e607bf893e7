"""benchmarks/serve.py's sweep rules and benchmarks/monitor.py's grouping and verdict (no server)."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest

from benchmarks.monitor import MonitorSummary, ProcessSampler, process_group, verdict
from benchmarks.serve import (
    Report,
    Workload,
    _body_bytes,
    build_bodies,
    concurrency_ladder,
    plateaued,
    print_repeats,
    steady_rate,
)


def test_ladder_doubles_up_to_the_maximum():
    assert concurrency_ladder(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert concurrency_ladder(6) == [1, 2, 4, 6] and concurrency_ladder(1) == [1]


def test_the_sweep_stops_after_two_points_without_five_percent_gain():
    assert not plateaued([10, 20, 40])
    assert not plateaued([10, 20, 20.5])  # one flat point
    assert plateaued([10, 20, 20.5, 20.9])  # two in a row
    assert not plateaued([10, 20, 20.5, 22])  # +10% over the best restarts the count
    assert plateaued([10, 20, 18, 19])  # falling counts as no gain


def test_repeated_runs_of_a_point_report_their_median_and_range(capsys):
    def report(rate, steady, ttft):
        return Report("image 448^2", 256, None, 10, 0, 1.0, rate, 0.0, 0.0, {"median": ttft}, {},
                      steady_request_throughput=steady)

    print_repeats([report(182.6, 189.1, 964.0), report(145.7, 157.1, 1400.0), report(151.2, 164.9, 1254.0)])
    line = capsys.readouterr().out
    assert "3 runs: req/s median 151.20 (min 145.70, max 182.60)" in line
    assert "steady median 164.90" in line and "TTFT p50 median 1254.0 ms" in line


def test_the_steady_rate_leaves_out_the_start_and_the_drain():
    """101 completions every 0.1 s after a slow start (the first 10 over 5 s) and before a slow drain:
    the rate between the 10th and 90th percentile completions is the steady 10 per second."""
    start = [0.5 * i for i in range(10)]
    steady = [5.0 + 0.1 * i for i in range(82)]
    drain = [steady[-1] + 1.0 + i for i in range(9)]
    done = start + steady + drain
    assert len(done) == 101
    assert steady_rate(done) == pytest.approx(10.0)
    assert steady_rate(done) > 100 / (max(done) - min(done)) * 2  # the whole run's rate is far lower
    assert steady_rate(done[:5]) == 0.0  # too few to tell


def test_processes_are_grouped_by_deployment_from_their_ray_titles():
    assert process_group("ray::ServeReplica:vlm:Router", 1) == "Router"
    assert process_group("ray::ServeReplica:vlm:MediaPreprocessor.handle_request_with_rejection", 1) == \
        "MediaPreprocessor"
    assert process_group("ray::ProxyActor", 1) == "ProxyActor"
    assert process_group("ray::IDLE", 1) == "other ray workers"
    assert process_group("/usr/lib/python3/site-packages/ray/core/src/ray/raylet/raylet --node", 1) == "raylet"
    assert process_group("python some_script.py", 1) is None
    assert process_group("python benchmarks/serve.py", os.getpid()) == "load generator"
    # serve.py's load processes: spawned children of this process
    spawned = '/usr/bin/python3 -c "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, ' \
        'pipe_handle=7)" --multiprocessing-fork'
    assert process_group(spawned, 2, os.getpid()) == "load generator"
    assert process_group(spawned, 2, 1) is None  # someone else's
    assert process_group("/path/raylet --node", 2, os.getpid()) == "raylet"  # ray.init's child stays Ray's
    assert process_group("ray::ServeController", 2, os.getpid()) == "ServeController"
    assert process_group("python some_script.py", 2, os.getpid()) is None


def test_the_sampler_counts_a_spawned_child_as_the_load_generator():
    """The real command line of a spawn child, and its parent from psutil's process_iter."""
    child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(30,), daemon=True)
    child.start()
    try:
        sampler = ProcessSampler()
        sampler.sample()
        assert sampler.procs[child.pid].group == "load generator"
        assert sampler.procs[os.getpid()].group == "load generator"
    finally:
        child.terminate()
        child.join()


def _summary(gpu_mean, processes, host_busy=0.3):
    return MonitorSummary(10.0, "nvml", list(range(len(gpu_mean))), gpu_mean, [], 16, host_busy, processes)


def test_verdict_names_the_saturated_stage():
    router = {"pid": 7, "group": "Router", "cores": 1.1, "busiest_thread": 0.97}
    llm = {"pid": 8, "group": "LLM", "cores": 0.6, "busiest_thread": 0.5}
    lines = verdict(_summary([12.0, 95.0], [router, llm]))
    assert any(line.startswith("GPU 1 saturated") for line in lines)
    assert any(line.startswith("Router (pid 7)") for line in lines)
    assert not any("LLM" in line for line in lines) and not any("GPU 0" in line for line in lines)
    client = {"pid": 9, "group": "load generator", "cores": 1.0, "busiest_thread": 0.99}
    assert "understate" in verdict(_summary([], [client]))[0]
    assert "host CPU saturated" in verdict(_summary([], [], host_busy=0.95))[0]
    idle = verdict(_summary([20.0], [llm]))
    assert len(idle) == 1 and idle[0].startswith("nothing saturated") and "LLM" in idle[0]
    assert "GIL" not in idle[0]
    # a serving process over one core with no busy thread is named as possibly GIL-bound
    busy_router = {"pid": 10, "group": "Router", "cores": 1.2, "busiest_thread": 0.3}
    raylet = {"pid": 11, "group": "raylet", "cores": 1.5, "busiest_thread": 0.4}
    gil = verdict(_summary([50.0], [raylet, busy_router, llm]))
    assert len(gil) == 1 and "possibly GIL-bound" in gil[0] and gil[0].split("GIL): ")[1].startswith("Router:")


def test_bodies_built_in_a_pool_equal_those_built_one_by_one():
    """A long run's bodies come from a process pool (256 or more); each seed's body is the same either way."""
    w = Workload("image", image_size=32)
    assert build_bodies(w, 7, 300) == [_body_bytes(w, 7 + i) for i in range(300)]


def _burn_then_sleep(cpu_s: float, sleep_s: float) -> None:
    end = time.process_time() + cpu_s
    while time.process_time() < end:
        pass
    time.sleep(sleep_s)


def _spawned(target, *args):
    child = multiprocessing.get_context("spawn").Process(target=target, args=args, daemon=True)
    child.start()
    return child


def _cpu_seconds(row: dict, group: str, since: float) -> float:
    return row["cores"].get(group, 0.0) * since


def test_the_host_timeline_counts_a_process_from_its_creation_only_inside_each_interval(monkeypatch):
    """Ticks by hand. A spawned child (in a group of its own here) created after the baseline burns 0.6
    CPU seconds then sleeps: the first interval holds its CPU, its start included, and marks it new; the
    next holds almost none and does not. A child that exits between ticks is dropped."""
    import psutil

    import benchmarks.monitor as monitor

    real = monitor.process_group
    pids: set[int] = set()
    monkeypatch.setattr(monitor, "process_group",
                        lambda title, pid, ppid=None: "child" if pid in pids else real(title, pid, ppid))
    tl = monitor.HostTimeline(gpus=False)
    tl.begin()
    child = _spawned(_burn_then_sleep, 0.6, 30)
    pids.add(child.pid)
    try:
        deadline, last = time.time() + 60, -1.0
        while time.time() < deadline:  # until it has burnt its share and sleeps (its CPU time stops)
            cpu = sum(psutil.Process(child.pid).cpu_times()[:2])
            if cpu >= 0.6 and cpu == last:
                break
            last = cpu
            time.sleep(0.2)
        since = time.perf_counter() - tl._last
        first = tl.tick()
        assert first["new"].get("child") == 1  # (other processes on the host may come and go meanwhile)
        assert 0.55 < _cpu_seconds(first, "child", since) < 0.6 + 1.5, first  # + its interpreter's start
        assert 0.0 <= first["host_busy"] <= 1.0
        time.sleep(0.5)
        since = time.perf_counter() - tl._last
        second = tl.tick()
        assert "child" not in second["new"] and _cpu_seconds(second, "child", since) < 0.05, second
    finally:
        child.terminate()
        child.join()
    third = tl.tick()  # the child is gone: no error, nothing new, no longer followed
    assert "child" not in third["new"] and "child" not in third["cores"] and child.pid not in tl._seen


def test_the_host_timeline_follows_a_process_into_the_group_its_title_gives_it(monkeypatch):
    """A Ray worker is untitled, then `ray::IDLE`, then a replica: it counts as new in the interval its
    group changes, with only the CPU of that interval."""
    import benchmarks.monitor as monitor

    child = _spawned(_burn_then_sleep, 0.0, 30)
    try:
        titles = {child.pid: None}
        real = monitor.process_group
        monkeypatch.setattr(monitor, "process_group",
                            lambda title, pid, ppid=None: titles.get(pid, real(title, pid, ppid)) if pid == child.pid
                            else real(title, pid, ppid))
        tl = monitor.HostTimeline(gpus=False)
        tl.begin()
        titles[child.pid] = "idle worker (test)"
        row = tl.tick()
        assert row["new"].get("idle worker (test)") == 1
        assert "idle worker (test)" not in row["cores"]  # not followed before its title matched: nothing counted
        titles[child.pid] = "replica (test)"
        row = tl.tick()
        assert row["new"].get("replica (test)") == 1 and "idle worker (test)" not in row["new"]
        assert "replica (test)" not in tl.tick()["new"]
    finally:
        child.terminate()
        child.join()
