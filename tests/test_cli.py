"""The command line: ``python -m asyncpin demo`` in a subprocess, and its pure helpers."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncpin.cli import default_nbytes, parse_size

REPO = Path(__file__).resolve().parents[1]
MiB, GiB = 1 << 20, 1 << 30
TIMEOUT_S = 120


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def demo(*args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*prefix, sys.executable, "-m", "asyncpin", "demo", *args],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=REPO,
        timeout=TIMEOUT_S,
    )


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got: {stderr!r}"
    assert lines[0].startswith("asyncpin demo: error: "), lines[0]
    assert "Traceback" not in stderr
    return lines[0]


class TestDemoPinsAndCloses:
    """`demo` pins the whole buffer, closes it, gives every lock back and exits 0."""

    def test_json_stats(self) -> None:
        proc = demo("--size", "64MiB", "--backend", "host", "--json")
        assert proc.returncode == 0, proc.stderr
        doc: dict[str, Any] = json.loads(proc.stdout)
        stats, at_pinned = doc["stats"], doc["at_pinned"]
        assert at_pinned["nbytes"] == 64 * MiB
        assert at_pinned["pinned_bytes"] == at_pinned["nbytes"]
        assert at_pinned["chunks_pinned"] == at_pinned["chunks_total"]
        assert at_pinned["state"] == "open"
        assert stats["state"] == "closed"
        assert stats["pinned_bytes"] == 0, "every chunk is unpinned by close"
        assert stats["chunks_leaked"] == 0
        assert stats["error"] is None
        assert stats["seconds_to_enter"] is not None and stats["seconds_to_pinned"] is not None
        assert stats["close_seconds"] is not None
        assert doc["vm_locked_bytes_after_close"] == 0

    def test_table(self) -> None:
        proc = demo("--size", "16MiB", "--backend", "host", "--chunk-mib", "4")
        assert proc.returncode == 0, proc.stderr
        for figure in ("time to enter", "time to pinned", "pinning speed", "close time"):
            assert figure in proc.stdout
        assert "4 chunks" in proc.stdout

    def test_shared_backing_unlinks(self, shm_name: str) -> None:
        proc = demo(
            "--size", "8MiB", "--backend", "host", "--backing", "shared", "--name", shm_name,
            "--json",
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        assert doc["stats"]["backing"] == "shared"
        assert doc["region_name"] == shm_name  # where it lived, said
        assert not (Path("/dev/shm") / shm_name).exists()

    def test_the_table_names_the_shared_file(self, shm_name: str) -> None:
        args = ("--size", "8MiB", "--backend", "host", "--backing", "shared", "--name", shm_name)
        proc = demo(*args)
        assert proc.returncode == 0, proc.stderr
        assert f"/dev/shm/{shm_name}" in proc.stdout


def closed_stdout(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m asyncpin ARGS`` whose stdout is a pipe nobody reads (``| head -0``):
    every write to it fails (EPIPE)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "asyncpin", *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
            cwd=REPO,
            timeout=TIMEOUT_S,
        )
    finally:
        os.close(write_end)


@pytest.mark.parametrize("command", [["doctor"], ["demo", "--backend", "host"]])
def test_a_process_started_with_no_stdout_runs_as_it_would(command: list[str]) -> None:
    """Started with its stdout closed (``>&-``: sys.stdout is None), a command exits as it
    would have, with no traceback (hostile trial: AttributeError on None's write)."""
    normal = subprocess.run(
        [sys.executable, "-m", "asyncpin", *command, "--size", "16MiB"],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=REPO,
        timeout=TIMEOUT_S,
    )
    proc = subprocess.run(
        [sys.executable, "-m", "asyncpin", *command, "--size", "16MiB"],
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=REPO,
        timeout=TIMEOUT_S,
        preexec_fn=lambda: os.close(1),  # the child's fd 1 only
    )
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode == normal.returncode


class TestOutputReaderGone:
    """A reader of stdout that went away (``| head``) is not the command's failure: it
    exits as it would have, with no traceback, and the demo still closes in order."""

    @pytest.mark.parametrize("output", ["table", "json"])
    def test_demo(self, output: str, shm_name: str) -> None:
        args = ["demo", "--size", "16MiB", "--backend", "host", "--backing", "shared"]
        args += ["--name", shm_name, *(["--json"] if output == "json" else [])]
        proc = closed_stdout(*args)
        assert (proc.returncode, proc.stderr) == (0, "")
        assert not (Path("/dev/shm") / shm_name).exists()

    def test_demo_on_a_terminal(self) -> None:
        """As on a terminal (FORCE_COLOR: rich's live progress bar, which puts a proxy in
        sys.stdout): the demo runs to its table and exits 0 (review: each write called
        itself through the proxy, and the demo hung)."""
        proc = subprocess.run(
            [sys.executable, "-m", "asyncpin", "demo", "--size", "16MiB", "--backend", "host"],
            capture_output=True,
            text=True,
            env={**_env(), "FORCE_COLOR": "1"},
            cwd=REPO,
            timeout=TIMEOUT_S,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "time to pinned" in proc.stdout

    def test_doctor(self) -> None:
        normal = subprocess.run(
            [sys.executable, "-m", "asyncpin", "doctor", "--size", "16MiB"],
            capture_output=True,
            text=True,
            env=_env(),
            cwd=REPO,
            timeout=TIMEOUT_S,
        )
        proc = closed_stdout("doctor", "--size", "16MiB")
        assert "Traceback" not in proc.stderr
        assert proc.returncode == normal.returncode


class TestDemoErrors:
    """Bad input and unavailable backends exit non-zero with one line on stderr."""

    @pytest.mark.parametrize("size", ["12XB", "0", "0.3KiB"])
    def test_bad_size(self, size: str) -> None:
        proc = demo(f"--size={size}", "--backend", "host")
        assert proc.returncode == 2
        line = one_error_line(proc.stderr)
        assert "--size" in line

    @pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
    def test_cuda_without_gpu(self) -> None:
        proc = demo("--size", "64MiB", "--backend", "cuda")
        assert proc.returncode == 1
        assert "cuda" in one_error_line(proc.stderr)

    def test_name_needs_shared(self) -> None:
        proc = demo("--size", "8MiB", "--backend", "host", "--name", "x")
        assert proc.returncode == 2
        assert "--backing shared" in one_error_line(proc.stderr)

    def test_too_big_for_memory(self) -> None:
        proc = demo("--size", "1TiB", "--backend", "host")
        assert proc.returncode == 1
        assert "memory" in one_error_line(proc.stderr)


def _can_drop_ipc_lock() -> bool:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return (
        os.geteuid() == 0
        and shutil.which("setpriv") is not None
        and soft != resource.RLIM_INFINITY
        and 0 < soft < 256 * MiB
    )


DROP_IPC_LOCK = ("setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock")


@pytest.mark.skipif(
    not _can_drop_ipc_lock(), reason="needs root, setpriv and a small finite RLIMIT_MEMLOCK"
)
class TestMemlockLimit:
    """Without CAP_IPC_LOCK the default buffer fits RLIMIT_MEMLOCK and says so."""

    def test_default_size_is_capped(self) -> None:
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        proc = demo("--backend", "host", "--json", prefix=DROP_IPC_LOCK)
        assert proc.returncode == 0, proc.stderr
        assert "RLIMIT_MEMLOCK" in proc.stderr and "ulimit -l" in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
        at_pinned = json.loads(proc.stdout)["at_pinned"]
        assert 0 < at_pinned["nbytes"] <= soft
        assert at_pinned["pinned_bytes"] == at_pinned["nbytes"]

    def test_explicit_size_over_limit(self) -> None:
        proc = demo("--backend", "host", "--size", "256MiB", prefix=DROP_IPC_LOCK)
        assert proc.returncode == 1
        assert "memlock" in one_error_line(proc.stderr)


class TestInterrupt:
    """SIGINT while pinning closes the manager and exits 130 with one line on stderr."""

    def test_sigint_mid_pinning(self) -> None:
        # One slow prefault thread and small chunks keep a 2 GiB pin going for a while;
        # the signal is sent once the demo says it has entered (no sleeps).
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "asyncpin", "demo", "--backend", "host",
                "--size", "2GiB", "--chunk-mib", "16", "--prefault-threads", "1",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
            cwd=REPO,
        )  # fmt: skip
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith("entered"):
                    break
            proc.send_signal(signal.SIGINT)
            _out, err = proc.communicate(timeout=TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if proc.returncode == 0:
            pytest.skip("pinning finished before the signal arrived")
        assert proc.returncode == 130, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in err, err
        assert "interrupted by SIGINT" in lines[0]
        assert "manager closed" in lines[0]
        assert "0 B still pinned" in lines[0]


# `python -m asyncpin ...` in a process where rich cannot be imported, as after
# `pip install -e .` without extras.
WITHOUT_RICH = """
import runpy, sys
sys.modules["rich"] = None  # any `import rich...` raises ImportError
sys.argv = ["asyncpin", *sys.argv[1:]]
runpy.run_module("asyncpin", run_name="__main__", alter_sys=True)
"""


def without_rich(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_RICH, *args],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=REPO,
        timeout=TIMEOUT_S,
    )


class TestWithoutRich:
    """The demo and the doctor print plain text when rich is not installed."""

    def test_demo(self) -> None:
        proc = without_rich("demo", "--size", "16MiB", "--backend", "host", "--chunk-mib", "4")
        assert proc.returncode == 0, proc.stderr
        assert "Traceback" not in proc.stderr
        lines = proc.stdout.splitlines()
        assert lines[0].startswith("asyncpin demo: backend host, 16.00 MiB anonymous"), lines
        assert lines[1].startswith("entered in "), lines
        # Faulting in comes first, whole, then pinning.
        faulted = lines.index("faulting in: 100% (16.00 MiB of 16.00 MiB)")
        assert lines.index("pinning: 100% (16.00 MiB of 16.00 MiB)") > faulted, lines
        table = lines[lines.index("asyncpin demo") :]
        assert table[1].split() == ["figure", "value"], table
        rows = {line[:28].strip(): line[28:].strip() for line in table[3:]}
        assert rows["buffer"] == "16.00 MiB in 4 chunks", rows
        assert rows["state / leaked chunks"] == "closed / 0", rows
        for figure in ("time to enter", "time to pinned", "pinning speed", "close time"):
            assert figure in rows

    def test_doctor(self) -> None:
        proc = without_rich("doctor", "--size", "16MiB", "--backend", "host")
        assert proc.returncode in (0, 1), proc.stderr
        assert "Traceback" not in proc.stderr
        lines = proc.stdout.splitlines()
        assert lines[0] == "asyncpin doctor"
        assert lines[1].split()[:2] == ["check", "status"], lines
        names = {line.split()[0] for line in lines[3:]}
        assert {"memory", "memlock", "shm", "cuda"} <= names, lines

    def test_rich_is_an_extra(self) -> None:
        import tomllib

        project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
        assert not any(dep.startswith("rich") for dep in project["dependencies"])


class TestParseSize:
    """--size takes bytes or a number with a binary (KiB...) or decimal (KB...) unit."""

    @pytest.mark.parametrize(
        ("text", "nbytes"),
        [
            ("4096", 4096),
            ("512MiB", 512 * MiB),
            ("2GiB", 2 * GiB),
            ("2gib", 2 * GiB),
            ("1.5GiB", 3 * GiB // 2),
            ("64m", 64 * MiB),
            ("1 GB", 10**9),
            ("10B", 10),
        ],
    )
    def test_accepts(self, text: str, nbytes: int) -> None:
        assert parse_size(text) == nbytes

    @pytest.mark.parametrize("text", ["", "GiB", "12XB", "-1", "0", "0MiB", "1.5", "1e9"])
    def test_rejects(self, text: str) -> None:
        with pytest.raises(ValueError, match="invalid size"):
            parse_size(text)


class TestDefaultSize:
    """The default buffer is min(4 GiB, MemAvailable/4), within the memlock allowance."""

    def test_quarter_of_available(self) -> None:
        nbytes, note = default_nbytes(
            backend="host",
            mem_available=8 * GiB + 123,
            memlock_limit=None,
            locked_bytes=0,
            has_cap_ipc_lock=False,
        )
        assert (nbytes, note) == (2 * GiB, None)

    def test_at_most_4_gib(self) -> None:
        nbytes, _ = default_nbytes(
            backend="cuda",
            mem_available=1 << 40,
            memlock_limit=8 * MiB,
            locked_bytes=0,
            has_cap_ipc_lock=False,
        )
        assert nbytes == 4 * GiB

    def test_capped_by_memlock(self) -> None:
        nbytes, note = default_nbytes(
            backend="host",
            mem_available=24 * GiB,
            memlock_limit=8 * MiB + 100,
            locked_bytes=4096 + 50,
            has_cap_ipc_lock=False,
            page_size=4096,
        )
        assert nbytes == 8 * MiB - 4096
        assert note is not None and "RLIMIT_MEMLOCK" in note and "ulimit -l" in note

    def test_capability_lifts_the_cap(self) -> None:
        nbytes, note = default_nbytes(
            backend="host",
            mem_available=24 * GiB,
            memlock_limit=8 * MiB,
            locked_bytes=0,
            has_cap_ipc_lock=True,
        )
        assert (nbytes, note) == (4 * GiB, None)

    def test_limit_used_up(self) -> None:
        nbytes, note = default_nbytes(
            backend="host",
            mem_available=24 * GiB,
            memlock_limit=8 * MiB,
            locked_bytes=9 * MiB,
            has_cap_ipc_lock=False,
        )
        assert nbytes == 0 and note is not None
