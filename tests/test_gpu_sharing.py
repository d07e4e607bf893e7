"""How a replica that shares its GPU says it shares it (app/gpu/sharing.py): NVML's lists first (an MPS
client, or a plain compute process), the MPS daemon's pipe where NVML cannot tell, time slices otherwise;
a warning only for time slices."""

from __future__ import annotations

from types import SimpleNamespace

from app.gpu import sharing


class FakeNVML:
    """The five NVML calls sharing.py makes, over `clients` (MPS clients, one list of pids per GPU) and
    `compute` (ordinary compute processes, the same way; none unless given)."""

    def __init__(self, clients: list[list[int]], fail: bool = False, compute: list[list[int]] | None = None):
        self.clients, self.fail, self.calls = clients, fail, []
        self.compute = compute or [[] for _ in clients]

    def nvmlInit(self):
        self.calls.append("init")
        if self.fail:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self):
        return len(self.clients)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle):
        return [SimpleNamespace(pid=p, usedGpuMemory=1 << 30) for p in self.clients[handle]]

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return [SimpleNamespace(pid=p, usedGpuMemory=1 << 30) for p in self.compute[handle]]


def test_nvml_lists_the_processes_of_every_gpu_and_is_shut_down():
    nvml = FakeNVML([[11, 12], [], [40]], compute=[[7], [8, 9], []])
    assert sharing.nvml_pids(nvml) == ({11, 12, 40}, {7, 8, 9})
    assert nvml.calls == ["init", "shutdown"]
    assert sharing.nvml_pids(FakeNVML([], fail=True)) is None


def test_a_listed_client_shares_by_mps(tmp_path):
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}  # no daemon pipe there: NVML alone decides
    assert sharing.describe(True, pid=12, nvml=FakeNVML([[11, 12]]), env=env) == {"mode": "mps", "evidence": "nvml"}
    assert sharing.describe(True, pid=13, nvml=FakeNVML([[11, 12]]), env=env) == {"mode": "time slices",
                                                                                  "evidence": None}


def test_nvml_seeing_a_plain_compute_process_overrides_a_pipe_left_behind(tmp_path):
    """Seen on the device: the pipe of a daemon that had quit, and the replicas not on NVML's MPS list.
    Only where NVML lists this process at all: a container's NVML may list nothing, and the pipe decides."""
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    (tmp_path / "control").touch()
    plain = sharing.describe(True, pid=5, nvml=FakeNVML([[], []], compute=[[], [5, 6]]), env=env)
    assert plain == {"mode": "time slices", "evidence": "nvml"}
    assert "nvidia-cuda-mps-control -d" in sharing.time_slice_warning(plain)
    assert sharing.describe(True, pid=5, nvml=FakeNVML([[]]), env=env) == {"mode": "mps", "evidence": "pipe"}
    assert sharing.describe(True, pid=5, nvml=FakeNVML([[5]], compute=[[5]]), env=env) == {"mode": "mps",
                                                                                           "evidence": "nvml"}


def test_the_daemons_pipe_decides_where_nvml_cannot(tmp_path):
    """A container's pid namespace hides the pid from NVML, or NVML is missing: CUDA joins any daemon
    whose pipe it finds, so the pipe says MPS."""
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    assert sharing.describe(True, pid=5, nvml=FakeNVML([], fail=True), env=env)["mode"] == "time slices"
    (tmp_path / "control").touch()
    assert sharing.describe(True, pid=5, nvml=FakeNVML([], fail=True), env=env) == {"mode": "mps",
                                                                                    "evidence": "pipe"}
    assert sharing.describe(True, pid=5, nvml=FakeNVML([[999]]), env=env) == {"mode": "mps", "evidence": "pipe"}


def test_cuda_looks_for_the_daemon_in_its_default_directory_unless_told():
    assert str(sharing.pipe_dir({})) == "/tmp/nvidia-mps" == sharing.DEFAULT_PIPE_DIR
    assert str(sharing.pipe_dir({"CUDA_MPS_PIPE_DIRECTORY": "/run/mps"})) == "/run/mps"


def test_a_whole_gpu_is_alone_and_only_time_slices_warn(tmp_path):
    nvml = FakeNVML([[1]])
    alone = sharing.describe(False, pid=1, nvml=nvml)
    assert alone == {"mode": "alone", "evidence": None} and nvml.calls == []  # not even asked
    assert sharing.time_slice_warning(alone) is None
    assert sharing.time_slice_warning({"mode": "mps", "evidence": "nvml"}) is None
    warning = sharing.time_slice_warning({"mode": "time slices", "evidence": None})
    assert "nvidia-cuda-mps-control -d" in warning and "docs/guides/single-gpu.md" in warning
