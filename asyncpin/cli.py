"""Command line: ``python -m asyncpin demo`` maps a buffer, pins it in the background while
showing progress, reports how long entry and pinning took, and closes.
``python -m asyncpin doctor`` runs the pre-flight checks (asyncpin.doctor): exit 1 if one
fails, else 0.

This module is an application of the library, so it is the one place that configures
structlog (warnings and above to stderr; ``--verbose`` for info). Exit codes: 0 on
success; 1 with one line ``asyncpin demo: error: <message>`` on stderr for an asyncpin or
OS error; 2 for bad arguments (one line too); 128 + the signal's number after a signal
of :data:`SHUTDOWN_SIGNALS` (130 after SIGINT, 143 after SIGTERM, 129 after SIGHUP), once
the manager has closed.

Signals: from the moment the demo starts until it exits, the first shutdown signal starts
the close, and any later one is reported on stderr and changes nothing: the close always
runs to the end (unpin, unmap, unlink a shared file), and the exit code is the first
signal's.

Output: with rich installed (the ``demo`` extra), a progress bar and tables; without it,
the demo and the doctor print the same figures as plain text.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from types import FrameType
from typing import Any, NoReturn, TextIO

import anyio
import anyio.lowlevel
import structlog
from anyio import CancelScope

from asyncpin import _sys
from asyncpin._config import DEFAULT_CHUNK_BYTES, default_prefault_threads
from asyncpin._tasks import current_loop
from asyncpin.backends import BACKEND_NAMES, PinBackend, resolve_backend
from asyncpin.errors import AsyncpinError
from asyncpin.manager import ManagerStats, OffloadManager

__all__ = [
    "DEFAULT_MAX_BYTES",
    "SHUTDOWN_SIGNALS",
    "SignalGuard",
    "default_nbytes",
    "format_bytes",
    "main",
    "parse_size",
]

PROG = "asyncpin"
DEFAULT_MAX_BYTES = 4 << 30
_GIB = 1 << 30
_REFRESH_S = 0.1
_EXIT_ERROR = 1
_EXIT_USAGE = 2
_EXIT_SIGINT = 128 + signal.SIGINT

#: Signals that end the demo (and ``examples/server.py``) through its close: those whose
#: default action ends the process and that a terminal (Ctrl-C, Ctrl-\, hang-up), a shell
#: (``kill``) or a supervisor commonly sends.
SHUTDOWN_SIGNALS: tuple[signal.Signals, ...] = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


# -- sizes --------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """Bytes from ``'536870912'``, ``'512MiB'``, ``'2GiB'``, ``'1.5g'`` or ``'4GB'``.

    K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024; KB/MB/GB/TB powers of 1000. Raises
    ValueError (with a message that says what is accepted) for anything else, for zero,
    and for fractions that are not whole bytes.
    """
    match = _SIZE_RE.match(text)
    unit: str = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"invalid size {text!r}: give bytes or a number with a unit "
            "(KiB, MiB, GiB, TiB; KB, MB, GB, TB), e.g. 512MiB or 2GiB"
        )
    number: str = match.group(1)
    whole, _, frac = number.partition(".")
    scale: int = 10 ** len(frac)
    numerator = (int(whole) * scale + int(frac or "0")) * _UNITS[unit]
    if numerator % scale:
        raise ValueError(f"invalid size {text!r}: not a whole number of bytes")
    nbytes = numerator // scale
    if nbytes <= 0:
        raise ValueError(f"invalid size {text!r}: must be more than 0 bytes")
    return nbytes


def format_bytes(nbytes: int | float) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def default_nbytes(
    *,
    backend: str,
    mem_available: int,
    memlock_limit: int | None,
    locked_bytes: int,
    has_cap_ipc_lock: bool,
    page_size: int = _sys.PAGE_SIZE,
) -> tuple[int, str | None]:
    """The demo's buffer size when ``--size`` is not given, and a note if it was capped.

    ``min(4 GiB, MemAvailable / 4)``; for the host backend without CAP_IPC_LOCK under a
    finite RLIMIT_MEMLOCK, no more than what is left of that limit. Rounded down to a
    page multiple; 0 means nothing can be pinned (the caller reports it).
    """
    nbytes = min(DEFAULT_MAX_BYTES, mem_available // 4)
    note = None
    if backend == "host" and not has_cap_ipc_lock and memlock_limit is not None:
        allowance = max(memlock_limit - locked_bytes, 0)
        if allowance < nbytes:
            nbytes = allowance
            note = (
                f"note: buffer capped at {format_bytes(nbytes // page_size * page_size)}, what "
                f"is left of RLIMIT_MEMLOCK ({format_bytes(memlock_limit)}); raise it with "
                "`ulimit -l unlimited` (docker: --ulimit memlock=-1; systemd: "
                "LimitMEMLOCK=infinity) or grant CAP_IPC_LOCK"
            )
    return nbytes // page_size * page_size, note


# -- arguments ----------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line (``<prog>: error: <why>``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(_EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="asyncpin: a pinned host-memory tier for KV caches")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="map a buffer, pin it in the background with progress, report, close",
        description=(
            "Map a host buffer, pin it in the background while showing progress, then "
            "report time to enter vs time to pinned, GiB/s, huge pages and close time."
        ),
    )
    demo.add_argument(
        "--size",
        type=_size_arg,
        default=None,
        help="buffer size: bytes or e.g. 512MiB, 2GiB (default: min(4 GiB, MemAvailable/4), "
        "and within RLIMIT_MEMLOCK for the host backend without CAP_IPC_LOCK)",
    )
    demo.add_argument("--backend", choices=BACKEND_NAMES, default="auto")
    demo.add_argument(
        "--chunk-mib",
        type=_positive_int,
        default=DEFAULT_CHUNK_BYTES >> 20,
        help="chunk size in MiB (default: %(default)s)",
    )
    demo.add_argument("--backing", choices=("anonymous", "shared"), default="anonymous")
    demo.add_argument(
        "--name", default=None, help="name in /dev/shm for --backing shared (default: a fresh one)"
    )
    demo.add_argument(
        "--prefault-threads",
        type=_positive_int,
        default=default_prefault_threads(),
        help="threads that fault pages in (default: %(default)s: up to 8, leaving a core to "
        "the event loop)",
    )
    demo.add_argument(
        "--pin-threads", type=_positive_int, default=1, help="threads that pin (default: 1)"
    )
    demo.add_argument(
        "--json", action="store_true", help="print the final stats as JSON instead of a table"
    )
    demo.add_argument("--verbose", "-v", action="store_true", help="log at info level")
    doctor = commands.add_parser(
        "doctor",
        help="check this machine for what asyncpin needs, and say what to change",
        description=(
            "Pre-flight checks: memory and cgroup limit, RLIMIT_MEMLOCK and CAP_IPC_LOCK, "
            "huge pages, /dev/shm, CUDA driver/runtime/GPUs, batched copies. Exits 1 if a "
            "check fails."
        ),
    )
    doctor.add_argument(
        "--size",
        type=_size_arg,
        default=None,
        help="buffer size to check for (default: the demo's, min(4 GiB, MemAvailable/4), "
        "capped by what is left of RLIMIT_MEMLOCK when mlock pins it without CAP_IPC_LOCK)",
    )
    doctor.add_argument("--backend", choices=BACKEND_NAMES, default="auto")
    doctor.add_argument("--backing", choices=("anonymous", "shared"), default="anonymous")
    doctor.add_argument("--json", action="store_true", help="print the checks as JSON")
    return parser


def _run_doctor(args: argparse.Namespace) -> int:
    from asyncpin import doctor

    checks = doctor.run_checks(args.size, backend=args.backend, backing=args.backing)
    print(doctor.render(checks, as_json=args.json))
    return _EXIT_ERROR if doctor.worst(checks) == "fail" else 0


# -- logging ------------------------------------------------------------------------------


def configure_logging(*, verbose: bool, stream: TextIO) -> None:
    """The application's logging setup: the library itself never configures structlog."""
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False),
            structlog.dev.ConsoleRenderer(colors=stream.isatty()),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.INFO if verbose else logging.WARNING
        ),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )


