"""The pre-flight doctor: each check on a faked machine (its readers replaced), the
command line's table, JSON and exit code, and one real run in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncpin import _sys, doctor
from asyncpin.cli import main
from asyncpin.doctor import Check, CudaInfo, Memlock, run_checks

REPO = Path(__file__).resolve().parents[1]
MiB, GiB = 1 << 20, 1 << 30
TIMEOUT_S = 120
NAMES = [
    "memory",
    "cgroup",
    "memlock",
    "thp",
    "thp_defrag",
    "hugetlb",
    "shm",
    "stale_regions",
    "cuda",
    "batch_copy",
]

NO_GPU = CudaInfo(torch_cuda=None, available=False)
H200 = CudaInfo(
    torch_cuda="13.0",
    available=True,
    devices=("NVIDIA H200",),
    runtime_version=13000,
    driver_version=13000,
    batch_copy=True,
)


class Machine:
    """What the doctor's readers return; a healthy machine with a GPU until changed."""

    def __init__(self) -> None:
        self.meminfo = {
            "MemAvailable": 64 * GiB,
            "HugePages_Total": 0,
            "HugePages_Free": 0,
            "Hugepagesize": 2 * MiB,
        }
        self.cgroup: _sys.CgroupMemory | None = None
        self.memlock = Memlock(limit_bytes=None, locked_bytes=0, has_cap_ipc_lock=False)
        self.thp: tuple[str | None, str | None] = ("madvise", "madvise")
        self.shm_free: int | None = 32 * GiB
        self.stale: list[str] = []
        self.cuda = H200


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> Iterator[Machine]:
    fake = Machine()
    monkeypatch.setattr(doctor, "_read_meminfo", lambda: fake.meminfo)
    monkeypatch.setattr(doctor, "_cgroup", lambda: fake.cgroup)
    monkeypatch.setattr(doctor, "_memlock", lambda: fake.memlock)
    monkeypatch.setattr(doctor, "_thp", lambda: fake.thp)
    monkeypatch.setattr(doctor, "_shm_free", lambda: fake.shm_free)
    monkeypatch.setattr(doctor, "_cuda", lambda: fake.cuda)
    monkeypatch.setattr(doctor, "_stale", lambda: fake.stale)
    yield fake


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {check.name: check for check in checks}


def the(name: str, **kwargs: Any) -> Check:
    return by_name(run_checks(**kwargs))[name]


class TestHealthyMachine:
    """Every check passes on a machine with room, huge pages and a recent GPU stack."""

    def test_all_pass(self, machine: Machine) -> None:
        checks = run_checks()
        assert [check.name for check in checks] == NAMES
        assert {check.status for check in checks} == {"pass"}, checks
        assert all(check.advice == "" for check in checks)
        assert doctor.worst(checks) == "pass"

    def test_default_buffer_is_the_demos(self, machine: Machine) -> None:
        assert "buffer 4.00 GiB" in the("memory").value  # min(4 GiB, 64 GiB / 4)
        machine.meminfo["MemAvailable"] = 8 * GiB
        assert "buffer 2.00 GiB" in the("memory").value

    def test_check_is_frozen(self) -> None:
        check = Check("memory", "pass", "fine")
        with pytest.raises(AttributeError):
            check.status = "fail"  # type: ignore[misc]


class TestMemory:
    """MemAvailable and the cgroup limit bound the buffer; a binding limit is reported."""

    def test_buffer_larger_than_available_fails(self, machine: Machine) -> None:
        check = the("memory", nbytes=100 * GiB)
        assert check.status == "fail"
        assert "MemAvailable 64.00 GiB" in check.value and "--size" in check.advice

    def test_buffer_near_available_warns(self, machine: Machine) -> None:
        assert the("memory", nbytes=60 * GiB).status == "warn"

    def test_no_cgroup_limit(self, machine: Machine) -> None:
        assert the("cgroup").value == "no limit"

    @pytest.mark.parametrize("version", [1, 2])
    def test_cgroup_limit_below_mem_available_is_reported(
        self, machine: Machine, version: int
    ) -> None:
        machine.cgroup = _sys.CgroupMemory(version, "/sys/fs/cgroup/x", 16 * GiB, 4 * GiB)
        check = the("cgroup", nbytes=1 * GiB)
        assert check.status == "warn"
        assert f"cgroup v{version} limit 16.00 GiB" in check.value
        assert "12.00 GiB left" in check.value and "below MemAvailable (64.00 GiB)" in check.value
        assert "docker --memory" in check.advice

    def test_cgroup_headroom_sets_the_default_buffer(self, machine: Machine) -> None:
        machine.cgroup = _sys.CgroupMemory(2, "/sys/fs/cgroup/x", 6 * GiB, 2 * GiB)
        assert "buffer 1.00 GiB" in the("memory").value  # 4 GiB of headroom / 4

    def test_cgroup_headroom_below_the_buffer_fails(self, machine: Machine) -> None:
        machine.cgroup = _sys.CgroupMemory(2, "/sys/fs/cgroup/x", 8 * GiB, 7 * GiB)
        check = the("cgroup", nbytes=2 * GiB)
        assert check.status == "fail"
        assert "OOM" in check.advice

    def test_generous_cgroup_limit_passes(self, machine: Machine) -> None:
        machine.cgroup = _sys.CgroupMemory(2, "/sys/fs/cgroup/x", 512 * GiB, 1 * GiB)
        assert the("cgroup").status == "pass"


