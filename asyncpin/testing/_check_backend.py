"""A conformance check of the :class:`~asyncpin.abc.PinBackend` contract."""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Awaitable, Callable, Sequence

import anyio
import anyio.to_thread

from asyncpin import _sys
from asyncpin.abc import PinBackend
from asyncpin.backends import HostBackend, call_hook, validate_hooks
from asyncpin.errors import BackendCallError, ConfigError, PreflightError
from asyncpin.region import Chunk, HostRegion

__all__ = ["check_pin_backend"]

_PROT_NONE = 0


def _counts_locked(backend: object) -> bool:
    """Whether pins of ``backend`` show in the process's locked bytes: a HostBackend, or
    a wrapper of one (``inner``)."""
    while backend is not None:
        if isinstance(backend, HostBackend):
            return True
        backend = getattr(backend, "inner", None)
    return False


async def check_pin_backend(
    backend: PinBackend,
    *,
    nbytes: int = 4 << 20,
    chunk_bytes: int = 3 << 19,
    pin_threads: int = 2,
    locked_bytes: bool | None = None,
    is_pinned: Callable[[int, int], bool] | None = None,
    unmapped_fails: bool = True,
) -> None:
    """Check that ``backend`` keeps the PinBackend contract; raise AssertionError naming
    the clause it broke.

    Maps a region of its own (``nbytes``), calls ``preflight`` on the event loop, pins the
    region in page-aligned spans of ``chunk_bytes`` (cut to ``max_pin_bytes``; the last
    span is shorter) from worker threads, ``pin_threads`` at a time, checks that they are
    pinned where it can tell, unpins each span once with the same arguments, checks that
    the pins are gone, and releases the region. A backend with the optional
    ``warm_up()`` has it called once before the pins, and one with ``before_unpin()``
    once before the unpins; neither may raise there.

    - ``locked_bytes``: pins show in the process's locked bytes (``VmLck``), which must
      grow by exactly the bytes pinned and come back after the unpins. None: true for
      :class:`~asyncpin.backends.HostBackend` and backends wrapping one (``inner``).
    - ``is_pinned(address, nbytes)``: a probe of one span, true after its pin and false
      after its unpin (for CUDA, ``cudaHostGetFlags``). Without either, the check can
      only see that the calls return.
    - ``unmapped_fails``: pinning a span that is not mapped raises
      :class:`~asyncpin.errors.BackendCallError` with ``code`` and ``code_name`` and
      pins nothing. Turn it off for a backend that cannot detect it.

    Every span whose pin returned is unpinned, on success or not; a span whose unpin
    raised stays mapped (leaked), as the contract requires.
    """
    if not isinstance(backend, PinBackend):
        raise AssertionError(f"{backend!r} does not implement the PinBackend protocol")
    name, max_pin = backend.name, backend.max_pin_bytes
    if not isinstance(name, str) or not name:
        raise AssertionError(f"backend.name must be a non-empty str, got {name!r}")
    page = _sys.PAGE_SIZE
    if isinstance(max_pin, bool) or not isinstance(max_pin, int) or max_pin < page:
        raise AssertionError(
            f"{name}: max_pin_bytes must be an int of at least one page ({page}), got {max_pin!r}"
        )
    span = min(chunk_bytes, max_pin) // page * page
    if span <= 0 or nbytes <= 0 or pin_threads <= 0:
        raise ValueError("nbytes, chunk_bytes and pin_threads must be positive")
    counting = _counts_locked(backend) if locked_bytes is None else locked_bytes

    _preflight(backend, name, nbytes)
    baseline = _sys.vm_locked_bytes()
    region = HostRegion.create(nbytes)
    chunks = region.chunks(span)
    pinned: list[Chunk] = []
    leaked: list[Chunk] = []
    try:
        try:
            validate_hooks(backend)
        except ConfigError as exc:
            raise AssertionError(f"{name}: {exc}") from exc
        error = await anyio.to_thread.run_sync(call_hook, backend, "warm_up")
        if error is not None:
            raise AssertionError(f"{name}: warm_up() raised {error!r} before any pin")

        async def pin(chunk: Chunk) -> None:
            address = region.address + chunk.offset
            await anyio.to_thread.run_sync(backend.pin, address, chunk.nbytes)
            pinned.append(chunk)

        await _each(name, "pin of a valid span of at most max_pin_bytes", pin, chunks, pin_threads)
        total = sum(chunk.nbytes for chunk in chunks)
        if counting:
            grown = _sys.vm_locked_bytes() - baseline
            if grown != total:
                raise AssertionError(
                    f"{name}: after pinning {total} bytes the process's locked bytes grew by "
                    f"{grown}: the spans are not pinned"
                )
        for chunk in chunks:
            if is_pinned is not None and not is_pinned(region.address + chunk.offset, chunk.nbytes):
                raise AssertionError(
                    f"{name}: pin returned but the span at offset {chunk.offset} is not pinned"
                )

        if unmapped_fails:
            await _check_failing_call(backend, name, counting)

        async def unpin(chunk: Chunk) -> None:
            try:
                await anyio.to_thread.run_sync(
                    backend.unpin, region.address + chunk.offset, chunk.nbytes
                )
            except Exception:
                pinned.remove(chunk)
                leaked.append(chunk)  # a span whose unpin raised stays mapped
                raise
            pinned.remove(chunk)

        error = await anyio.to_thread.run_sync(call_hook, backend, "before_unpin")
        if error is not None:
            raise AssertionError(f"{name}: before_unpin() raised {error!r} with spans pinned")
        await _each(name, "unpin of a pinned span", unpin, list(pinned), pin_threads)
        if counting:
            left = _sys.vm_locked_bytes() - baseline
            if left:
                raise AssertionError(
                    f"{name}: every span was unpinned but {left} of the {total} bytes pinned "
                    "are still locked: unpin did not release them"
                )
        for chunk in chunks:
            if is_pinned is not None and is_pinned(region.address + chunk.offset, chunk.nbytes):
                raise AssertionError(
                    f"{name}: unpin returned but the span at offset {chunk.offset} is still pinned"
                )
    finally:
        with anyio.CancelScope(shield=True):
            if pinned:
                await anyio.to_thread.run_sync(call_hook, backend, "before_unpin")
            for chunk in list(pinned):  # the check failed half way: undo what it can
                try:
                    await anyio.to_thread.run_sync(
                        backend.unpin, region.address + chunk.offset, chunk.nbytes
                    )
                except Exception:
                    leaked.append(chunk)
            region.release(keep=leaked)