# -- the demo -----------------------------------------------------------------------------


@dataclass(slots=True)
class _Outcome:
    """What the demo saw; filled in as it goes so an interrupted run can still report."""

    manager: OffloadManager | None = None
    at_pinned: ManagerStats | None = None


class SignalGuard:
    """While entered, no signal of ``signals`` gets its default action (ending the process,
    or KeyboardInterrupt for SIGINT): each is noted in :attr:`received`, in order, and wakes
    :meth:`wait`.

    The handlers are Python-level (``signal.signal``), installed before an event loop starts
    and removed after it has gone, so no signal in between finds a default handler (an
    event loop's own handlers, ``loop.add_signal_handler``, end with it). :meth:`wait`
    wakes two ways: the handler itself schedules the wake-up on the waiting loop (it runs
    in the main thread, once the loop wakes for the signal), and a wake-up socket
    (``signal.set_wakeup_fd``) wakes a loop that nothing else would wake. An event loop
    that installs its own wake-up descriptor (uvloop does) replaces the socket; the first
    way still works. Enter it from the main thread; elsewhere it does nothing, since
    Python runs signal handlers only in the main thread.
    """

    def __init__(self, signals: Iterable[signal.Signals] = SHUTDOWN_SIGNALS) -> None:
        self.signals = tuple(signals)
        self.received: list[signal.Signals] = []
        self._previous: dict[signal.Signals, Any] = {}
        self._previous_wakeup = -1
        self._wakeup: tuple[socket.socket, socket.socket] | None = None
        self._waker: Callable[[], None] | None = None

    @property
    def first(self) -> signal.Signals | None:
        """The first signal received, or None."""
        return self.received[0] if self.received else None

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signal.Signals(signum))
        waker, self._waker = self._waker, None
        if waker is not None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nothing waits
                waker()

    def __enter__(self) -> SignalGuard:
        if threading.current_thread() is not threading.main_thread():
            return self
        reader, writer = socket.socketpair()
        reader.setblocking(False)
        writer.setblocking(False)
        self._wakeup = reader, writer
        self._previous_wakeup = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._wakeup is None:
            return
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        signal.set_wakeup_fd(self._previous_wakeup)
        for sock in self._wakeup:
            sock.close()
        self._wakeup = None

    async def wait(self, seen: int) -> None:
        """Return once more than ``seen`` signals have been received (never, if not entered
        in the main thread)."""
        while len(self.received) <= seen:
            if self._wakeup is None:
                await anyio.sleep_forever()
                return
            woken = anyio.Event()
            self._waker = _call_soon(woken.set)
            if len(self.received) > seen:
                break
            reader = self._wakeup[0]
            async with anyio.create_task_group() as tg:
                tg.start_soon(_set_when_readable, reader, woken)
                await woken.wait()
                tg.cancel_scope.cancel()
            try:
                while reader.recv(4096):
                    pass
            except BlockingIOError:
                pass
            # The wake-up byte is written before the Python-level handler runs (in the
            # main thread, at its next check): let it run before looking again.
            await anyio.lowlevel.checkpoint()
        self._waker = None


