"""Sample every Ray Serve replica process on this host with py-spy while one load point runs.

Why: a goodput point's tail is queueing somewhere on the host path (benchmarks/RESULTS.md), and which
process's Python holds it only shows in stacks taken under that load, not under a closed loop.
`benchmarks/goodput.py --pyspy EXE --pyspy-rate R` starts the samplers `delay_s` into the point at
rate R (after its ramp), each for `duration_s`, and waits for them after the point; the raw stacks
(`py-spy record --format raw --threads`, one file per process) go to `out_dir`, and
`benchmarks/pyspy_summary.py out_dir` sums them. `--gil` samples only the thread holding the GIL,
which is what says whether a process's threads wait on one another. As a command it samples now, once,
for a script (benchmarks/gpu_profile_serving.sh): `python3 benchmarks/pyspy_sampler.py EXE OUT_DIR [--gil]`.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.monitor import process_group  # noqa: E402


def serve_processes(ps_text: str | None = None) -> list[tuple[int, str]]:
    """(pid, deployment) of this host's replica and proxy processes, from the titles that Ray sets
    (`ray::ServeReplica:<app>:<Deployment>[.<method>]`, `ray::ProxyActor`) in `ps -eo pid=,args=`' output,
    named as benchmarks/monitor.py groups them."""
    out = ps_text if ps_text is not None else subprocess.run(
        ["ps", "-eo", "pid=,args="], capture_output=True, text=True, check=False).stdout
    found = []
    for line in out.splitlines():
        pid, _, title = line.strip().partition(" ")
        if title.startswith(("ray::ServeReplica:", "ray::ProxyActor")):
            found.append((int(pid), process_group(title, int(pid))))
    return found


def start(exe: str, out_dir: Path, delay_s: float, duration_s: float, gil: bool = False,
          processes: list[tuple[int, str]] | None = None) -> list[subprocess.Popen]:
    """One py-spy per serving process (`processes`, default this host's), each waiting `delay_s` first;
    returns at once."""
    out_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for pid, name in serve_processes() if processes is None else processes:
        stem = out_dir / f"{name}.{pid}{'.gil' if gil else ''}"
        cmd = (f"sleep {delay_s:.2f}; exec {shlex.quote(exe)} record --pid {pid} --rate 100 "
               f"--duration {max(1, round(duration_s))} --nonblocking --threads {'--gil ' if gil else ''}"
               f"--format raw --output {shlex.quote(f'{stem}.txt')}")
        with open(f"{stem}.log", "w") as log:  # the child keeps its own copy of the file
            procs.append(subprocess.Popen(["bash", "-c", cmd], stdout=log, stderr=subprocess.STDOUT))
    return procs


def start_all(exe: str, out_dir: Path, delay_s: float, duration_s: float, gil: bool = True,
              processes: list[tuple[int, str]] | None = None) -> list[subprocess.Popen]:
    """`start` for every serving process (listed once), all threads and, with `gil`, the GIL holder too."""
    found = serve_processes() if processes is None else processes
    procs = start(exe, out_dir, delay_s, duration_s, processes=found)
    return procs + (start(exe, out_dir, delay_s, duration_s, gil=True, processes=found) if gil else [])


def wait(procs: list[subprocess.Popen], timeout_s: float = 30.0) -> int:
    """Wait for the samplers (killing any still running after `timeout_s`); how many wrote stacks."""
    ok = 0
    for p in procs:
        try:
            ok += p.wait(timeout=timeout_s) == 0
        except subprocess.TimeoutExpired:
            p.kill()
    return ok


def main(argv: list[str] | None = None, ps_text: str | None = None) -> int:
    """Sample every serving process of this host now, for --duration seconds (all threads, and with --gil
    also the GIL holder), and wait; how many samplers wrote stacks."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("exe", help="py-spy's path")
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--gil", action="store_true", help="also the thread holding the GIL, in .gil files")
    a = ap.parse_args(argv)
    found = serve_processes(ps_text)
    a.out_dir.mkdir(parents=True, exist_ok=True)
    (a.out_dir / "processes.txt").write_text("".join(f"{pid} {name}\n" for pid, name in found))
    procs = start_all(a.exe, a.out_dir, a.delay, a.duration, gil=a.gil, processes=found)
    ok = wait(procs, timeout_s=a.delay + a.duration + 30)
    print(f"py-spy: {ok} of {len(procs)} samplers wrote stacks to {a.out_dir}")
    return ok


if __name__ == "__main__":
    main()
