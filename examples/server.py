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
- ``GET /healthz/ready``: 503 while pinning (``status``, ``faulted_bytes``,
  ``pinned_bytes``, ``nbytes``, ``fraction`` of it pinned), 200 once every chunk is
  pinned, 500 with the error if pinning failed.
- ``GET /metrics``: Prometheus text (``asyncpin.metrics.OffloadCollector``; with a remote
  tier, ``asyncpin.metrics.TierCollector`` too: ``asyncpin_tier_*`` and
  ``asyncpin_tier_remote_*``).

With ``ASYNCPIN_REDIS_URL`` set, the server also runs a KV tier (``asyncpin.tier.KVTier``)
whose remote tier is that Redis or Valkey server (``RedisStore``). The example has no
engine: a small KV cache of CPU tensors (``example_kv_caches``, the host engine moves it)
stands in for an engine's, and the buffer holds ``nbytes // host_block_bytes`` of its
blocks. The tier is entered after the manager and left before it; ``app.state.tier`` and
``app.state.kv_caches`` are where an engine (or a test) would reach them. Readiness then
carries ``remote`` (``store``, ``degraded`` and counters): a failing remote server leaves
the server ready, since it serves on from the host, with ``"degraded": true``. Neither the
body, the metrics nor the logs ever show the URL's credentials.

The application's lifespan opens the manager at start-up and closes it (in order: stop
pinning, unpin, unmap, unlink a shared file) at shut-down. Settings come from the
arguments of :func:`create_app`, or else from the environment:

- ``ASYNCPIN_NBYTES``: buffer size, bytes or with a unit (``512MiB``, ``4GiB``); 1 GiB.
- ``ASYNCPIN_BACKEND``: ``auto`` (CUDA when a GPU is visible, else ``mlock``), ``cuda``
  or ``host``.
- ``ASYNCPIN_SHARED_NAME``: create the buffer as ``/dev/shm/<name>`` so that other
  processes can attach to it (``OffloadManager.attached(name)``).
