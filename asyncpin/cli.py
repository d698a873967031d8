"""Command line: ``python -m asyncpin demo`` maps a buffer, pins it in the background while
showing progress, reports how long entry and pinning took, and closes.
``python -m asyncpin doctor`` runs the pre-flight checks (asyncpin.doctor): exit 1 if one
fails, else 0.

This module is an application of the library, so it is the one place that configures
structlog (warnings and above to stderr; ``--verbose`` for info). Exit codes: 0 on
success; 1 with one line ``asyncpin demo: error: <message>`` on stderr for an asyncpin or
OS error; 2 for bad arguments (one line too); 128 + the signal's number after a signal
of :data:`asyncpin.signals.SHUTDOWN_SIGNALS` (130 after SIGINT, 143 after SIGTERM, 129
after SIGHUP), once the manager has closed.

Signals: from the moment the demo starts until it exits, the first shutdown signal starts
the close, and any later one is reported on stderr and changes nothing: the close always
runs to the end (unpin, unmap, unlink a shared file), and the exit code is the first
signal's. The demo itself is :mod:`asyncpin.demo`; holding the signals off,
:mod:`asyncpin.signals`.

Output: with rich installed (the ``demo`` extra), a progress bar and tables; without it,
the demo and the doctor print the same figures as plain text.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import signal
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import NoReturn, TextIO, cast

import structlog

from asyncpin import _sys
from asyncpin._config import DEFAULT_CHUNK_BYTES, default_prefault_threads
from asyncpin.backends import BACKEND_NAMES
from asyncpin.errors import AsyncpinError

__all__ = [
    "DEFAULT_MAX_BYTES",
    "EXIT_ERROR",
    "EXIT_SIGINT",
    "EXIT_USAGE",
    "PROG",
    "default_nbytes",
    "format_bytes",
    "main",
    "parse_size",
    "plain_table",
]

PROG = "asyncpin"
DEFAULT_MAX_BYTES = 4 << 30
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_SIGINT = 128 + signal.SIGINT

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
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


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
    _add_common(
        demo,
        "buffer size: bytes or e.g. 512MiB, 2GiB (default: min(4 GiB, MemAvailable/4), "
        "and within RLIMIT_MEMLOCK for the host backend without CAP_IPC_LOCK)",
    )
    demo.add_argument(
        "--chunk-mib",
        type=_positive_int,
        default=None,
        help=(
            f"chunk size in MiB (default: {DEFAULT_CHUNK_BYTES >> 20}, more over 16 GiB: "
            "as much as keeps 1024 chunks, up to 64)"
        ),
    )
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
    _add_common(
        doctor,
        "buffer size to check for (default: the demo's, min(4 GiB, MemAvailable/4), "
        "capped by what is left of RLIMIT_MEMLOCK when mlock pins it without CAP_IPC_LOCK)",
    )
    doctor.add_argument("--json", action="store_true", help="print the checks as JSON")
    return parser


def _add_common(command: argparse.ArgumentParser, size_help: str) -> None:
    """The options the demo and the doctor share: --size, --backend, --backing."""
    command.add_argument("--size", type=_size_arg, default=None, help=size_help)
    command.add_argument("--backend", choices=BACKEND_NAMES, default="auto")
    command.add_argument("--backing", choices=("anonymous", "shared"), default="anonymous")


def _run_doctor(args: argparse.Namespace) -> int:
    from asyncpin import doctor

    checks = doctor.run_checks(args.size, backend=args.backend, backing=args.backing)
    print(doctor.render(checks, as_json=args.json), file=stdout, flush=True)
    return EXIT_ERROR if doctor.worst(checks) == "fail" else 0


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


# -- output ---------------------------------------------------------------------------------


class _Stdout:
    """``sys.stdout`` for the commands' output, where a reader that went away (``| head``,
    a full disk) is not the command's failure: from the first write that fails, output
    goes to /dev/null (the descriptor too, so that the interpreter's last flush does not
    fail either) and the command goes on; its exit status says how its work went."""

    def __init__(self) -> None:
        self.gone = False

    def _gone(self) -> None:
        self.gone = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):  # no descriptor to swap: dropped here
            pass

    @staticmethod
    def _target() -> TextIO | None:
        """sys.stdout, or None where the process started with its stdout closed."""
        # rich's live display puts a proxy of its console in sys.stdout, which writes to
        # the console, whose file is this: write past it, or each write calls itself.
        out = sys.stdout
        return None if out is None else cast(TextIO, getattr(out, "rich_proxied_file", out))

    def write(self, text: str) -> int:
        target = None if self.gone else self._target()
        if target is None:
            self.gone = True
        else:
            try:
                return target.write(text)
            except OSError:
                self._gone()
        return len(text)

    def flush(self) -> None:
        target = None if self.gone else self._target()
        if target is not None:
            try:
                target.flush()
            except OSError:
                self._gone()

    def isatty(self) -> bool:
        return not self.gone and sys.stdout is not None and sys.stdout.isatty()

    def fileno(self) -> int:
        if sys.stdout is None:
            raise OSError(errno.EBADF, "stdout is closed")
        return sys.stdout.fileno()

    @property
    def encoding(self) -> str:
        return getattr(sys.stdout, "encoding", None) or "utf-8"


#: What the demo and the doctor print their output to.
stdout = _Stdout()


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
    # Imported here, as the doctor is: the demo builds on this module's helpers.
    from asyncpin import demo

    return demo.run(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (see the module docstring)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help and on usage errors
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if args.command == "doctor":
        return _run_doctor(args)
    if args.name is not None and args.backing != "shared":
        print(f"{PROG} demo: error: --name needs --backing shared (see --help)", file=sys.stderr)
        return EXIT_USAGE
    configure_logging(verbose=args.verbose, stream=sys.stderr)
    try:
        return _run_demo(args)
    except KeyboardInterrupt:
        # Only reachable outside the demo's own signal handling (before or after the
        # manager's lifetime), so there is nothing left open.
        print(f"{PROG} demo: interrupted", file=sys.stderr)
        return EXIT_SIGINT
    except BaseException as exc:
        if isinstance(exc, Exception) and _is_reportable(exc):
            print(f"{PROG} demo: error: {_one_line(exc)}", file=sys.stderr)
            return EXIT_ERROR
        raise
