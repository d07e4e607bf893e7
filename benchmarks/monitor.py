"""What saturates during a serving benchmark: GPU utilisation (NVML) and CPU per process (psutil),
sampled in a background thread, grouped by Ray Serve deployment, then a verdict.

- GPUs: `nvmlDeviceGetUtilizationRates().gpu`, the share of time a kernel ran (what `nvidia-smi dmon`
  shows as `sm`), through nvidia-ml-py (`pynvml`); without it, `nvidia-smi --query-gpu`; without a
  GPU, nothing. Only the GPUs in CUDA_VISIBLE_DEVICES when it is set.
- Processes: every process on this host whose title Ray set (`ray::ServeReplica:<app>:<Deployment>`,
  `ray::ProxyActor`, `ray::ServeController`, ...), the raylet and GCS, and this process with its
  multiprocessing children (the load generator). Per process: cores used (CPU time / wall time) and
  its busiest thread's share of one core. A Python process whose busiest thread sits near one core
  is bound by that thread (the GIL); a process near its core count is bound by its cores.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field

GPU_BUSY = 80.0  # % of time a kernel ran: a GPU at or above this is the bottleneck
THREAD_BUSY = 0.85  # a thread at this share of one core is saturated
HOST_BUSY = 0.9  # of all cores
PROCESS_GIL = 1.0  # a serving process at this many cores, with no thread saturated, may be GIL-bound


# ---------------------------------------------------------------------------- GPUs
class GpuSampler:
    def __init__(self):
        self.indices: list[int] = []
        self._nvml = None
        self._handles = []
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        wanted = None if visible is None else [int(v) for v in visible.split(",") if v.strip().isdigit()]
        try:
            import pynvml

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            self.indices = [i for i in range(count) if wanted is None or i in wanted]
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in self.indices]
            self._nvml = pynvml
            self.source = "nvml"
        except Exception:  # no library, no driver, no GPU
            self.source = "none"
            if shutil.which("nvidia-smi"):
                util = self._smi()
                if util:
                    self.indices = [i for i in sorted(util) if wanted is None or i in wanted]
                    self.source = "nvidia-smi"

    @staticmethod
    def _smi() -> dict[int, float]:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10).stdout
            return {int(i): float(u) for i, u in (line.split(",") for line in out.strip().splitlines())}
        except Exception:
            return {}

    def sample(self) -> list[float]:
        if self._nvml is not None:
            return [float(self._nvml.nvmlDeviceGetUtilizationRates(h).gpu) for h in self._handles]
        if self.source == "nvidia-smi":
            util = self._smi()
            return [util.get(i, float("nan")) for i in self.indices]
        return []


# ---------------------------------------------------------------------------- processes
def process_group(title: str, pid: int, ppid: int | None = None) -> str | None:
    """The group a process counts in, from its title; None for processes that are not Ray's nor the
    load generator's. The load generator is this process and its multiprocessing children (spawned
    ones run `python -c "from multiprocessing.spawn import spawn_main; ..."`): serve.py's load
    processes (`--load-processes`). Ray's titles, raylet and gcs_server are matched first, because
    `ray.init` in this process starts raylet and gcs_server as its children."""
    if pid == os.getpid():
        return "load generator"
    if title.startswith("ray::ServeReplica:"):  # "ray::ServeReplica:<app>:<Deployment>[.<method>]"
        return title.split(":")[-1].split()[0].split(".")[0]
    if title.startswith("ray::"):
        name = title[5:].split()[0].split(".")[0]
        return name if name in ("ProxyActor", "ServeController") else "other ray workers"
    base = os.path.basename(title.split()[0]) if title else ""
    if base in ("raylet", "gcs_server"):
        return base
    if ppid == os.getpid() and "multiprocessing" in title and "resource_tracker" not in title:
        return "load generator"  # (multiprocessing's resource tracker is a child too, and idle)
    return None


@dataclass
class _Proc:
    group: str
    proc: object
    first: tuple[float, dict[int, float]]  # (CPU seconds, per-thread CPU seconds) when first seen
    last: tuple[float, dict[int, float]]  # the same at the latest sample


class ProcessSampler:
    """CPU time of Ray's processes on this host, from when each was first seen to its latest sample
    (a replica that exits mid-run keeps what it had used)."""

    def __init__(self):
        import psutil

        self.psutil = psutil
        self.procs: dict[int, _Proc] = {}
        self._gone: set[int] = set()

    @staticmethod
    def _times(p) -> tuple[float, dict[int, float]]:
        t = p.cpu_times()
        return t.user + t.system, {th.id: th.user_time + th.system_time for th in p.threads()}

    def sample(self) -> None:
        for p in self.psutil.process_iter(["pid", "cmdline", "ppid"]):
            if p.pid in self.procs or p.pid in self._gone:
                continue
            try:
                group = process_group(" ".join(p.info["cmdline"] or []), p.pid, p.info["ppid"])
                if group is not None:
                    times = self._times(p)
                    self.procs[p.pid] = _Proc(group, p, times, times)
            except (self.psutil.Error, OSError):
                pass
        for pid, rec in self.procs.items():
            if pid in self._gone:
                continue
            try:
                rec.last = self._times(rec.proc)
            except (self.psutil.Error, OSError):
                self._gone.add(pid)

    def usage(self, wall_s: float) -> list[dict]:
        """Per process: cores used and its busiest thread's share of one core, over `wall_s`."""
        out = []
        for pid, rec in self.procs.items():
            (cpu0, th0), (cpu1, th1) = rec.first, rec.last
            busiest = max((t - th0.get(tid, 0.0) for tid, t in th1.items()), default=0.0)
            out.append({"pid": pid, "group": rec.group, "cores": (cpu1 - cpu0) / wall_s,
                        "busiest_thread": busiest / wall_s})
        return sorted(out, key=lambda p: -p["cores"])


