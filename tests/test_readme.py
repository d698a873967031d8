"""The README's examples run as written.

Every ```python block runs in a subprocess of its own (cwd: the repository root), except
those marked ``<!-- not run: <why> -->`` on the line before, which are listed as skipped
with the reason. A block marked ``<!-- runs with the next block ... -->`` is the first of
two processes: it runs until it asks for Enter on stdin, the next block runs to the end,
then the first gets its Enter and must end too. The shared region's name in those blocks
is replaced with a name unique to this run.

Every command of a ```sh block runs through bash, with this interpreter first on PATH,
except the ``pip install`` steps (this environment is that installation), the tests
themselves (`pytest`), and the example server, which serves until it is stopped (its
tests, tests/test_server.py and tests/test_signals.py, run it).

Where the process holds CAP_IPC_LOCK and `setpriv` can drop it, the Python examples and
the Quick start's demo run without it, as an ordinary user would run them: `mlock`, the
only pinning without a GPU, is then bound by RLIMIT_MEMLOCK (8 MiB by default).
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from asyncpin import _sys
from asyncpin.shm import SHM_DIR

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
TIMEOUT_S = 120
MiB = 1 << 20
SHARED_NAME = '"kv-tier"'  # the shared region's name in the README's two-process example
REDIS_URL = "ASYNCPIN_REDIS_URL"  # the remote tier's example reads its server from it

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)
_MARK = re.compile(r"<!--\s*(not run|runs with the next block)\s*:?\s*(.*?)\s*-->\s*\Z", re.S)


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int  # of the opening fence, 1-based
    section: str
    index: int  # among the section's blocks, from 1
    mark: str | None  # "not run" or "runs with the next block"
    why: str

    @property
    def id(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.section.lower()).strip("-")
        return f"{slug}-{self.index}"


def blocks(text: str) -> list[Block]:
    found: list[Block] = []
    for match in _FENCE.finditer(text):
        before = text[: match.start()]
        headings = re.findall(r"^#+ (.+)$", before, re.M)
        section = headings[-1] if headings else ""
        mark = _MARK.search(before.rstrip("\n").rsplit("\n\n", 1)[-1])
        found.append(
            Block(
                lang=match.group(1),
                code=match.group(2),
                line=before.count("\n") + 1,
                section=section,
                index=1 + sum(b.section == section for b in found),
                mark=mark.group(1) if mark else None,
                why=mark.group(2) if mark else "",
            )
        )
    return found


BLOCKS = blocks(README.read_text())
PYTHON = [b for b in BLOCKS if b.lang == "python"]


def _python_cases() -> list[object]:
    cases: list[object] = []
    for n, block in enumerate(PYTHON):
        if n and PYTHON[n - 1].mark == "runs with the next block":
            continue  # runs as the second process of the block before
        pair = block.mark == "runs with the next block"
        marks = (
            [pytest.mark.skip(reason=f"not run: {block.why}")] if block.mark == "not run" else []
        )
        second = PYTHON[n + 1] if pair else None
        cases.append(pytest.param(block, second, id=block.id, marks=marks))
    return cases


def _command_cases() -> list[object]:
    cases: list[object] = []
    for block in (b for b in BLOCKS if b.lang == "sh"):
        for offset, line in enumerate(block.code.splitlines()):
            for part in (p.strip() for p in line.split("&&")):
                case_id = f"{block.id}+{offset}: {part.split('#')[0].strip()}"
                reason = _not_run(part)
                marks = [pytest.mark.skip(reason=reason)] if reason else []
                cases.append(pytest.param(part, block, id=case_id, marks=marks))
    return cases


def _not_run(command: str) -> str | None:
    if command.startswith("pip install"):
        return "installs: this environment is that installation"
    if "pytest" in command:
        return "runs the tests: this run is that"
    if "examples.server" in command:
        return "serves until stopped: tests/test_server.py and tests/test_signals.py run it"
    return None


def _can_drop_ipc_lock() -> bool:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return (
        os.geteuid() == 0
        and _sys.has_cap_ipc_lock()
        and shutil.which("setpriv") is not None
        and soft != resource.RLIM_INFINITY
        and soft >= 8 * MiB
    )


# As an ordinary user: without CAP_IPC_LOCK, so RLIMIT_MEMLOCK binds `mlock`.
AS_USER: tuple[str, ...] = (
    ("setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock") if _can_drop_ipc_lock() else ()
)


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    bindir = str(Path(sys.executable).parent)
    return {
        **os.environ,
        "PYTHONPATH": path,
        "PYTHONUNBUFFERED": "1",
        "PATH": os.pathsep.join([bindir, os.environ.get("PATH", "")]),
    }


def _python(
    code: str, stdin: int | None = None, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*AS_USER, sys.executable, "-c", code],
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**_env(), **(env or {})},
        cwd=REPO,
    )


def _finish(proc: subprocess.Popen[str], what: str) -> str:
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, f"{what} exited {proc.returncode}:\n{out}\n{err}"
    assert "Traceback" not in err, err
    return out


class TestQuickStart:
    def test_two_commands_first(self) -> None:
        first = BLOCKS[0]
        assert first.section == "Quick start" and first.lang == "sh", first
        commands = first.code.splitlines()
        assert len(commands) == 2, commands
        assert commands[0].endswith("&& python -m asyncpin demo"), commands[0]
        # A pinned torch is a CPU build only where a local wheel shadows the index.
        assert "torch" not in commands[0], commands[0]
        assert commands[1] == "python -m pytest", commands[1]


class TestPythonBlocks:
    @pytest.mark.parametrize(("block", "second"), _python_cases())
    def test_runs(
        self, block: Block, second: Block | None, shm_name: str, request: pytest.FixtureRequest
    ) -> None:
        if second is None:
            env = None
            if REDIS_URL in block.code:  # the remote tier's example: the test server
                env = {REDIS_URL: request.getfixturevalue("redis_server").url}
            _finish(_python(block.code, env=env), f"the block at README.md:{block.line}")
            return
        # Two processes: the first waits for Enter on stdin while the second runs.
        assert SHARED_NAME in block.code and SHARED_NAME in second.code
        first_code, second_code = (
            b.code.replace(SHARED_NAME, repr(shm_name)) for b in (block, second)
        )
        path = SHM_DIR / shm_name
        try:
            first = _python(first_code, stdin=subprocess.PIPE)
            try:
                assert first.stdout is not None and first.stdin is not None
                for line in first.stdout:
                    if "press Enter" in line:
                        break
                else:
                    raise AssertionError(f"README.md:{block.line} never asked for Enter")
                assert path.exists()
                out = _finish(_python(second_code), f"the block at README.md:{second.line}")
                assert "loaded" in out, out
                first.stdin.write("\n")
                first.stdin.flush()
            finally:
                _finish(first, f"the block at README.md:{block.line}")
            assert not path.exists(), "the creator left its shared region behind"
        finally:
            path.unlink(missing_ok=True)


class TestShellCommands:
    @pytest.mark.parametrize(("command", "block"), _command_cases())
    def test_runs(self, command: str, block: Block) -> None:
        before = set(SHM_DIR.glob("asyncpin-demo-*"))
        # The bare demo sizes its buffer to the machine (up to 4 GiB): as an ordinary user
        # the memlock limit caps it, as it would for most who paste it.
        prefix = AS_USER if command == "python -m asyncpin demo" else ()
        proc = subprocess.run(
            [*prefix, "bash", "-c", command],
            capture_output=True,
            text=True,
            env=_env(),
            cwd=REPO,
            timeout=TIMEOUT_S,
        )
        # The doctor exits 1 when a check fails for this machine (e.g. a 64 GiB plan).
        allowed = (0, 1) if "asyncpin doctor" in command else (0,)
        assert proc.returncode in allowed, f"{command}: {proc.returncode}\n{proc.stderr}"
        assert "Traceback" not in proc.stderr, proc.stderr
        assert proc.stdout.strip(), f"{command} printed nothing"
        assert set(SHM_DIR.glob("asyncpin-demo-*")) <= before, "a demo left its region"