- ``ASYNCPIN_CHUNK_BYTES``: unit of pinning (default: the library's, 16 MiB up to 16 GiB).
- ``ASYNCPIN_REDIS_URL``: ``redis://[user:password@]host:port/db`` (``rediss://`` for TLS)
  of the remote tier; unset or empty: no KV tier.
- ``ASYNCPIN_REDIS_CLUSTER``: ``1`` when that URL is a node of a cluster (``0``).
- ``ASYNCPIN_REDIS_TIMEOUT_S``: bound of every connect, read and call, seconds (1).
- ``ASYNCPIN_REDIS_NAMESPACE``: first part of every key (``asyncpin``).
- ``ASYNCPIN_MODEL``: the model's name in the keys, so that servers of other models never
  read these blocks (empty).
"""

# ruff: noqa: E402 (the imports below come after the signals are held)
from __future__ import annotations

import signal

# Run as a program, the shut-down signals are held from here, before the imports below
# (torch's takes seconds): one that comes meanwhile is noted, and main() exits 0 at once
# without starting anything, instead of the process dying of its default action.
_EARLY_SIGNALS: list[int] = []
if __name__ == "__main__":
    for _signum in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"):
        signal.signal(getattr(signal, _signum), lambda n, _frame: _EARLY_SIGNALS.append(n))

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import sys
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager

import torch
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asyncpin import KVLayout, ManagerState, OffloadManager, PinBackend
from asyncpin.cli import parse_size
from asyncpin.metrics import OffloadCollector, TierCollector
from asyncpin.region import Backing
from asyncpin.signals import SHUTDOWN_SIGNALS, SignalGuard
from asyncpin.tier import KVTier, RedisStore

__all__ = ["create_app", "example_kv_caches", "main"]

DEFAULT_NBYTES = 1 << 30
DEFAULT_REDIS_TIMEOUT_S = 1.0
DEFAULT_REDIS_NAMESPACE = "asyncpin"
# The stand-in KV cache: per layer one tensor [K/V, block, token, head, head dim] of
# float16, 16 KiB a block over the layers.
KV_LAYERS, KV_BLOCKS, KV_BLOCK_TOKENS, KV_HEADS, KV_HEAD_DIM = 2, 64, 16, 2, 64
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def example_kv_caches() -> list[torch.Tensor]:
    """The example's stand-in for an engine's KV cache: small CPU tensors (the host
    engine moves their blocks), whose dimension 1 indexes blocks."""
    shape = (2, KV_BLOCKS, KV_BLOCK_TOKENS, KV_HEADS, KV_HEAD_DIM)
    return [torch.zeros(shape, dtype=torch.float16) for _ in range(KV_LAYERS)]


def _flag(name: str, text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name} must be 1 or 0, got {text!r}")


def _seconds(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise ValueError(f"{name} must be > 0, got {text!r}")
    return value


def create_app(
    nbytes: int | None = None,
    *,
    backend: str | PinBackend | None = None,
    shared_name: str | None = None,
    chunk_bytes: int | None = None,
    registry: CollectorRegistry | None = None,
    redis_url: str | None = None,
    redis_cluster: bool | None = None,
    redis_timeout_s: float | None = None,
    redis_namespace: str | None = None,
    model: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Starlette:
    """The application; arguments left out are read from ``environ`` (``os.environ``).

    ``backend`` may be a ``PinBackend`` object (tests pass ``asyncpin.testing.FakeBackend``).
    ``registry`` is where ``/metrics`` reads from; by default a registry of this app's own,
    so that several apps in one process do not clash. ``redis_url`` (``ASYNCPIN_REDIS_URL``;
    None or empty: none) adds the KV tier with its remote tier (see the module's doc). A
    size, flag or timeout that does not parse raises ValueError here; the manager and the
    store check the rest at start-up (ConfigError, PreflightError), which then fails.
    """
    env = os.environ if environ is None else environ
    if nbytes is None:
        nbytes = parse_size(env.get("ASYNCPIN_NBYTES", str(DEFAULT_NBYTES)))
    if backend is None:
        backend = env.get("ASYNCPIN_BACKEND", "auto")
    if shared_name is None:
        shared_name = env.get("ASYNCPIN_SHARED_NAME") or None
    if chunk_bytes is None and env.get("ASYNCPIN_CHUNK_BYTES"):
        chunk_bytes = parse_size(env["ASYNCPIN_CHUNK_BYTES"])
    if redis_url is None:
        redis_url = env.get("ASYNCPIN_REDIS_URL")
    url = redis_url or None
    if redis_cluster is None:
        redis_cluster = _flag("ASYNCPIN_REDIS_CLUSTER", env.get("ASYNCPIN_REDIS_CLUSTER", "0"))
    if redis_timeout_s is None:
        redis_timeout_s = _seconds(
            "ASYNCPIN_REDIS_TIMEOUT_S",
            env.get("ASYNCPIN_REDIS_TIMEOUT_S", str(DEFAULT_REDIS_TIMEOUT_S)),
        )
    if redis_namespace is None:
        redis_namespace = env.get("ASYNCPIN_REDIS_NAMESPACE") or DEFAULT_REDIS_NAMESPACE
    if model is None:
        model = env.get("ASYNCPIN_MODEL", "")
    metrics = CollectorRegistry() if registry is None else registry
    backing: Backing = "shared" if shared_name else "anonymous"

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # A new manager (and tier) per start-up: each can be entered only once.
        kv_caches: list[torch.Tensor] = []
        layout: KVLayout | None = None
        num_host_blocks: int | None = None
        if url is not None:
            kv_caches = example_kv_caches()
            layout = KVLayout.from_tensors(kv_caches, block_dim=1)
            # Checked by the manager: a buffer too small for one block is a ConfigError.
            num_host_blocks = nbytes // layout.host_block_bytes
        manager = OffloadManager(
            nbytes,
            backend=backend,
            backing=backing,
            name=shared_name,
            chunk_bytes=chunk_bytes,
            kv_layout=layout,
            num_host_blocks=num_host_blocks,
        )
        tier: KVTier | None = None
        if url is not None:
            # No connection yet; a URL it cannot use is a ConfigError naming no secret.
            store = RedisStore(url, cluster=redis_cluster, timeout_s=redis_timeout_s)
            tier = KVTier(manager, remote=store, model=model, namespace=redis_namespace)
            app.state.kv_caches = kv_caches
        collectors: list[Collector] = [OffloadCollector(manager)]
        if tier is not None:
            collectors.append(TierCollector(tier))
        for collector in collectors:
            metrics.register(collector)
        try:
            async with manager:
                app.state.manager = manager
                if tier is None:
                    yield
                else:
                    # Entered after the manager, left before it: queued writes get the
                    # tier's flush deadline, the store's close as long again, all before
                    # the buffer is unpinned.
                    async with tier:
                        app.state.tier = tier
                        yield
        finally:
            for collector in reversed(collectors):
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
            "faulted_bytes": stats.faulted_bytes,
            "pinned_bytes": stats.pinned_bytes,
            "nbytes": stats.nbytes,
            "fraction": stats.pinned_fraction,
        }
        tier: KVTier | None = getattr(request.app.state, "tier", None)
        remote = tier.stats().remote if tier is not None else None
        if remote is not None:
            # A degraded remote tier does not make the server unready: it serves on from
            # the host. ``store`` names the server without credentials.
            body["remote"] = {
                "store": remote.store,
                "degraded": remote.degraded,
                "errors": remote.errors,
                "written_blocks": remote.written_blocks,
                "failed_writes": remote.failed_writes,
                "dropped_blocks": remote.dropped_blocks,
                "queued_blocks": remote.queued_blocks,
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
    parser = argparse.ArgumentParser(
        prog="python -m examples.server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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
        if _EARLY_SIGNALS:  # held since the first line: nothing was started
            name = signal.Signals(_EARLY_SIGNALS[0]).name
            print(f"{name} during start-up: exiting, nothing started", file=sys.stderr)
            return
        _Server(config, guard).run()


if __name__ == "__main__":
    main()
