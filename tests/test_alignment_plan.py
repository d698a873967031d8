"""The copy kernel runs only where every address it computes is word-aligned (no GPU needed).

The kernel moves 8-byte words. On device arrays that start a few bytes into a larger
buffer (112-byte blocks 5 bytes in, as SGLang's host-pool tests lay them out) pack and
kernel would fault with cudaErrorMisalignedAddress, which poisons the CUDA context for
the rest of the process. ``kernel_misalignment`` decides it from addresses alone; the
engine, made here with a stand-in runtime over CPU tensors, then never picks the kernel
for such a layout: ``auto`` is batch, and an explicit pack or kernel runs as batch.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
from structlog.testing import capture_logs

from asyncpin import KVLayout, Transfer
from asyncpin.engines.cuda import KERNEL_WORD, CudaTransferEngine, kernel_misalignment
from asyncpin.errors import BackendCallError
from asyncpin.transfers import TransferJob
from tests.cuda_engine_cpu import cpu_engine, offset_layout

PAGE = 4096
BASE = 1 << 40  # a page-aligned region


def _verdict(
    ptrs: list[int], strides: list[int], block: int, hosts: list[int] | None = None
) -> str | None:
    return kernel_misalignment(
        array_ptrs=ptrs,
        array_strides=strides,
        array_bytes=[block] * len(ptrs),
        host_bases=hosts if hosts is not None else [BASE],
    )


class TestKernelMisalignment:
    @pytest.mark.parametrize("offset", [0, 8, 16, 64, 4096])
    def test_aligned_arrays_run_the_kernel(self, offset: int) -> None:
        # K and V of two layers, 112-byte blocks, each array 4 blocks past the last.
        ptrs = [BASE + offset + a * 4 * 112 for a in range(4)]
        assert _verdict(ptrs, [112] * 4, 112) is None

    @pytest.mark.parametrize("offset", [1, 2, 3, 4, 5, 6, 7, 12])
    def test_arrays_off_the_word_do_not(self, offset: int) -> None:
        ptrs = [BASE + offset + a * 4 * 112 for a in range(4)]
        why = _verdict(ptrs, [112] * 4, 112)
        assert why is not None and "device array 0's address" in why
        assert f"{KERNEL_WORD}-byte word" in why

    def test_one_misaligned_array_among_aligned_ones(self) -> None:
        ptrs = [BASE, BASE + 1024, BASE + 2048 + 5, BASE + 4096]
        why = _verdict(ptrs, [112] * 4, 112)
        assert why is not None and "device array 2's address" in why

    @pytest.mark.parametrize("stride", [113, 116, 120 + 4])
    def test_block_strides_off_the_word(self, stride: int) -> None:
        why = _verdict([BASE, BASE + PAGE], [stride, stride], 112)
        assert why is not None and "device array 0's block stride" in why

    @pytest.mark.parametrize("block", [100, 113, 1, 6])
    def test_blocks_not_whole_words(self, block: int) -> None:
        # Host blocks (and staging slots) would start off the word as well, and the kernel
        # would leave each block's tail behind.
        why = _verdict([BASE, BASE + PAGE], [128, 128], block)
        assert why is not None and "block size" in why

    def test_host_blocks_of_five_112_byte_blocks(self) -> None:
        # 560-byte host blocks: every host block and staging slot starts on a word.
        assert _verdict([BASE + 256 * a for a in range(5)], [112] * 5, 112) is None

    def test_host_bases_off_the_word(self) -> None:
        why = _verdict([BASE], [112], 112, hosts=[BASE, BASE + 16, BASE + 20])
        assert why is not None and "host base 2" in why

    @pytest.mark.parametrize("seed", range(20))
    def test_exact_against_every_address_the_kernel_computes(self, seed: int) -> None:
        """The verdict is 'safe' exactly when every word address the kernel would read or
        write, on the device and on the host side, is aligned and blocks are whole words."""
        rng = random.Random(seed)
        word = rng.choice([2, 4, 8])
        arrays = rng.randint(1, 3)
        block = rng.choice([word, 2 * word, 3 * word, 112, 100, 6, 5 * word + 2])
        ptrs = [BASE + rng.choice([0, 0, 1, 2, 4, 5, 8]) + 1000 * word * a for a in range(arrays)]
        strides = [block + rng.choice([0, 0, word, 1, 2, 4]) for _ in range(arrays)]
        hosts = [BASE + rng.choice([0, 0, 2, 4, 16]) for _ in range(2)]
        words = range(0, block - block % word, word)
        addresses = [
            p + g * s + k
            for (p, s), g, k in itertools.product(zip(ptrs, strides, strict=True), range(3), words)
        ] + [
            h + (c * arrays + a) * block + k
            for h, c, a, k in itertools.product(hosts, range(3), range(arrays), words)
        ]
        safe = block % word == 0 and all(x % word == 0 for x in addresses)
        verdict = kernel_misalignment(
            array_ptrs=ptrs,
            array_strides=strides,
            array_bytes=[block] * arrays,
            host_bases=hosts,
            word=word,
        )
        assert (verdict is None) == safe, verdict


# -- the engine's choice ---------------------------------------------------------------


@contextmanager
def _engine(
    monkeypatch: pytest.MonkeyPatch, layout: KVLayout, *, host_registered: bool = True
) -> Iterator[CudaTransferEngine]:
    """The engine as the manager makes it, with a stand-in runtime and copy kernel; its
    lanes have pack staging."""
    made = cpu_engine(monkeypatch, layout, kernel=object(), host_registered=host_registered)
    with made as engine:
        lanes: dict[Any, Any] = {d: SimpleNamespace(staging=object()) for d in ("store", "load")}
        engine._lanes = lanes
        yield engine


def _job(method: Any, blocks: int = 100, direction: Any = "store") -> TransferJob:
    ids = list(range(blocks))
    return TransferJob(Transfer(direction, blocks, blocks * 448), ids, ids, method)


class TestEngineChoice:
    @pytest.mark.parametrize("offset", [1, 2, 4, 5])
    @pytest.mark.parametrize("direction", ["store", "load"])
    async def test_offset_arrays_never_run_the_kernel(
        self, monkeypatch: pytest.MonkeyPatch, offset: int, direction: str
    ) -> None:
        """112-byte blocks ``offset`` bytes into a buffer: auto was pack (a fault on the
        device); now every method runs as batch, and the fallback is logged."""
        layout = offset_layout(offset, 112)
        assert layout.arrays[0].data_ptr() % KERNEL_WORD == offset % KERNEL_WORD
        with capture_logs() as logs, _engine(monkeypatch, layout) as engine:
            assert engine.methods() == ("batch", "pack", "kernel")
            for method in ("auto", "pack", "kernel", "batch", "pack"):
                for blocks in (100, 1):  # the large and the small path
                    job = _job(method, blocks, direction)
                    assert engine._choose(job, pageable=False) == "batch", (method, blocks)
        events = [e for e in logs if e["event"].startswith("transfer.")]
        assert [e["event"] for e in events] == [
            "transfer.kernel_disabled",
            "transfer.method_fallback",
            "transfer.method_fallback",
        ]
        assert "device array 0's address" in events[0]["reason"]
        assert [e["requested"] for e in events[1:]] == ["pack", "kernel"]

    async def test_a_kernel_the_runtime_cannot_load_runs_as_batch(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The load failed (a driver too old for the PTX, say): the methods offered at
        construction run as batch, and the first request of each says why."""
        failure = BackendCallError("cudaLibraryLoadData", 218, "cudaErrorInvalidPtx", "bad")
        layout = offset_layout(0, 112)
        with capture_logs() as logs, cpu_engine(monkeypatch, layout, kernel=failure) as engine:
            assert engine.methods() == ("batch", "pack", "kernel")
            assert engine._copies.kernel is None
            for method in ("auto", "pack", "kernel", "pack"):
                for blocks in (100, 1):
                    assert engine._choose(_job(method, blocks), pageable=False) == "batch"
        events = [e for e in logs if e["event"].startswith("transfer.")]
        assert [(e["event"], e.get("requested")) for e in events] == [
            ("transfer.kernel_disabled", None),  # said at once: auto falls back too
            ("transfer.method_fallback", "pack"),
            ("transfer.method_fallback", "kernel"),
        ]
        for event in events:
            assert "could not be loaded" in event["reason"]
            assert "cudaErrorInvalidPtx" in event["reason"]

    @pytest.mark.parametrize("block", [100, 113])
    async def test_blocks_not_whole_words_run_as_batch(
        self, monkeypatch: pytest.MonkeyPatch, block: int
    ) -> None:
        with _engine(monkeypatch, offset_layout(0, block)) as engine:
            assert engine.methods() == ("batch", "pack", "kernel")
            for method in ("auto", "pack", "kernel"):
                assert engine._choose(_job(method), pageable=False) == "batch"

    async def test_host_memory_cuda_did_not_register_never_goes_by_kernel(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # A pin backend that only locks memory (host, or one of your own): the copy kernel
        # would read host addresses the device cannot reach; it runs as pack, said once.
        layout = offset_layout(0, 112)
        with capture_logs() as logs, _engine(monkeypatch, layout, host_registered=False) as engine:
            assert engine._choose(_job("kernel"), pageable=False) == "pack"
            assert engine._choose(_job("kernel", 1), pageable=False) == "pack"
            assert engine._choose(_job("auto", 1), pageable=False) == "batch"
            assert engine._choose(_job("auto"), pageable=False) == "pack"
        events = [e for e in logs if e["event"] == "transfer.method_fallback"]
        assert len(events) == 1 and "register" in events[0]["reason"]

    @pytest.mark.parametrize("offset", [0, 8, 64])
    async def test_aligned_arrays_keep_the_kernel(
        self, monkeypatch: pytest.MonkeyPatch, offset: int
    ) -> None:
        layout = offset_layout(offset, 112)
        with capture_logs() as logs, _engine(monkeypatch, layout) as engine:
            assert engine._choose(_job("auto"), pageable=False) == "pack"
            assert engine._choose(_job("auto", 1), pageable=False) == "kernel"  # a run
            scattered = _job("auto", 2)
            scattered.gpu_ids = [5, 3]
            assert engine._choose(scattered, pageable=False) == "batch"
            assert engine._choose(_job("pack"), pageable=False) == "pack"
            assert engine._choose(_job("kernel"), pageable=False) == "kernel"
            assert engine._choose(_job("pack"), pageable=True) == "batch"
        assert not [e for e in logs if e["event"].startswith("transfer.")]
