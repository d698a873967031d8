"""The maintained bench scripts, run in their quick mode on a machine with no GPU.

Each script in ``bench/`` (not the helpers, not ``bench/probes/``) runs with ``--quick`` on
CPU and writes its JSON; a script that needs a CUDA GPU for its full run says so in one
line and exits non-zero (no traceback). Subprocesses run with ``CUDA_VISIBLE_DEVICES``
empty, so the checks hold on a GPU machine too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
TIMEOUT_S = 300.0

SCRIPTS = [
    "capture",
    "hit_rates",
    "layerwise",
    "llama_ttft",
    "pinning",
    "remote",
    "soak",
    "startup",
    "tier_index",
    "transfers",
]
NEED_A_GPU = ["capture", "llama_ttft", "soak"]  # without --quick


def run(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, str(BENCH / f"{script}.py"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


def test_every_script_is_listed() -> None:
    scripts = {p.stem for p in BENCH.glob("*.py") if not p.stem.startswith("_")}
    assert scripts == set(SCRIPTS), "list the new script here"


@pytest.mark.parametrize("script", SCRIPTS)
def test_quick_mode_runs_without_a_gpu(script: str, tmp_path: Path) -> None:
    out = tmp_path / f"{script}.json"
    done = run(script, "--quick", "--json-out", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc, script


def test_quick_figures_have_the_keys_the_gpu_pass_reads(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    assert run("transfers", "--quick", "--json-out", str(out), cwd=tmp_path).returncode == 0
    doc = json.loads(out.read_text())
    row = next(iter(doc["transfers"]["sizes"].values()))
    for key in ("store", "load", "both"):
        assert row[f"{key}_gbps"] > 0 and row[f"contiguous_{key}_gbps"] > 0
    for key in ("store", "load"):  # several transfers queued at once
        assert row[f"{key}_in_flight_gbps"] > 0 and row["in_flight"] == 2
    assert doc["await"]["p50_us"] <= doc["await"]["p99_us"]
    assert doc["machine"]["asyncpin_path"] == str(ROOT / "asyncpin")


@pytest.mark.parametrize("script", NEED_A_GPU)
def test_full_run_without_a_gpu_says_so(script: str, tmp_path: Path) -> None:
    done = run(script, cwd=tmp_path)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.startswith(f"{script}.py needs a CUDA GPU: "), done.stderr[-2000:]
    assert done.stderr.count("\n") == 1, done.stderr[-2000:]


def test_a_bad_size_is_a_usage_error(tmp_path: Path) -> None:
    done = run("pinning", "--size", "16XB", cwd=tmp_path)
    assert done.returncode == 2
    assert "invalid size '16XB'" in done.stderr


def test_the_gpu_pass_parses() -> None:
    for script in ("gpu_pass.sh", "transfers_ab.sh"):
        subprocess.run(["bash", "-n", str(BENCH / script)], check=True, timeout=30)


@pytest.mark.parametrize("stacks", ["kernel", "none"])
def test_startup_samples_what_it_is_asked_to(stacks: str, tmp_path: Path) -> None:
    # --stacks kernel: a sampler in a process of its own (where the kernel stacks can be
    # read: root), the worst lags' kernel stacks in the figures, nothing left behind.
    out = tmp_path / "s.json"
    done = run(
        "startup",
        "--quick",
        "--stacks",
        stacks,
        "--gc-freeze",
        "--trace-calls",
        "--json-out",
        str(out),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["gc_frozen_objects"] > 0
    readable = Path(f"/proc/{os.getpid()}/task/{threading.get_native_id()}/stack")
    can_read = os.access(readable, os.R_OK) and bool(readable.read_text())
    assert doc["stacks"] == (
        "kernel" if stacks == "kernel" and can_read else "python" if stacks == "kernel" else "none"
    )
    runs = next(iter(doc["sizes"].values()))["runs"]
    (run_doc,) = [r for r in runs if r["recipe"] == "asyncpin"]
    # --trace-calls: each pin call and prefault piece, (start, seconds), in the run.
    assert len(run_doc["pin_spans"]) == run_doc["chunks"]
    assert len(run_doc["prefault_spans"]) == run_doc["chunks"]
    assert all(start >= 0 and took >= 0 for start, took in run_doc["pin_spans"])
    for phase in ("entering", "pinning", "serving", "closing"):
        assert isinstance(run_doc[f"lag_{phase}_gc"], list)
        assert isinstance(run_doc[f"lag_{phase}_capture"], list)  # no GPU: no captures
        if doc["stacks"] == "kernel":
            kernel = run_doc[f"lag_{phase}_kernel"]
            assert set(kernel) == {"loop", "blocked", "others"}
        else:
            assert f"lag_{phase}_kernel" not in run_doc
    if doc["stacks"] == "kernel":  # the sampler swept the threads while the run went on
        assert run_doc["kernel_sweeps"] > 0
    assert not list(tmp_path.glob("kstacks-*"))


@pytest.mark.redis
@pytest.mark.parametrize("kind", ["node", "cluster"])
def test_llama_ttft_on_servers_of_its_own(kind: str, tmp_path: Path) -> None:
    """``--own-servers``: the remote way runs against a server (or a cluster of
    ``--cluster-nodes``) started for the run, every prefix block restored bit for bit,
    and the servers are gone after."""
    import tempfile

    from tests import redis_servers

    if (reason := redis_servers.available()) is not None:
        pytest.skip(reason)
    out = tmp_path / "t.json"
    more = ["--cluster-nodes", "4"] if kind == "cluster" else []
    done = run(
        "llama_ttft", "--quick", "--own-servers", kind, *more, "--json-out", str(out), cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["own_servers"].endswith("cluster of 4" if more else "node"), doc["own_servers"]
    for row in doc["sizes"].values():
        assert row["ttft_ms"]["remote"] > 0 and row["kv_bit_identical"]
    assert not list(Path(tempfile.gettempdir()).glob("asyncpin-redis-ttft-*"))