class HostTimeline:
    """Per interval (`interval_s`, in a background thread): the host's busy fraction, each GPU's busy %,
    and the cores each process group used in it. For the seconds of a scale-up or a cold start, beside
    their TTFT: a replica starting on the host (a Ray worker importing torch, compiling kernels) shows
    as a process new to its group and as host time, which whole-run averages hide.
    - A process's group is read from its title at every tick: a Ray worker is `default_worker.py`,
      then `ray::IDLE`, then `ray::ServeReplica:<app>:<Deployment>`, and counts in the group it has at
      the end of each interval.
    - A process counts as new in the interval it was created or its group changed, and only CPU time
      used inside the interval counts there: all of it for one created inside the interval, none for
      one whose title only now matched a group (its earlier time was not followed).
    `with HostTimeline(t0=...) as tl: ...`; then `tl.rows`, each {"t": seconds from t0 at the
    interval's end, "host_busy", "gpu_busy", "cores": {group: cores}, "new": {group: processes}}. It
    samples in the process that runs it (the load generator's, where goodput.py runs it): about 0.3 ms
    of CPU per process on the host, each tick. A tick that fails is counted in `failed_ticks`."""

    def __init__(self, interval_s: float = 1.0, t0: float | None = None, gpus: bool = True):
        import psutil

        self.interval_s, self.psutil = interval_s, psutil
        self.t0 = time.perf_counter() if t0 is None else t0
        self.gpus = GpuSampler() if gpus else None
        self.rows: list[dict] = []
        self.failed_ticks = 0
        self._seen: dict[int, tuple[str | None, object, float]] = {}  # pid -> (group, process, CPU s at last tick)
        self._pids: set[int] = set()  # every process on the host at the last scan, counted or not
        self._stop = threading.Event()

    def _cpu(self, proc) -> float:
        t = proc.cpu_times()
        return t.user + t.system

    def _scan(self, baseline: bool) -> tuple[dict[str, float], dict[str, int]]:
        """CPU seconds per group since the last scan and the processes new to each group (`baseline`: the
        first scan, which only records). A process absent from the last scan was created since: all its
        CPU time counts; one present but not counted then (its title matched no group) counts from now."""
        used: dict[str, float] = {}
        new: dict[str, int] = {}
        alive, pids = set(), set()
        for p in self.psutil.process_iter(["pid", "cmdline", "ppid"]):
            pids.add(p.pid)
            try:
                group = process_group(" ".join(p.info["cmdline"] or []), p.pid, p.info["ppid"])
                known = self._seen.get(p.pid)
                if group is None and known is None:
                    continue
                cpu = self._cpu(p)
            except (self.psutil.Error, OSError):
                continue
            alive.add(p.pid)
            if known is None:
                before = 0.0 if not baseline and p.pid not in self._pids else cpu
                proc = p
            else:
                _, proc, before = known
            if not baseline and group is not None:
                if cpu > before:
                    used[group] = used.get(group, 0.0) + cpu - before
                if known is None or known[0] != group:  # created, or its title moved it into this group
                    new[group] = new.get(group, 0) + 1
            self._seen[p.pid] = (group, proc, cpu)
        for pid in set(self._seen) - alive:  # exited (what it used since the last tick is lost)
            del self._seen[pid]
        self._pids = pids
        return used, new

    def begin(self) -> None:
        """The baseline: every process seen now counts only from here (`__enter__` calls it)."""
        self._scan(baseline=True)
        self._host = self.psutil.cpu_times()
        self._last = time.perf_counter()

    def __enter__(self) -> HostTimeline:
        self.begin()
        self._thread = threading.Thread(target=self._run, daemon=True, name="host-timeline")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(max(0.0, self._last + self.interval_s - time.perf_counter())):
            try:
                self.tick()
            except Exception:  # an NVML or psutil error: this interval is lost, not the rest
                self.failed_ticks += 1
                self._last = time.perf_counter()

    def tick(self) -> dict:
        used, new = self._scan(baseline=False)
        now, host = time.perf_counter(), self.psutil.cpu_times()
        wall = max(now - self._last, 1e-9)
        total = _total(host) - _total(self._host)
        row = {"t": now - self.t0, "host_busy": (_busy(host) - _busy(self._host)) / total if total > 0 else 0.0,
               "gpu_busy": self.gpus.sample() if self.gpus is not None else [],
               "cores": {g: c / wall for g, c in sorted(used.items(), key=lambda kv: -kv[1])}, "new": new}
        self._host, self._last = host, now
        self.rows.append(row)
        return row