async def _set_when_readable(sock: socket.socket, event: anyio.Event) -> None:
    await anyio.wait_readable(sock)
    event.set()


def _call_soon(fn: Callable[[], None]) -> Callable[[], None]:
    """A callable that schedules ``fn`` on the running event loop, safe to call from a
    signal handler (asyncio's ``call_soon_threadsafe``, trio's ``run_sync_soon``)."""
    loop: Any = current_loop()  # asyncio's loop, or trio's token for this run
    if isinstance(loop, asyncio.AbstractEventLoop):

        def wake() -> None:
            loop.call_soon_threadsafe(fn)

        return wake
    return lambda: loop.run_sync_soon(fn)


async def _watch_signals(guard: SignalGuard, work: CancelScope, report: _Report) -> None:
    # The first signal cancels the work (the manager's close is shielded and runs to the
    # end); the later ones are only reported.
    seen = 0
    while True:
        await guard.wait(seen)
        for signum in guard.received[seen:]:
            if seen == 0:
                work.cancel()
            else:
                report.note(f"{signum.name} received while closing: the close runs to the end")
            seen += 1


async def _pin_and_close(
    args: argparse.Namespace, backend: PinBackend, nbytes: int, outcome: _Outcome, report: _Report
) -> None:
    name = args.name
    if args.backing == "shared" and name is None:
        name = f"asyncpin-demo-{os.getpid()}"
    mgr = OffloadManager(
        nbytes,
        backend=backend,
        backing=args.backing,
        name=name,
        chunk_bytes=args.chunk_mib << 20,
        prefault_threads=args.prefault_threads,
        pin_threads=args.pin_threads,
    )
    outcome.manager = mgr
    async with mgr:
        report.entered(mgr.stats())
        with report.progress(mgr.nbytes) as update:
            while not mgr.pinned.is_set():
                with anyio.move_on_after(_REFRESH_S):
                    await mgr.pinned
                update(mgr.stats().pinned_bytes)
        await mgr.pinned  # raises the PinError if pinning failed
        await mgr.measure_hugepages()
        outcome.at_pinned = mgr.stats()


async def _demo(
    args: argparse.Namespace,
    backend: PinBackend,
    nbytes: int,
    report: _Report,
    guard: SignalGuard,
) -> _Outcome:
    outcome = _Outcome()
    async with anyio.create_task_group() as tg:
        with CancelScope() as work:
            tg.start_soon(_watch_signals, guard, work, report)
            try:
                await _pin_and_close(args, backend, nbytes, outcome, report)
            finally:
                tg.cancel_scope.cancel()
    return outcome


