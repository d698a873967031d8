"""The two seams of asyncpin, with their contracts: a pin backend (how host memory is
page-locked) and a transfer engine (how KV blocks move). ``asyncpin.testing`` has a
fake of each and the conformance checks ``check_pin_backend`` and
``check_transfer_engine`` that the real ones pass; a new backend or engine passes them
too before a manager uses it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from asyncpin.kv import KVLayout
    from asyncpin.transfers import TransferJob

__all__ = ["EngineFactory", "EngineSetup", "PinBackend", "TransferEngine"]


@runtime_checkable
class PinBackend(Protocol):
    """Page-locks and releases spans of the host region, one chunk per call.

    Contract:

    - ``pin`` and ``unpin`` are called from worker threads, never from the event loop,
      and may block for as long as the platform takes. At most ``pin_threads`` calls run
      at once, and none while the manager's pause gate is held.
    - ``pin(address, nbytes)`` takes a page-aligned span of at most ``max_pin_bytes``
      inside the region, never one already pinned. It returns once the span is pinned,
      or raises :class:`~asyncpin.errors.BackendCallError` (with ``code`` and
      ``code_name``) having pinned nothing of it.
    - ``unpin(address, nbytes)`` is called once for each span whose ``pin`` returned,
      with the same arguments, while the span is still mapped, and after every transfer
      that touches it has finished. If it raises, the span stays mapped for the rest of
      the process (it is never freed under the device).
    - ``preflight(nbytes)`` is called before anything is mapped, in the worker thread
      that then maps the region (off the event loop); it must be quick and raise
      :class:`~asyncpin.errors.PreflightError` if pinning ``nbytes`` more cannot
      succeed.
    - Optional: a class attribute ``registers_with_cuda = True`` says that what ``pin``
      pinned is registered with CUDA (``cuMemHostRegister``), so that device code may
      read and write it (:class:`~asyncpin.cuda.CudaBackend` sets it). Without it, the
      CUDA engine moves pinned blocks by DMA only.
    - Optional: a method ``warm_up()``, called once per manager in a pin worker
      thread, through the pause gate, before anything is prefaulted or pinned and
      before a KV engine's background set-up begins: for what the backend makes on
      first use (the ``cuda`` backend's own context: 0.11-0.14 s made alone on the
      H200, up to 1.5 s beside prefaulting or the engine's first set-up). It must be a
      plain method; whatever it raises is logged as ``pin.warm_up_failed`` and pinning
      goes on (the ``pin`` calls report what still fails). It is not called when the
      manager closes (its pipeline stops) first. Like ``pin`` and ``unpin``, it must not
      take ``pinning_paused()`` or ``capture_gate()`` (refused: LifecycleError) nor
      close its manager.
    - Optional: a method ``before_unpin()``, called once per close in a worker thread,
      through the pause gate, before the first ``unpin`` (when something was pinned):
      for a backend whose unpin does not itself wait for device work that code outside
      the manager may have queued on the memory (the ``cuda`` backend, registering from
      a context of its own, waits for the device there). It must be a plain method (a
      manager refuses anything else with ConfigError when it is made). Whatever it
      raises, the close logs ``unpin.wait_failed`` and unpins; whatever ``unpin``
      raises, that span is leaked and the others are still unpinned.
    """

    @property
    def name(self) -> str: ...

    @property
    def max_pin_bytes(self) -> int:
        """The largest span one :meth:`pin` call may take; chunks are cut to fit."""
        ...

    def preflight(self, nbytes: int) -> None: ...

    def pin(self, address: int, nbytes: int) -> None: ...

    def unpin(self, address: int, nbytes: int) -> None: ...


@dataclass(frozen=True, eq=False)
class EngineSetup:
    """What a transfer engine is made from, when the manager opens."""

    #: The device-side KV arrays.
    layout: KVLayout
    #: ``[num_host_blocks, host_block_bytes]`` uint8 over the host region (block-major:
    #: array ``a`` of host block ``c`` at row ``c``, byte ``array_offsets[a]``). Rows are
    #: ``stride(0)`` bytes apart (more than a host block when ranks share the region:
    #: ``host_slice``); its storage starts at the region's start, where chunks start.
    host_blocks: torch.Tensor
    #: The region is registered in spans of this many bytes, from its start: one DMA
    #: must not cross a span boundary.
    chunk_bytes: int
    #: Starts ``fn(*args)`` as a task of the manager (asyncio task or trio system task)
    #: on the event loop; the manager cancels what is left of them at close, after every
    #: submitted job has finished. Call it from the event loop thread only.
    start_soon: Callable[..., object]
    #: Whether pinned chunks are registered with the device's driver (the ``cuda``
    #: backend's registration), so that device code may read and write them
    #: through unified addressing: the manager sets it from the backend's
    #: ``registers_with_cuda``. False (the default) with a backend that only locks them
    #: (``host``, or one of your own that does not say so): copies of such chunks must
    #: then be DMAs.
    host_registered: bool = False
    #: The event loop the manager runs on, as ``anyio.lowlevel.current_token()`` gives
    #: it there: set by the manager (and by ``check_transfer_engine``), for an engine
    #: made off the loop (``made_off_loop``), which cannot ask the loop it is not on.
    #: A setup of your own may leave it None.
    loop: Any = None


@runtime_checkable
class TransferEngine(Protocol):
    """Runs validated transfer jobs between the KV arrays and the host blocks.

    Contract:

    - Made on the event loop from an :class:`EngineSetup`, while the manager enters; or,
      when the ``engine=`` factory sets ``made_off_loop = True`` (a class attribute of
      an engine class), in a worker thread while the entry waits, so that a construction
      of some milliseconds does not hold the loop: such an engine must not call the
      event loop's API from that thread, but may reach the loop through ``setup.loop``
      (``anyio.from_thread.run_sync(fn, token=setup.loop)``). A wrapper of such a class
      (a lambda, a ``partial``) is made on the loop unless it sets the attribute too.
      Then ``prepare()`` is called once, in a worker thread: it allocates device
      resources and loads kernels, so that nothing of it happens mid-serving. No
      ``submit()`` comes before it has returned (but pageable jobs, below);
      ``methods()`` and ``record_ready()`` may. By default the manager's entry waits for
      it; an engine whose class sets ``prepare_in_background = True`` is prepared after
      entry, in the pin pipeline's start (after the pin backend's ``warm_up()``; the
      region is faulted in and pinned once it returns, or after half a second if it has
      not): transfers submitted meanwhile wait for it, and
      ``mgr.pinned`` includes it (its error, if it fails). One that also sets
      ``pageable_before_prepare = True`` takes ``submit(job, pageable=True)`` before
      ``prepare()`` has returned (or while it runs): under the ``"pageable"`` policy
      such a job goes at once instead of waiting for a set-up that ``pinning_paused()``
      may hold back.
    - ``submit(job, pageable=...)`` is called on the event loop thread and never blocks
      it. It either raises, having queued nothing (the job is then not the engine's),
      or takes the job: it sets ``job.transfer.method`` and ``job.transfer.path``
      before returning, and calls ``job.finish(error)`` exactly once, on the event loop
      thread, when the copy is over: no device work of it is queued any more and no
      buffer it touches is used again. ``error`` is None on success, or the exception as
      raised (the router turns it into a :class:`~asyncpin.errors.TransferError`).
    - The copy waits for the work queued on the caller's current stream at ``submit``
      (or, when ``job.ready`` is set, at the ``record_ready()`` call that made it).
      Pinned jobs of one direction (``store``, ``load``) complete in submission order,
      and a later job to the same block wins; a store and a load may overlap.
    - A job copies block ``job.gpu_ids[i]`` of every array, or of the arrays in
      ``job.arrays`` when it is set (a range of consecutive arrays), to or from host
      block ``job.cpu_ids[i]``, byte for byte as the blocks lie (``EngineSetup``).
    - ``pageable=True``: some host block of the job is not pinned yet; the engine copies
      through pageable memory (the host may wait) and calls ``job.reserve()`` first when
      it is set.
    - An engine may define ``check_caller(direction)``: called on the event loop before
      a job is made of a call, it raises to refuse the caller's context (the CUDA
      engine's LifecycleError: a graph capture on the caller's current stream).
    - ``close()`` is called once, in a worker thread, after every job it took has
      finished and the manager's tasks have ended; it releases threads, streams and
      device memory and drops its views of the host blocks. Nothing is called after.
    """

    name: str

    def methods(self) -> tuple[str, ...]:
        """The methods a transfer may ask for by name (besides ``auto``)."""
        ...

    def prepare(self) -> None: ...

    def record_ready(self) -> Any:
        """A marker of the work queued so far on the caller's current stream (None where
        there are no streams), for a job submitted later (``job.ready``)."""
        ...

    def submit(self, job: TransferJob, *, pageable: bool) -> None: ...

    def close(self) -> None: ...


#: ``engine=`` of a manager: a callable that makes an engine from its setup (an engine
#: class is one).
EngineFactory = Callable[[EngineSetup], TransferEngine]