def _total(t) -> float:
    """All CPU seconds of a `psutil.cpu_times()` (guest time is already in user and nice: once only)."""
    return sum(t) - getattr(t, "guest", 0) - getattr(t, "guest_nice", 0)


def _busy(t) -> float:
    """Busy CPU seconds: all but idle and iowait."""
    return _total(t) - t.idle - getattr(t, "iowait", 0)


# ---------------------------------------------------------------------------- the monitor
@dataclass
class MonitorSummary:
    duration_s: float
    gpu_source: str
    gpu_indices: list[int]
    gpu_mean: list[float]  # % per GPU over the window
    gpu_timeline: list[tuple[float, list[float]]]  # (seconds since the monitor started, % per GPU)
    host_cores: int
    host_busy: float  # fraction of all cores
    processes: list[dict] = field(default_factory=list)  # pid, group, cores, busiest_thread
    groups: dict[str, dict] = field(default_factory=dict)  # group -> processes, cores, busiest_thread
    verdict: list[str] = field(default_factory=list)


class Monitor:
    """`with Monitor() as m: ...` samples every `interval_s`; `m.summary()` covers the block."""

    def __init__(self, interval_s: float = 0.5, t0: float | None = None):
        import psutil

        self.interval_s, self.psutil = interval_s, psutil
        self.t0 = time.perf_counter() if t0 is None else t0  # timeline origin (shared across a sweep)
        self.gpus = GpuSampler()
        self.procs = ProcessSampler()
        self._stop = threading.Event()
        self._gpu: list[tuple[float, list[float]]] = []

    def __enter__(self) -> Monitor:
        self.procs.sample()  # baselines
        self.psutil.cpu_percent(None)
        self._host_t0 = self.psutil.cpu_times()
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True, name="bench-monitor")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._tick()
        self._end = time.perf_counter()
        t0, t1 = self._host_t0, self.psutil.cpu_times()
        total = _total(t1) - _total(t0)
        self._host_busy = (_busy(t1) - _busy(t0)) / total if total > 0 else 0.0

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._tick()

    def _tick(self) -> None:
        util = self.gpus.sample()
        if util:
            self._gpu.append((time.perf_counter() - self.t0, util))
        self.procs.sample()

    def summary(self) -> MonitorSummary:
        wall = max(self._end - self._start, 1e-9)
        n = len(self.gpus.indices)
        gpu_mean = [sum(u[i] for _, u in self._gpu) / len(self._gpu) for i in range(n)] if self._gpu else []
        procs = self.procs.usage(wall)
        groups: dict[str, dict] = {}
        for p in procs:
            g = groups.setdefault(p["group"], {"processes": 0, "cores": 0.0, "busiest_thread": 0.0})
            g["processes"] += 1
            g["cores"] += p["cores"]
            g["busiest_thread"] = max(g["busiest_thread"], p["busiest_thread"])
        s = MonitorSummary(wall, self.gpus.source, self.gpus.indices, gpu_mean, self._gpu,
                           self.psutil.cpu_count() or 1, self._host_busy, procs, groups)
        s.verdict = verdict(s)
        return s