_Segments = Sequence[tuple[str, str]]  # (text, rich style) pieces of one line


def _rich_console() -> Any:
    """A rich Console, or None where rich is not installed (plain text then)."""
    try:
        from rich.console import Console
    except ImportError:
        return None
    return Console(highlight=False)


def plain_table(title: str, header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """Rows as plain text in aligned columns under a title (the output without rich)."""
    lines = [list(header), *(list(row) for row in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    rendered = [
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    ]
    rendered.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join([title, *rendered])


class _Report:
    """Human output on stdout (rich where installed, else plain text) or JSON (stdout,
    nothing else there)."""

    def __init__(self, *, as_json: bool) -> None:
        self.as_json = as_json
        self._console: Any = None if as_json else _rich_console()

    def note(self, text: str) -> None:
        with contextlib.suppress(OSError):  # stderr gone (a hung-up terminal): nothing to do
            print(f"{PROG} demo: {text}", file=sys.stderr, flush=True)

    def _line(self, segments: _Segments) -> None:
        if self.as_json:
            return
        if self._console is None:
            print("".join(text for text, _style in segments), flush=True)
            return
        from rich.text import Text

        self._console.print(Text.assemble(*segments), soft_wrap=True)

    def started(self, backend: PinBackend, nbytes: int, args: argparse.Namespace) -> None:
        self._line(
            [
                ("asyncpin demo", "bold"),
                (": backend ", ""),
                (backend.name, "cyan"),
                (
                    f", {format_bytes(nbytes)} {args.backing}, chunks of {args.chunk_mib} MiB, "
                    f"{args.prefault_threads} prefault / {args.pin_threads} pin threads",
                    "",
                ),
            ]
        )

    def entered(self, stats: ManagerStats) -> None:
        enter_ms = (stats.seconds_to_enter or 0.0) * 1e3
        self._line(
            [
                (
                    f"entered in {enter_ms:.2f} ms; "
                    f"pinning {_chunks(stats.chunks_total)} in the background",
                    "",
                )
            ]
        )

    def progress(self, nbytes: int) -> _ProgressContext:
        return _ProgressContext(self._console, nbytes, enabled=not self.as_json)

    def finished(self, outcome: _Outcome) -> None:
        assert outcome.manager is not None and outcome.at_pinned is not None
        final = outcome.manager.stats()
        pinned = outcome.at_pinned
        ratio = _ratio(pinned.seconds_to_pinned, pinned.seconds_to_enter)
        locked_after = _sys.vm_locked_bytes()
        if self.as_json:
            doc = {
                "stats": asdict(final),
                "at_pinned": asdict(pinned),
                "pinned_over_enter": ratio,
                "vm_locked_bytes_after_close": locked_after,
            }
            print(json.dumps(doc, indent=2))
            return
        rows = list(_rows(final, pinned, ratio, locked_after))
        if self._console is None:
            print(plain_table("asyncpin demo", ("figure", "value"), rows))
            return
        from rich.table import Table

        table = Table(title="asyncpin demo", show_header=True, header_style="bold")
        table.add_column("figure")
        table.add_column("value", justify="right")
        for figure, value in rows:
            table.add_row(figure, value)
        self._console.print(table)


class _ProgressContext:
    """Progress over pinned bytes: a rich progress bar, or without rich a plain line at
    every tenth of the buffer; a no-op for JSON output."""

    def __init__(self, console: Any, nbytes: int, *, enabled: bool) -> None:
        self._console = console
        self._nbytes = nbytes
        self._enabled = enabled
        self._progress: Any = None
        self._task: Any = None
        self._tenths = 0

    def __enter__(self) -> Callable[[int], None]:
        if not self._enabled:
            return lambda _done: None
        if self._console is None:
            return self._plain
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TransferSpeedColumn,
        )

        self._progress = Progress(
            TextColumn("pinning"),
            BarColumn(),
            DownloadColumn(binary_units=True),
            TransferSpeedColumn(),
            TimeElapsedColumn(),
            console=self._console,
        )
        self._progress.start()
        self._task = self._progress.add_task("pinning", total=self._nbytes)
        return self._update

    def _update(self, done: int) -> None:
        self._progress.update(self._task, completed=done)

    def _plain(self, done: int) -> None:
        tenths = done * 10 // self._nbytes if self._nbytes else 10
        if tenths > self._tenths:
            self._tenths = tenths
            print(
                f"pinning: {tenths * 10}% ({format_bytes(done)} of {format_bytes(self._nbytes)})",
                flush=True,
            )

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()


def _chunks(count: int) -> str:
    return f"{count} chunk" if count == 1 else f"{count} chunks"


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1e3:.2f} ms" if value < 1 else f"{value:.3f} s"


def _rows(
    final: ManagerStats, pinned: ManagerStats, ratio: float | None, locked_after: int
) -> Iterator[tuple[str, str]]:
    yield "backend / backing", f"{final.backend} / {final.backing}"
    yield "buffer", f"{format_bytes(final.nbytes)} in {_chunks(final.chunks_total)}"
    yield "time to enter", _seconds(pinned.seconds_to_enter)
    yield "time to pinned", _seconds(pinned.seconds_to_pinned)
    yield "pinned / enter", f"{ratio:,.0f}x" if ratio is not None else "-"
    gib_s = pinned.pin_gib_per_s
    yield "pinning speed", f"{gib_s:.2f} GiB/s" if gib_s is not None else "-"
    huge = pinned.hugepage_bytes
    yield "huge pages", format_bytes(huge) if huge is not None else "-"
    yield "close time", _seconds(final.close_seconds)
    yield "state / leaked chunks", f"{final.state} / {final.chunks_leaked}"
    yield "locked after close (VmLck)", format_bytes(locked_after)


# -- entry ---------------------------------------------------------------------------------


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


def _one_line(exc: BaseException) -> str:
    leaves = list(_leaves(exc))
    main_exc = next((e for e in leaves if isinstance(e, AsyncpinError | OSError)), leaves[0])
    text = " ".join(str(main_exc).split()) or type(main_exc).__name__
    others = sorted({type(e).__name__ for e in leaves if e is not main_exc})
    return text + (f" [also raised: {', '.join(others)}]" if others else "")


def _is_reportable(exc: BaseException) -> bool:
    return any(isinstance(e, AsyncpinError | OSError) for e in _leaves(exc))


def _run_demo(args: argparse.Namespace) -> int:
    # From here to the exit, a shutdown signal never ends the process before the close.
    with SignalGuard() as guard:
        return _run_demo_guarded(args, guard)


def _run_demo_guarded(args: argparse.Namespace, guard: SignalGuard) -> int:
    report = _Report(as_json=args.json)
    backend = resolve_backend(args.backend)
    if args.size is not None:
        nbytes = args.size
    else:
        nbytes, note = default_nbytes(
            backend=backend.name,
            mem_available=_sys.mem_available_bytes(),
            memlock_limit=_sys.memlock_limit_bytes(),
            locked_bytes=_sys.vm_locked_bytes(),
            has_cap_ipc_lock=_sys.has_cap_ipc_lock(),
        )
        if note is not None:
            report.note(note)
        if nbytes <= 0:
            report.note(
                "error: no memory can be pinned: RLIMIT_MEMLOCK is used up; raise it with "
                "`ulimit -l unlimited` or grant CAP_IPC_LOCK"
            )
            return _EXIT_ERROR
    report.started(backend, nbytes, args)
    outcome = anyio.run(_demo, args, backend, nbytes, report, guard)
    first = guard.first
    if first is not None:
        stats = outcome.manager.stats() if outcome.manager is not None else None
        closed = (
            f"; manager {stats.state} after {_seconds(stats.close_seconds)} with "
            f"{format_bytes(stats.pinned_bytes)} still pinned"
            if stats is not None
            else ""
        )
        report.note(f"interrupted by {first.name}{closed}")
        return 128 + first
    report.finished(outcome)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (see the module docstring)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help and on usage errors
        return exc.code if isinstance(exc.code, int) else _EXIT_USAGE
    if args.command is None:
        parser.print_help(sys.stderr)
        return _EXIT_USAGE
    if args.command == "doctor":
        return _run_doctor(args)
    if args.name is not None and args.backing != "shared":
        print(f"{PROG} demo: error: --name needs --backing shared (see --help)", file=sys.stderr)
        return _EXIT_USAGE
    configure_logging(verbose=args.verbose, stream=sys.stderr)
    try:
        return _run_demo(args)
    except KeyboardInterrupt:
        # Only reachable outside the demo's own signal handling (before or after the
        # manager's lifetime), so there is nothing left open.
        print(f"{PROG} demo: interrupted", file=sys.stderr)
        return _EXIT_SIGINT
    except BaseException as exc:
        if isinstance(exc, Exception) and _is_reportable(exc):
            print(f"{PROG} demo: error: {_one_line(exc)}", file=sys.stderr)
            return _EXIT_ERROR
        raise
