"""``python -m asyncpin demo``: map a buffer, pin it in the background while showing
progress, report how long entry and pinning took, and close (see :mod:`asyncpin.cli` for
the exit codes and what a shutdown signal does).

Output: with rich installed (the ``demo`` extra), a progress bar and a table; without it,
the same figures as plain text; with ``--json``, the final stats as JSON on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import anyio
from anyio import CancelScope

from asyncpin import _sys
from asyncpin._config import default_chunk_bytes
from asyncpin.backends import PinBackend, resolve_backend
from asyncpin.cli import EXIT_ERROR, PROG, default_nbytes, format_bytes, plain_table, stdout
from asyncpin.manager import OffloadManager
from asyncpin.signals import SignalGuard
from asyncpin.stats import ManagerStats

__all__ = ["run"]

_REFRESH_S = 0.1


@dataclass(slots=True)
class _Outcome:
    """What the demo saw; filled in as it goes so an interrupted run can still report."""

    manager: OffloadManager | None = None
    at_pinned: ManagerStats | None = None


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
        chunk_bytes=None if args.chunk_mib is None else args.chunk_mib << 20,
        prefault_threads=args.prefault_threads,
        pin_threads=args.pin_threads,
    )
    outcome.manager = mgr
    async with mgr:
        report.entered(mgr.stats(), mgr.region_name)
        with report.progress(mgr.nbytes) as update:
            while not mgr.pinned.is_set():
                with anyio.move_on_after(_REFRESH_S):
                    await mgr.pinned
                stats = mgr.stats()
                update(stats.faulted_bytes, stats.pinned_bytes)
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
    return Console(highlight=False, file=stdout)  # type: ignore[arg-type]


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
            print("".join(text for text, _style in segments), file=stdout, flush=True)
            return
        from rich.text import Text

        self._console.print(Text.assemble(*segments), soft_wrap=True)

    def started(
        self, backend: PinBackend, nbytes: int, chunk_bytes: int, args: argparse.Namespace
    ) -> None:
        self._line(
            [
                ("asyncpin demo", "bold"),
                (": backend ", ""),
                (backend.name, "cyan"),
                (
                    f", {format_bytes(nbytes)} {args.backing}"
                    f" in {_in_chunks(nbytes, chunk_bytes)}, "
                    f"{args.prefault_threads} prefault / {args.pin_threads} pin threads",
                    "",
                ),
            ]
        )

    def entered(self, stats: ManagerStats, region_name: str | None) -> None:
        enter_ms = (stats.seconds_to_enter or 0.0) * 1e3
        where = f" (/dev/shm/{region_name})" if region_name else ""
        self._line(
            [
                (
                    f"entered in {enter_ms:.2f} ms; "
                    f"pinning {_chunks(stats.chunks_total)}{where} in the background",
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
                "region_name": outcome.manager.region_name,  # /dev/shm/<name> when shared
                "stats": asdict(final),
                "at_pinned": asdict(pinned),
                "pinned_over_enter": ratio,
                "vm_locked_bytes_after_close": locked_after,
            }
            print(json.dumps(doc, indent=2), file=stdout, flush=True)
            return
        rows = list(_rows(final, pinned, ratio, locked_after))
        if self._console is None:
            print(plain_table("asyncpin demo", ("figure", "value"), rows), file=stdout, flush=True)
            return
        from rich.table import Table

        table = Table(title="asyncpin demo", show_header=True, header_style="bold")
        table.add_column("figure")
        table.add_column("value", justify="right")
        for figure, value in rows:
            table.add_row(figure, value)
        self._console.print(table)


class _ProgressContext:
    """Progress over faulted-in bytes, then pinned ones (pinning begins once the whole
    buffer is faulted in): two rich progress bars, or without rich a plain line at every
    tenth of the buffer of each; a no-op for JSON output."""

    def __init__(self, console: Any, nbytes: int, *, enabled: bool) -> None:
        self._console = console
        self._nbytes = nbytes
        self._enabled = enabled
        self._progress: Any = None
        self._tasks: list[Any] = []
        self._tenths = {"faulting in": 0, "pinning": 0}

    def __enter__(self) -> Callable[[int, int], None]:
        if not self._enabled:
            return lambda _faulted, _pinned: None
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
            TextColumn("{task.description:<11}"),
            BarColumn(),
            DownloadColumn(binary_units=True),
            TransferSpeedColumn(),
            TimeElapsedColumn(),
            console=self._console,
        )
        self._progress.start()
        self._tasks = [self._progress.add_task(what, total=self._nbytes) for what in self._tenths]
        return self._update

    def _update(self, faulted: int, pinned: int) -> None:
        for task, done in zip(self._tasks, (faulted, pinned), strict=True):
            self._progress.update(task, completed=done)

    def _plain(self, faulted: int, pinned: int) -> None:
        for what, done in zip(self._tenths, (faulted, pinned), strict=True):
            tenths = done * 10 // self._nbytes if self._nbytes else 10
            if tenths > self._tenths[what]:
                self._tenths[what] = tenths
                print(
                    f"{what}: {tenths * 10}% "
                    f"({format_bytes(done)} of {format_bytes(self._nbytes)})",
                    file=stdout,
                    flush=True,
                )

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()


def _chunks(count: int) -> str:
    return f"{count} chunk" if count == 1 else f"{count} chunks"


def _in_chunks(nbytes: int, chunk_bytes: int) -> str:
    """``"1 chunk"``, or ``"256 chunks of 16.00 MiB"`` (a buffer smaller than the chunk
    size is one chunk of its own size)."""
    count = -(-nbytes // chunk_bytes)
    return _chunks(count) if count == 1 else f"{_chunks(count)} of {format_bytes(chunk_bytes)}"


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


def run(args: argparse.Namespace) -> int:
    """Run the demo as the parsed ``args`` say; returns the exit code."""
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
            return EXIT_ERROR
    chunk_bytes = default_chunk_bytes(nbytes) if args.chunk_mib is None else args.chunk_mib << 20
    report.started(backend, nbytes, chunk_bytes, args)
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
