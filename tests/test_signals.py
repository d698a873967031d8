"""Signals while the demo and the example server shut down.

The first of SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1 or SIGUSR2 starts the close; any
signal after it is noted and cannot interrupt the close, so a shared region is always
unpinned, unmapped and unlinked. The demo exits 128 + the first signal's number, the server
0 after a clean shut-down.

Children run `python -m asyncpin demo` or `python -m examples.server` through a hook that
holds the pin call of chunk ``HOLD_AT`` at the pause gate until close stops the pipeline
(it prints "HELD"), so the first signal always lands mid-pinning. In ``hold-close`` mode the
call then prints "CLOSING" and waits for a line on stdin: close waits for that call, so a
signal sent then lands during the close, and the child acknowledges it before the test
lets the close go on. Synchronisation is on lines read with a bound on every wait; nothing
sleeps.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import pytest

from asyncpin.shm import SHM_DIR

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 60.0

SHUTDOWN_SIGNALS = [
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
]


def signal_id(signum: signal.Signals) -> str:
    return signum.name.removeprefix("SIG")


def pairs(*pairs: tuple[signal.Signals, signal.Signals]) -> list[object]:
    """(first, second) pytest parameters, with ids such as ``INT-TERM``."""
    return [pytest.param(a, b, id=f"{signal_id(a)}-{signal_id(b)}") for a, b in pairs]


SAME_TWICE = [(signum, signum) for signum in SHUTDOWN_SIGNALS]
INT_TERM = (signal.SIGINT, signal.SIGTERM)
TERM_INT = (signal.SIGTERM, signal.SIGINT)


HOOK = """
import resource, runpy, sys, threading
import asyncpin.gate as gate

resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGQUIT's default action dumps core
HOLD_AT = 2
mode, module, *rest = sys.argv[1:]
real_enter_call = gate.PauseGate.enter_call
lock = threading.Lock()
count = [0]

def enter_call(self, abort=None):
    if abort is not None:  # a pin call (unpins pass no abort flag)
        with lock:
            n = count[0]
            count[0] += 1
        if n == HOLD_AT:
            print("HELD", file=sys.stderr, flush=True)
            abort.wait()
            if mode == "hold-close":
                print("CLOSING", file=sys.stderr, flush=True)
                sys.stdin.readline()
            return False
    return real_enter_call(self, abort)

gate.PauseGate.enter_call = enter_call
sys.argv = [module, *rest]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


class Lines:
    """The lines a child writes to one pipe, read by a thread, each wait bounded."""

    def __init__(self, pipe: IO[str]) -> None:
        self._queue: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self.closed = False
        self._thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self._thread.start()

    def _read(self, pipe: IO[str]) -> None:
        for line in pipe:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, *needles: str, timeout_s: float = TIMEOUT_S) -> bool:
        """Wait until a line containing each needle has been seen (in any order, counting
        lines seen before); False if the child closed the pipe first."""
        while not all(any(n in line for line in self.seen) for n in needles):
            if self.closed:
                return False
            try:
                line = self._queue.get(timeout=timeout_s)
            except queue.Empty:
                raise AssertionError(
                    f"no line with {needles} within {timeout_s} s: {self.seen}"
                ) from None
            if line is None:
                self.closed = True
            else:
                self.seen.append(line)
        return True

    def rest(self) -> list[str]:
        """Every line, once the child has closed the pipe."""
        self.wait_for("\0never\0")
        return self.seen


@contextmanager
def hooked(mode: str, *args: str, env: dict[str, str] | None = None) -> Iterator[Child]:
    """A child running ``python -m <args>`` through HOOK; killed and reaped however the block
    ends."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-c", HOOK, mode, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {}), "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"},
        cwd=REPO,
    )
    try:
        yield Child(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(TIMEOUT_S)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                with contextlib.suppress(BrokenPipeError):  # "go" unsent to a dead child
                    pipe.close()


class Child:
    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None and proc.stderr is not None
        self.proc = proc
        self.out = Lines(proc.stdout)
        self.err = Lines(proc.stderr)

    def send(self, signum: signal.Signals) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)

    def release(self) -> None:
        """Let a close held in ``hold-close`` mode go on (the child may be gone already)."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write("go\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass

    def wait(self) -> int:
        return self.proc.wait(TIMEOUT_S)


# -- the demo -----------------------------------------------------------------------------


def demo_args(name: str) -> list[str]:
    return [
        "asyncpin", "demo", "--backend", "host", "--size", "64MiB", "--chunk-mib", "4",
        "--backing", "shared", "--name", name,
    ]  # fmt: skip


def assert_demo_interrupted(lines: list[str], first: signal.Signals) -> None:
    assert not any("Traceback" in line for line in lines), lines
    last = lines[-1]
    assert last.startswith(f"asyncpin demo: interrupted by {first.name}; manager closed"), lines
    assert last.endswith("with 0 B still pinned"), lines


