"""The bench scripts as a new user meets them on a machine with no GPU.

Every script that measures a CUDA GPU says so in one line and exits non-zero (no
traceback). ``bench/loop_lag.py`` takes ``--size`` with units, as its usage line and the
CLI do. Subprocesses run with ``CUDA_VISIBLE_DEVICES`` empty, and the in-process runs see
``torch.cuda.is_available()`` as False, so the checks hold on a GPU machine too.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
TIMEOUT_S = 120.0

GPU_SCRIPTS = [
    "both_trace",
    "busy_loop",
    "capture_probe",
    "cuda_pinning",
    "rss_drift",
    "soak",
    "submit_costs",
    "submit_profile",
    "transfers",
    "upload_costs",
]
# Run without a GPU: the host backend, or no device at all.
CPU_SCRIPTS = ["gil_starvation", "loop_lag", "pinning"]


def run(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, str(BENCH / f"{script}.py"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


def run_here(script: str, *args: str, monkeypatch: pytest.MonkeyPatch) -> SystemExit:
    """Run a script as ``__main__`` in this process; returns how it exited."""
    path = str(BENCH / f"{script}.py")
    monkeypatch.setattr(sys, "argv", [path, *args])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script prepends the repo root
    with pytest.raises(SystemExit) as info:
        runpy.run_path(path, run_name="__main__")
    return info.value


def test_every_script_is_listed() -> None:
    scripts = {p.stem for p in BENCH.glob("*.py") if not p.stem.startswith("_")}
    assert scripts == set(GPU_SCRIPTS) | set(CPU_SCRIPTS), "list the new script here"


@pytest.mark.parametrize("script", GPU_SCRIPTS)
def test_gpu_script_without_a_gpu_says_so(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    exited = run_here(script, monkeypatch=monkeypatch)
    # sys.exit(message): the interpreter prints the message to stderr and exits with 1.
    assert isinstance(exited.code, str), exited.code
    assert exited.code.startswith(f"{script}.py needs a CUDA GPU: ")
    assert "\n" not in exited.code


def test_transfers_without_a_gpu_exits_with_one_line(tmp_path: Path) -> None:
    done = run("transfers", cwd=tmp_path)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stdout == ""
    assert done.stderr.startswith("transfers.py needs a CUDA GPU: "), done.stderr[-2000:]
    assert done.stderr.count("\n") == 1, done.stderr[-2000:]


class TestLoopLag:
    def test_size_with_a_unit(self, tmp_path: Path) -> None:
        out = tmp_path / "lag.json"
        done = run(
            "loop_lag", "--size", "1MiB", "--repeats", "1", "--json-out", str(out), cwd=tmp_path
        )
        assert done.returncode == 0, done.stderr[-2000:]
        report = json.loads(out.read_text())
        assert report["size_bytes"] == 1 << 20
        assert report["backend"] == "host"
        assert "loop lag while pinning 1.00 MiB (host)" in done.stdout

    def test_a_bad_size_is_a_usage_error(
        self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        exited = run_here("loop_lag", "--size", "16XB", monkeypatch=monkeypatch)
        assert exited.code == 2
        assert "argument --size: invalid size '16XB'" in capsys.readouterr().err

    def test_size_or_size_gib_not_both(
        self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        exited = run_here("loop_lag", "--size", "1GiB", "--size-gib", "1", monkeypatch=monkeypatch)
        assert exited.code == 2  # one or the other
        assert "not allowed with argument --size" in capsys.readouterr().err