NOT_SERVING = {"load generator", "raylet", "gcs_server", "other ray workers"}


def verdict(s: MonitorSummary) -> list[str]:
    """Which stage saturates, one line each; the busiest GPU and process when nothing does."""
    lines = []
    for idx, u in zip(s.gpu_indices, s.gpu_mean):
        if u >= GPU_BUSY:
            lines.append(f"GPU {idx} saturated: {u:.0f}% busy")
    for p in s.processes:
        if p["busiest_thread"] >= THREAD_BUSY:
            who = "the load generator (results understate the server)" if p["group"] == "load generator" else \
                f"{p['group']} (pid {p['pid']})"
            lines.append(f"{who}: a thread at {p['busiest_thread']:.2f} core, process {p['cores']:.2f} cores")
    if s.host_busy >= HOST_BUSY:
        lines.append(f"host CPU saturated: {100 * s.host_busy:.0f}% of {s.host_cores} cores")
    if not lines:
        busiest_gpu = f"busiest GPU {max(s.gpu_mean):.0f}%" if s.gpu_mean else "no GPU sampled"
        top = s.processes[0] if s.processes else None
        top_txt = f"busiest process {top['group']} {top['cores']:.2f} cores" if top else "no Ray process on this host"
        # A replica's Python threads (its event loop, Ray Serve's, the engine's) share one GIL: the
        # process can be the queue while no single thread looks busy. Name those near a core.
        gil = sorted({p["group"] for p in s.processes if p["cores"] >= PROCESS_GIL and p["group"] not in NOT_SERVING})
        gil_txt = f"; possibly GIL-bound (a process at {PROCESS_GIL:g}+ core, its threads sharing one GIL): " \
            f"{', '.join(gil)}" if gil else ""
        lines.append(f"nothing saturated ({busiest_gpu}, {top_txt}, host {100 * s.host_busy:.0f}%){gil_txt}: "
                     "raise the concurrency, or the stages wait on each other")
    return lines


def print_summary(s: MonitorSummary) -> None:
    if s.gpu_mean:
        print("GPU busy %: " + ", ".join(f"GPU {i} {u:.0f}" for i, u in zip(s.gpu_indices, s.gpu_mean))
              + f" ({s.gpu_source})")
    print(f"host CPU {100 * s.host_busy:.0f}% of {s.host_cores} cores; per deployment/process group "
          "(processes, cores, busiest thread):")
    for name, g in sorted(s.groups.items(), key=lambda kv: -kv[1]["cores"]):
        print(f"  {name:<20} {g['processes']:>3}  {g['cores']:6.2f}  {g['busiest_thread']:5.2f}")
    for line in s.verdict:
        print("bottleneck:", line)
