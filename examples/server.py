"""An OffloadManager embedded in a Starlette server: readiness probe, liveness, metrics.

    pip install -e '.[server,metrics]'
    ASYNCPIN_NBYTES=4GiB python -m examples.server --port 8000

``python -m examples.server`` runs uvicorn on :func:`create_app`. ``uvicorn --factory
examples.server:create_app`` serves the same app with uvicorn's own signal handling, which
this module replaces (``_Server``): any of SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1 and
SIGUSR2 shuts the server down, no later signal can skip or cut short the manager's close,
and a clean shut-down exits 0. The server answers at once while the buffer pins in the
background:

- ``GET /healthz/live``: 200 as soon as the process serves requests.
- ``GET /healthz/ready``: 503 while pinning (``status``, ``pinned_bytes``, ``nbytes``,
  ``fraction``), 200 once every chunk is pinned, 500 with the error if pinning failed.
- ``GET /metrics``: Prometheus text (``asyncpin.metrics.OffloadCollector``).

The application's lifespan opens the manager at start-up and closes it (in order: stop
pinning, unpin, unmap, unlink a shared file) at shut-down. Settings come from the
arguments of :func:`create_app`, or else from the environment:

- ``ASYNCPIN_NBYTES``: buffer size, bytes or with a unit (``512MiB``, ``4GiB``); 1 GiB.
- ``ASYNCPIN_BACKEND``: ``auto`` (CUDA when a GPU is visible, else ``mlock``), ``cuda``
  or ``host``.
- ``ASYNCPIN_SHARED_NAME``: create the buffer as ``/dev/shm/<name>`` so that other
  processes can attach to it (``OffloadManager.attached(name)``).
- ``ASYNCPIN_CHUNK_BYTES``: unit of pinning (16 MiB).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asyncpin import DEFAULT_CHUNK_BYTES, ManagerState, OffloadManager, PinBackend
from asyncpin.cli import parse_size
from asyncpin.metrics import OffloadCollector
from asyncpin.region import Backing
from asyncpin.signals import SHUTDOWN_SIGNALS, SignalGuard

__all__ = ["create_app", "main"]

DEFAULT_NBYTES = 1 << 30


def create_app(
    nbytes: int | None = None,
    *,
    backend: str | PinBackend | None = None,
    shared_name: str | None = None,
    chunk_bytes: int | None = None,
    registry: CollectorRegistry | None = None,
    environ: Mapping[str, str] | None = None,
) -> Starlette:
    """The application; arguments left out are read from ``environ`` (``os.environ``).

    ``backend`` may be a ``PinBackend`` object (tests pass ``asyncpin.testing.FakeBackend``).
    ``registry`` is where ``/metrics`` reads from; by default a registry of this app's own,
    so that several apps in one process do not clash. A size that does not parse raises
    ValueError here; the manager checks the rest at start-up (ConfigError, PreflightError),
    which then fails.
    """
    env = os.environ if environ is None else environ
    if nbytes is None:
        nbytes = parse_size(env.get("ASYNCPIN_NBYTES", str(DEFAULT_NBYTES)))
    if backend is None:
        backend = env.get("ASYNCPIN_BACKEND", "auto")
    if shared_name is None:
        shared_name = env.get("ASYNCPIN_SHARED_NAME") or None
    if chunk_bytes is None:
        chunk_bytes = parse_size(env.get("ASYNCPIN_CHUNK_BYTES", str(DEFAULT_CHUNK_BYTES)))
    metrics = CollectorRegistry() if registry is None else registry
    backing: Backing = "shared" if shared_name else "anonymous"

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # A new manager per start-up: a manager can be entered only once.
        manager = OffloadManager(
            nbytes, backend=backend, backing=backing, name=shared_name, chunk_bytes=chunk_bytes
        )
        collector = OffloadCollector(manager)
        metrics.register(collector)
        try:
            async with manager:
                app.state.manager = manager
                yield
        finally:
            metrics.unregister(collector)

    async def live(request: Request) -> Response:
        return JSONResponse({"status": "alive"})

    async def ready(request: Request) -> Response:
        manager: OffloadManager | None = getattr(request.app.state, "manager", None)
        if manager is None:
            return JSONResponse({"status": "starting"}, status_code=503)
        stats = manager.stats()
        body: dict[str, object] = {
            "status": "pinning",
            "pinned_bytes": stats.pinned_bytes,
            "nbytes": stats.nbytes,
            "fraction": stats.pinned_fraction,
        }
        error = manager.pin_error
        if error is not None:
            body.update(
                status="failed",
                error=str(error),
                chunk=error.chunk_index,
                code=error.code,
                code_name=error.code_name,
            )
            return JSONResponse(body, status_code=500)
        if manager.state is not ManagerState.OPEN:
            body["status"] = manager.state.value
            return JSONResponse(body, status_code=503)
        if manager.is_pinned():
            body["status"] = "ready"
            return JSONResponse(body)
        return JSONResponse(body, status_code=503)

    async def prometheus(request: Request) -> Response:
        return Response(generate_latest(metrics), media_type=CONTENT_TYPE_LATEST)

    return Starlette(
        routes=[
            Route("/healthz/live", live),
            Route("/healthz/ready", ready),
            Route("/metrics", prometheus),
        ],
        lifespan=lifespan,
    )


class _Server(uvicorn.Server):
    """uvicorn's server, ended the same way by every signal of ``SHUTDOWN_SIGNALS``, with an
    application shut-down (the manager's close) that no later signal skips or interrupts.

    On its own, uvicorn handles SIGINT and SIGTERM only (SIGHUP or SIGUSR1 would kill the
    process at once, leaving a shared file behind); a second SIGINT before the application's
    shut-down has begun makes it skip it; and once shut down, it raises the signals it caught
    again, for the handlers that were there before it started (with the default ones, the
    process dies of the signal). Here a ``SignalGuard`` holds the signals for the whole
    process (see :func:`main`) and uvicorn installs none of its own. The first signal starts
    the shut-down. A later one is logged and stops the wait for open connections and
    background tasks, as a second Ctrl-C does in uvicorn, but the application's shut-down
    runs all the same. No signal is raised again: a clean shut-down exits 0.
    """

    def __init__(self, config: uvicorn.Config, guard: SignalGuard) -> None:
        super().__init__(config)
        self.guard = guard

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the guard holds them, from before the loop starts until after it ends

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        watcher = asyncio.ensure_future(self._watch_signals())
        try:
            await super().serve(sockets)
        finally:
            watcher.cancel()

    async def _watch_signals(self) -> None:
        seen = 0
        while True:
            await self.guard.wait(seen)
            for signum in self.guard.received[seen:]:
                if seen == 0:
                    self.should_exit = True
                else:
                    self.force_exit = True
                    logging.getLogger("uvicorn.error").warning(
                        "%s received while shutting down: no longer waiting for open "
                        "connections; the offload manager still closes before the process "
                        "exits",
                        signum.name,
                    )
                seen += 1

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        # uvicorn skips the application's shut-down when a later signal forced the exit
        # before it began (once begun, it runs to the end); the manager must close anyway.
        shut_down = getattr(self.lifespan, "shutdown_event", None)
        if self.force_exit and shut_down is not None and not shut_down.is_set():
            await self.lifespan.shutdown()


def main(argv: Sequence[str] | None = None) -> None:
    """Serve :func:`create_app` with uvicorn until a signal of ``SHUTDOWN_SIGNALS`` (SIGINT,
    SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2); exit status 0 after a clean shut-down.

    The signals are held from before uvicorn starts until it has returned, so none finds
    a default handler while the manager is open or closing (see ``_Server``).
    """
    parser = argparse.ArgumentParser(prog="python -m examples.server", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--fd", type=int, default=None, help="serve on this inherited, listening socket"
    )
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    config = uvicorn.Config(
        create_app,
        factory=True,
        host=args.host,
        port=args.port,
        fd=args.fd,
        lifespan="on",
        log_level=args.log_level,
    )
    with SignalGuard(SHUTDOWN_SIGNALS) as guard:
        _Server(config, guard).run()


if __name__ == "__main__":
    main()