class TestMemlock:
    """A tiny RLIMIT_MEMLOCK fails the host backend unless CAP_IPC_LOCK lifts it."""

    def test_tiny_limit_without_capability_fails_for_the_host_backend(
        self, machine: Machine
    ) -> None:
        machine.cuda = NO_GPU  # so "auto" means the host backend
        machine.memlock = Memlock(8 * MiB, 0, has_cap_ipc_lock=False)
        check = the("memlock", nbytes=64 * MiB)
        assert check.status == "fail"
        assert "8.00 MiB without CAP_IPC_LOCK" in check.value
        assert "`ulimit -l unlimited`" in check.advice and "CAP_IPC_LOCK" in check.advice
        assert "--ulimit memlock=-1" in check.advice and "LimitMEMLOCK" in check.advice

    def test_tiny_limit_fails_for_an_explicit_host_backend(self, machine: Machine) -> None:
        machine.memlock = Memlock(8 * MiB, 0, has_cap_ipc_lock=False)
        assert the("memlock", backend="host", nbytes=64 * MiB).status == "fail"

    def test_default_buffer_is_capped_like_the_demos(self, machine: Machine) -> None:
        """With no --size, the doctor checks the buffer the demo would map: capped at what
        is left of the limit when mlock pins it without CAP_IPC_LOCK."""
        machine.memlock = Memlock(8 * MiB, 2 * MiB, has_cap_ipc_lock=False)
        assert "buffer 6.00 MiB" in the("memory", backend="host").value
        assert the("memlock", backend="host").status == "pass"
        assert "buffer 4.00 GiB" in the("memory").value  # CUDA pins it: no cap

    def test_tiny_limit_only_warns_with_a_gpu(self, machine: Machine) -> None:
        machine.memlock = Memlock(8 * MiB, 0, has_cap_ipc_lock=False)
        check = the("memlock")
        assert check.status == "warn"
        assert "ulimit -l" in check.advice

    def test_capability_lifts_the_limit(self, machine: Machine) -> None:
        machine.cuda = NO_GPU
        machine.memlock = Memlock(8 * MiB, 0, has_cap_ipc_lock=True)
        check = the("memlock")
        assert check.status == "pass" and "CAP_IPC_LOCK held" in check.value

    def test_locked_bytes_count_against_the_limit(self, machine: Machine) -> None:
        machine.cuda = NO_GPU
        machine.memlock = Memlock(2 * GiB, 1536 * MiB, has_cap_ipc_lock=False)
        assert the("memlock", nbytes=256 * MiB).status == "pass"
        check = the("memlock", nbytes=1 * GiB)
        assert check.status == "fail" and "512.00 MiB left" in check.value

    def test_unlimited_passes(self, machine: Machine) -> None:
        machine.cuda = NO_GPU
        assert the("memlock", nbytes=1 << 40).value == "unlimited"


class TestHugePages:
    """THP off or never defragmented warns; a short hugetlb pool warns (it is opt-in)."""

    def test_thp_never_warns(self, machine: Machine) -> None:
        machine.thp = ("never", "madvise")
        check = the("thp")
        assert check.status == "warn"
        assert "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled" in check.advice

    def test_thp_missing_warns(self, machine: Machine) -> None:
        machine.thp = (None, None)
        assert the("thp").status == "warn"
        assert the("thp_defrag").value == "not available"

    @pytest.mark.parametrize("mode", ["always", "madvise"])
    def test_thp_modes_that_serve_madvise(self, machine: Machine, mode: str) -> None:
        machine.thp = (mode, "madvise")
        assert the("thp").status == "pass"

    @pytest.mark.parametrize(
        ("defrag", "status"),
        [
            ("always", "pass"),
            ("madvise", "pass"),
            ("defer+madvise", "pass"),
            ("defer", "warn"),
            ("never", "warn"),
        ],
    )
    def test_thp_defrag(self, machine: Machine, defrag: str, status: str) -> None:
        machine.thp = ("madvise", defrag)
        assert the("thp_defrag").status == status

    def test_short_hugetlb_pool_warns(self, machine: Machine) -> None:
        machine.meminfo.update(HugePages_Total=512, HugePages_Free=100)
        check = the("hugetlb", nbytes=1 * GiB)
        assert check.status == "warn"
        assert "100 of 512 pages" in check.value
        assert "512 free pages" in check.advice and "nr_hugepages" in check.advice

    def test_big_enough_hugetlb_pool_passes(self, machine: Machine) -> None:
        machine.meminfo.update(HugePages_Total=1024, HugePages_Free=1024)
        assert the("hugetlb", nbytes=1 * GiB).status == "pass"