class TestDemoSecondSignal:
    """A later signal is noted while the demo closes; the close finishes, the shared file is
    unlinked, and the exit code is the first signal's."""

    @pytest.mark.parametrize(("first", "second"), pairs(*SAME_TWICE, INT_TERM, TERM_INT))
    def test_during_close(
        self, first: signal.Signals, second: signal.Signals, shm_name: str
    ) -> None:
        path = SHM_DIR / shm_name
        try:
            with hooked("hold-close", *demo_args(shm_name)) as child:
                assert child.err.wait_for("HELD")
                assert path.exists()
                child.send(first)
                closing = child.err.wait_for("CLOSING")
                child.send(second)
                acked = closing and child.err.wait_for(
                    f"asyncpin demo: {second.name} received while closing"
                )
                child.release()
                code = child.wait()
                lines = child.err.rest()
            assert code == 128 + first, lines
            assert not path.exists(), "the demo left its shared region behind"
            assert closing and acked, lines
            assert_demo_interrupted(lines, first)
        finally:
            path.unlink(missing_ok=True)

    @pytest.mark.parametrize("signum", SHUTDOWN_SIGNALS, ids=signal_id)
    def test_back_to_back(self, signum: signal.Signals, shm_name: str) -> None:
        path = SHM_DIR / shm_name
        try:
            with hooked("hold-pin", *demo_args(shm_name)) as child:
                assert child.err.wait_for("HELD")
                child.send(signum)
                child.send(signum)
                code = child.wait()
                lines = child.err.rest()
            assert code == 128 + signum, lines
            assert not path.exists(), "the demo left its shared region behind"
            assert_demo_interrupted(lines, signum)
        finally:
            path.unlink(missing_ok=True)


# -- the example server -------------------------------------------------------------------

SERVER_ARGS = ("examples.server", "--port", "0")
STARTED = "Application startup complete"


def server_env(name: str) -> dict[str, str]:
    return {
        "ASYNCPIN_NBYTES": "64MiB",
        "ASYNCPIN_BACKEND": "host",
        "ASYNCPIN_SHARED_NAME": name,
        "ASYNCPIN_CHUNK_BYTES": "4MiB",
    }


def assert_server_closed(code: int, path: Path, out: list[str], err: list[str]) -> None:
    text = "\n".join(out + err)
    assert code == 0, text
    assert not path.exists(), f"the server left its shared region behind:\n{text}"
    assert any("manager.closed" in line for line in out), text
    assert "Application shutdown complete" in text, text
    assert "Traceback" not in text, text


class TestServerSecondSignal:
    """The same for `python -m examples.server`: a later signal never skips or interrupts
    the lifespan's close; the server exits 0 once it has closed."""

    @pytest.mark.parametrize(("first", "second"), pairs(*SAME_TWICE, INT_TERM))
    def test_during_close(
        self, first: signal.Signals, second: signal.Signals, shm_name: str
    ) -> None:
        path = SHM_DIR / shm_name
        try:
            with hooked("hold-close", *SERVER_ARGS, env=server_env(shm_name)) as child:
                assert child.err.wait_for("HELD", STARTED)
                assert path.exists()
                child.send(first)
                closing = child.err.wait_for("CLOSING")
                child.send(second)
                acked = closing and child.err.wait_for(
                    f"{second.name} received while shutting down"
                )
                child.release()
                code = child.wait()
                out, err = child.out.rest(), child.err.rest()
            assert_server_closed(code, path, out, err)
            assert closing and acked, err
        finally:
            path.unlink(missing_ok=True)

    @pytest.mark.parametrize(("first", "second"), pairs(SAME_TWICE[0], TERM_INT))
    def test_before_close(
        self, first: signal.Signals, second: signal.Signals, shm_name: str
    ) -> None:
        # The second signal arrives once uvicorn has begun its shut-down, before the
        # lifespan's: uvicorn stops waiting for connections, the close still runs.
        path = SHM_DIR / shm_name
        try:
            with hooked("hold-pin", *SERVER_ARGS, env=server_env(shm_name)) as child:
                assert child.err.wait_for("HELD", STARTED)
                child.send(first)
                assert child.err.wait_for("Shutting down")
                child.send(second)
                code = child.wait()
                out, err = child.out.rest(), child.err.rest()
            assert_server_closed(code, path, out, err)
        finally:
            path.unlink(missing_ok=True)

    @pytest.mark.parametrize("signum", SHUTDOWN_SIGNALS, ids=signal_id)
    def test_back_to_back(self, signum: signal.Signals, shm_name: str) -> None:
        path = SHM_DIR / shm_name
        try:
            with hooked("hold-pin", *SERVER_ARGS, env=server_env(shm_name)) as child:
                assert child.err.wait_for("HELD", STARTED)
                child.send(signum)
                child.send(signum)
                code = child.wait()
                out, err = child.out.rest(), child.err.rest()
            assert_server_closed(code, path, out, err)
        finally:
            path.unlink(missing_ok=True)


STARTING = """
import os, runpy, signal, sys

SIGNUM = signal.Signals[sys.argv[1]]

class Trip:
    \"\"\"Sends the signal to this process when the server module first imports uvicorn.\"\"\"

    def find_spec(self, name, path=None, target=None):
        if name == "uvicorn":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), SIGNUM)
        return None

sys.meta_path.insert(0, Trip())
sys.argv = ["examples.server", "--port", "0"]
runpy.run_module("examples.server", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("signum", SHUTDOWN_SIGNALS, ids=signal_id)
def test_a_signal_while_the_server_starts_up_exits_0(signum: signal.Signals) -> None:
    """A signal while the server's module is still importing (a newcomer's trial: SIGUSR1
    three seconds after start, during torch's import, ended the process by its default
    action, exit 138): noted from the module's first line, and the server exits 0 with
    nothing started."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    done = subprocess.run(
        [sys.executable, "-c", STARTING, signum.name],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={**os.environ, "PYTHONPATH": path},
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    assert f"{signum.name} during start-up: exiting, nothing started" in done.stderr
    assert "Uvicorn running" not in done.stderr and "Traceback" not in done.stderr