async def _each(
    name: str,
    what: str,
    call: Callable[[Chunk], Awaitable[None]],
    chunks: Sequence[Chunk],
    workers: int,
) -> None:
    """Run ``call`` on every chunk, ``workers`` at a time, each worker taking the next
    chunk in order (so one worker goes in address order, whatever order the event loop
    wakes tasks in); raise AssertionError for the first chunk on which it raised
    (``what``: the call)."""
    failures: list[tuple[Chunk, Exception]] = []
    left = iter(chunks)

    async def worker() -> None:
        for chunk in left:
            try:
                await call(chunk)
            except Exception as exc:
                failures.append((chunk, exc))

    async with anyio.create_task_group() as tg:
        for _ in range(min(workers, len(chunks))):
            tg.start_soon(worker)
    if failures:
        chunk, exc = min(failures, key=lambda failure: failure[0].offset)
        raise AssertionError(
            f"{name}: {what} (offset {chunk.offset}, {chunk.nbytes} bytes) raised {exc!r}"
        ) from exc


def _preflight(backend: PinBackend, name: str, nbytes: int) -> None:
    """``preflight`` passes for the bytes the check pins, and for an impossible size
    either passes (nothing to check) or raises PreflightError, nothing else."""
    try:
        backend.preflight(nbytes)
    except PreflightError as exc:
        raise AssertionError(
            f"{name}: preflight refused the {nbytes} bytes this check pins (free memory or "
            f"raise the limit to run it): {exc}"
        ) from exc
    except Exception as exc:
        raise AssertionError(
            f"{name}: preflight({nbytes}) raised {exc!r}; it may raise PreflightError only"
        ) from exc
    try:
        backend.preflight(1 << 62)
    except PreflightError:
        pass
    except Exception as exc:
        raise AssertionError(
            f"{name}: preflight({1 << 62}) raised {exc!r}; it may raise PreflightError only"
        ) from exc


async def _check_failing_call(backend: PinBackend, name: str, counting: bool) -> None:
    """Pinning a page that is not mapped (a hole between two reserved pages, so that no
    other mapping lands there meanwhile) raises BackendCallError and pins nothing."""
    page = _sys.PAGE_SIZE
    guard = _sys.libc_mmap(3 * page, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    _sys.libc_munmap(guard + page, page)
    hole = guard + page
    try:
        before = _sys.vm_locked_bytes()
        try:
            await anyio.to_thread.run_sync(backend.pin, hole, page)
        except BackendCallError as exc:
            if isinstance(exc.code, bool) or not isinstance(exc.code, int) or not exc.code:
                raise AssertionError(
                    f"{name}: a failed pin raised BackendCallError with code {exc.code!r}; "
                    "it must carry the platform's error number"
                ) from exc
            if not isinstance(exc.code_name, str) or not exc.code_name:
                raise AssertionError(
                    f"{name}: a failed pin raised BackendCallError with code_name "
                    f"{exc.code_name!r}; it must name the error"
                ) from exc
        except Exception as exc:
            raise AssertionError(
                f"{name}: pinning an unmapped page raised {exc!r}, not BackendCallError"
            ) from exc
        else:
            with contextlib.suppress(Exception):
                await anyio.to_thread.run_sync(backend.unpin, hole, page)
            raise AssertionError(
                f"{name}: pinning an unmapped page returned; it must raise "
                "BackendCallError (pass unmapped_fails=False if the backend cannot tell)"
            )
        if counting and _sys.vm_locked_bytes() != before:
            raise AssertionError(f"{name}: a pin that failed left bytes locked")
    finally:
        _sys.libc_munmap(guard, page)
        _sys.libc_munmap(guard + 2 * page, page)