class TestShm:
    """A small /dev/shm warns, and fails when the region is to be shared."""

    def test_small_shm_warns_for_anonymous_regions(self, machine: Machine) -> None:
        machine.shm_free = 64 * MiB  # docker's default
        check = the("shm", nbytes=1 * GiB)
        assert check.status == "warn"
        assert "64.00 MiB free" in check.value and "backing='shared'" in check.value
        assert "--shm-size" in check.advice and "remount" in check.advice

    def test_small_shm_fails_for_shared_regions(self, machine: Machine) -> None:
        machine.shm_free = 64 * MiB
        assert the("shm", nbytes=1 * GiB, backing="shared").status == "fail"

    def test_missing_shm(self, machine: Machine) -> None:
        machine.shm_free = None
        assert the("shm").status == "warn"
        assert the("shm", backing="shared").status == "fail"


class TestCuda:
    """GPU visibility, driver against runtime, and the batched-copy API."""

    def test_no_gpu_warns(self, machine: Machine) -> None:
        machine.cuda = NO_GPU
        checks = by_name(run_checks())
        assert checks["cuda"].status == "warn"
        assert "no GPU visible (a CPU build of torch)" in checks["cuda"].value
        assert checks["cuda"].value.endswith("the host backend pins with mlock")
        assert checks["batch_copy"] == Check("batch_copy", "warn", "no GPU")

    def test_no_gpu_fails_when_cuda_is_asked_for(self, machine: Machine) -> None:
        machine.cuda = CudaInfo(torch_cuda="12.8", available=False)
        check = the("cuda", backend="cuda")
        assert check.status == "fail"
        assert "torch built for CUDA 12.8" in check.value
        # Not the host backend's fallback: the backend asked for is cuda.
        assert check.value.endswith("the cuda backend cannot run"), check.value

    def test_gpu_and_versions(self, machine: Machine) -> None:
        check = the("cuda")
        assert check.status == "pass"
        assert "1 GPU(s): NVIDIA H200" in check.value
        assert "driver supports CUDA 13.0, runtime 13.0" in check.value

    def test_driver_older_than_runtime_fails(self, machine: Machine) -> None:
        machine.cuda = CudaInfo("12.8", True, ("NVIDIA H200",), 12080, 12020, True)
        check = the("cuda")
        assert check.status == "fail"
        assert "driver supports CUDA 12.2, runtime 12.8" in check.value
        assert "update the NVIDIA driver" in check.advice

    def test_runtime_without_batched_copies_warns(self, machine: Machine) -> None:
        machine.cuda = CudaInfo("12.4", True, ("NVIDIA H100",), 12040, 12080, False)
        check = the("batch_copy")
        assert check.status == "warn"
        assert "runtime 12.4" in check.value and "12.8" in check.advice

    def test_a_failed_query_warns(self, machine: Machine) -> None:
        machine.cuda = CudaInfo("13.0", True, error="RuntimeError: boom")
        checks = by_name(run_checks())
        assert checks["cuda"].status == "warn" and "boom" in checks["cuda"].value
        assert checks["batch_copy"].status == "warn"


