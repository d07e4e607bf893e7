"""benchmarks/pyspy_sampler.py: which processes a goodput point samples, and the py-spy commands it runs."""

from __future__ import annotations

import stat

from benchmarks import pyspy_sampler

PS = """\
    1 /sbin/init
  812 ray::ServeReplica:vlm:LLM
  813 ray::ServeReplica:vlm:Router
  814 ray::ServeReplica:vlm:LLM.generate_from_media
  900 ray::ProxyActor
  901 ray::ServeController
  950 python benchmarks/goodput.py --start
  977 ray::IDLE
"""


def test_serve_processes_are_the_replicas_and_the_proxy():
    assert pyspy_sampler.serve_processes(PS) == [(812, "LLM"), (813, "Router"), (814, "LLM"),  # busy: its method
                                                 (900, "ProxyActor")]


def test_start_runs_one_sampler_per_process_after_the_delay(tmp_path):
    """Each process its own output file, also where the folder's name has spaces (a workload's label)."""
    exe = tmp_path / "fake-py-spy"  # writes its arguments where py-spy would write its stacks
    exe.write_text('#!/bin/bash\nargs="$*"; while [ $# -gt 0 ]; do [ "$1" = --output ] && out=$2; shift; done\n'
                   'echo "$args" > "$out"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    procs = [*pyspy_sampler.start(str(exe), tmp_path / "a dir^", 0.1, 3.4, processes=[(812, "LLM"), (813, "Router")]),
             *pyspy_sampler.start(str(exe), tmp_path / "a dir^", 0.1, 3.4, gil=True, processes=[(812, "LLM")])]
    assert pyspy_sampler.wait(procs, timeout_s=20) == 3
    llm = (tmp_path / "a dir^" / "LLM.812.txt").read_text().split()
    assert llm[:3] == ["record", "--pid", "812"] and "--duration" in llm and llm[llm.index("--duration") + 1] == "3"
    assert "--gil" not in llm and "--nonblocking" in llm and "--threads" in llm
    assert "--gil" in (tmp_path / "a dir^" / "LLM.812.gil.txt").read_text().split()
    assert (tmp_path / "a dir^" / "Router.813.txt").read_text().split()[2] == "813"


def test_the_command_samples_every_serving_process_once(tmp_path):
    """`python3 benchmarks/pyspy_sampler.py EXE DIR --gil` (the profiling script's use): one sampler per
    process and one more per process for the GIL holder, the processes listed beside the stacks."""
    exe = tmp_path / "fake-py-spy"
    exe.write_text('#!/bin/bash\nwhile [ $# -gt 0 ]; do [ "$1" = --output ] && out=$2; shift; done\necho x > "$out"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "profile"
    assert pyspy_sampler.main([str(exe), str(out), "--duration", "1", "--gil"], ps_text=PS) == 8
    assert (out / "processes.txt").read_text().split("\n")[0] == "812 LLM"
    assert sorted(p.name for p in out.glob("*.txt") if p.name != "processes.txt") == [
        "LLM.812.gil.txt", "LLM.812.txt", "LLM.814.gil.txt", "LLM.814.txt",
        "ProxyActor.900.gil.txt", "ProxyActor.900.txt", "Router.813.gil.txt", "Router.813.txt"]