class TestReaders:
    """The real readers parse this machine without raising."""

    def test_readers(self) -> None:
        assert doctor._read_meminfo()["MemAvailable"] > 0
        memlock = doctor._memlock()
        assert memlock.has_cap_ipc_lock == _sys.has_cap_ipc_lock()
        enabled, defrag = doctor._thp()
        assert enabled in (None, "always", "madvise", "never")
        assert defrag in (None, "always", "defer", "defer+madvise", "madvise", "never")
        free = doctor._shm_free()
        assert free is None or free >= 0
        cuda = doctor._cuda()
        assert cuda.error is None

    def test_cuda_reader_on_a_faked_gpu(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import torch

        import asyncpin._cudart

        class FakeCudart:
            @staticmethod
            def cudaRuntimeGetVersion(out: Any) -> int:
                out._obj.value = 12080
                return 0

            @staticmethod
            def cudaDriverGetVersion(out: Any) -> int:
                out._obj.value = 13000
                return 0

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"GPU {i}")
        monkeypatch.setattr(torch.version, "cuda", "12.8")
        monkeypatch.setattr(asyncpin._cudart, "cudart", lambda: FakeCudart())
        monkeypatch.setattr(asyncpin._cudart, "batch_copy_available", lambda: True)
        assert doctor._cuda() == CudaInfo("12.8", True, ("GPU 0", "GPU 1"), 12080, 13000, True)
        monkeypatch.setattr(asyncpin._cudart, "cudart", lambda: None)
        assert doctor._cuda().error == "libcudart is linked statically"

    def test_thp_reads_the_bracketed_word(
        self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
    ) -> None:
        (tmp_path / "enabled").write_text("always [madvise] never\n")
        (tmp_path / "defrag").write_text("always defer [defer+madvise] madvise never\n")
        monkeypatch.setattr(doctor, "_THP_DIR", tmp_path)
        assert doctor._thp() == ("madvise", "defer+madvise")
        (tmp_path / "defrag").unlink()
        assert doctor._thp() == ("madvise", None)


class TestCommandLine:
    """`asyncpin doctor` prints a table or JSON and exits 1 exactly when a check fails."""

    def test_json_and_exit_code(self, machine: Machine, capsys: pytest.CaptureFixture[str]) -> None:
        assert main(["doctor", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["status"] == "pass"
        assert [check["name"] for check in doc["checks"]] == NAMES
        assert set(doc["checks"][0]) == {"name", "status", "value", "advice"}

        machine.cuda = NO_GPU
        machine.memlock = Memlock(8 * MiB, 0, has_cap_ipc_lock=False)
        assert main(["doctor", "--json", "--size", "64MiB"]) == 1
        doc = json.loads(capsys.readouterr().out)
        assert doc["status"] == "fail"
        memlock = by_name([Check(**check) for check in doc["checks"]])["memlock"]
        assert memlock.status == "fail" and "ulimit -l" in memlock.advice

    def test_options_reach_the_checks(
        self, machine: Machine, capsys: pytest.CaptureFixture[str]
    ) -> None:
        machine.shm_free = 64 * MiB
        assert main(["doctor", "--json", "--size", "1GiB"]) == 0  # a warning only
        assert main(["doctor", "--json", "--size", "1GiB", "--backing", "shared"]) == 1
        capsys.readouterr()

    def test_table(self, machine: Machine, capsys: pytest.CaptureFixture[str]) -> None:
        machine.shm_free = 64 * MiB
        assert main(["doctor", "--size", "1GiB"]) == 0
        out = capsys.readouterr().out
        assert "asyncpin doctor" in out and "what to change" in out
        for name in NAMES:
            assert name in out
        assert "warn" in out and "--shm-size" in out

    def test_bad_size_is_a_usage_error(self, capsys: pytest.CaptureFixture[str]) -> None:
        assert main(["doctor", "--size", "12XB"]) == 2
        assert "--size" in capsys.readouterr().err

    def test_real_run_in_a_subprocess(self) -> None:
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        proc = subprocess.run(
            [sys.executable, "-m", "asyncpin", "doctor", "--json"],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": path},
            cwd=REPO,
            timeout=TIMEOUT_S,
        )
        doc = json.loads(proc.stdout)
        statuses = [check["status"] for check in doc["checks"]]
        assert [check["name"] for check in doc["checks"]] == NAMES
        assert set(statuses) <= {"pass", "warn", "fail"}
        assert doc["status"] == max(statuses, key=["pass", "warn", "fail"].index)
        assert proc.returncode == (1 if "fail" in statuses else 0), proc.stderr


class TestStaleRegions:
    """Regions left by a creator that is gone are reported, with how to reclaim them."""

    def test_none(self, machine: Machine) -> None:
        check = the("stale_regions")
        assert check.status == "pass" and check.value == "none"

    def test_listed_with_advice(self, machine: Machine) -> None:
        machine.stale = ["kv-a", "kv-b"]
        check = the("stale_regions")
        assert check.status == "warn"
        assert "kv-a" in check.value and "kv-b" in check.value
        assert "reclaims" in check.advice and "unlink_stale" in check.advice


@pytest.mark.parametrize(
    "kwargs",
    [{"nbytes": 0}, {"nbytes": -5}, {"nbytes": 1.5}, {"backend": "x"}, {"backing": "x"}],
    ids=repr,
)
def test_run_checks_refuses_arguments_a_manager_refuses(kwargs: dict[str, Any]) -> None:
    """A newcomer's trial: run_checks(nbytes=0) or backend='x' returned passing checks."""
    from asyncpin import ConfigError

    with pytest.raises(ConfigError):
        doctor.run_checks(**kwargs)
