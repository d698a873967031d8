"""Describing KV arrays: ``KVLayout.from_tensors`` and ``OffloadManager.for_kv`` accept the
engines' layouts and refuse inconsistent descriptions with a ConfigError that names the
mistake; a KV manager pins for its layout's device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from asyncpin import (
    ConfigError,
    KVLayout,
    OffloadManager,
)
from asyncpin.testing import FakeBackend
from tests.kit import (
    PAGE,
)

pytestmark = pytest.mark.anyio


def _tensors_of(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float16) -> list[torch.Tensor]:
    return [torch.ones(shape, dtype=dtype) for shape in shapes]


BAD_LAYOUTS: list[tuple[str, Callable[[], KVLayout], tuple[str, ...]]] = [
    ("empty list", lambda: KVLayout.from_tensors([]), ("at least one",)),
    (
        "not a tensor",
        lambda: KVLayout.from_tensors([torch.ones(4, 8), [1, 2]]),  # type: ignore[list-item]
        ("tensor 1", "list"),
    ),
    (
        "device",
        lambda: KVLayout.from_tensors([torch.ones(4, 8), torch.empty(4, 8, device="meta")]),
        ("device", "meta"),
    ),
    (
        "number of blocks",
        lambda: KVLayout.from_tensors(_tensors_of((4, 8), (5, 8))),
        ("number of blocks", "5"),
    ),
    (
        "number of blocks, joined",
        lambda: KVLayout.from_tensors(_tensors_of((2, 4, 8), (2, 6, 8)), block_dim=1),
        ("number of blocks",),
    ),
    (
        "transposed",
        lambda: KVLayout.from_tensors([torch.ones(8, 4).t()]),
        ("densely",),
    ),
    (
        "transposed joined",
        lambda: KVLayout.from_tensors([torch.ones(2, 8, 4).transpose(1, 2)], block_dim=1),
        ("densely",),
    ),
    (
        "overlapping blocks",
        lambda: KVLayout.from_tensors([torch.ones(16).as_strided((4, 8), (1, 1))]),
        ("densely",),
    ),
    (
        "block_dim past the end",
        lambda: KVLayout.from_tensors(_tensors_of((4, 8)), block_dim=2),
        ("block_dim=2", "out of range"),
    ),
    (
        "block_dim negative",
        lambda: KVLayout.from_tensors(_tensors_of((4, 8)), block_dim=-1),
        ("block_dim=-1",),
    ),
    (
        "block_dim of a 0-d tensor",
        lambda: KVLayout.from_tensors([torch.tensor(1.0)]),
        ("block_dim=0",),
    ),
    (
        "empty blocks",
        lambda: KVLayout.from_tensors(_tensors_of((4, 0))),
        ("non-empty",),
    ),
]


class TestBadLayout:
    """KVLayout and OffloadManager.for_kv refuse inconsistent KV descriptions (ConfigError)."""

    @pytest.mark.parametrize(
        ("make", "words"), [c[1:] for c in BAD_LAYOUTS], ids=[c[0] for c in BAD_LAYOUTS]
    )
    def test_from_tensors_refuses(
        self, make: Callable[[], KVLayout], words: tuple[str, ...]
    ) -> None:
        with pytest.raises(ConfigError) as info:
            make()
        for word in words:
            assert word in str(info.value), f"{word!r} not in {str(info.value)!r}"

    def test_from_tensors_refuses_zero_blocks(self) -> None:
        with pytest.raises(ConfigError, match="at least one non-empty block"):
            KVLayout.from_tensors([torch.ones(0, 8)])

    def test_layouts_describe_the_arrays(self) -> None:
        joined = KVLayout.from_tensors(_tensors_of((2, 6, 4, 8), (2, 6, 4, 8)), block_dim=1)
        assert (joined.num_arrays, joined.num_blocks, joined.block_shape) == (4, 6, (4, 8))
        assert joined.block_bytes == 64 and joined.host_block_bytes == 256
        major = KVLayout.from_tensors(_tensors_of((6, 2, 4, 8)))
        assert (major.num_arrays, major.num_blocks, major.block_shape) == (1, 6, (2, 4, 8))
        single = KVLayout.from_tensors(torch.ones(6, 8, dtype=torch.float32))  # type: ignore[arg-type]
        assert (single.num_arrays, single.dtype, single.host_block_bytes) == (1, torch.float32, 32)

    @pytest.mark.parametrize(
        "num_host_blocks", [0, -1, True, False, 2.0, None, torch.tensor(4), torch.tensor(True)]
    )
    def test_for_kv_refuses_bad_num_host_blocks(self, num_host_blocks: Any) -> None:
        layout = KVLayout.from_tensors(_tensors_of((4, 8)))
        with pytest.raises(ConfigError, match="num_host_blocks"):
            OffloadManager.for_kv(layout, num_host_blocks, backend=FakeBackend())

    def test_an_int_whose_comparisons_lie_is_taken_for_what_it_is(self) -> None:
        """A hostile trial: an int subclass that says it is never below 1 (0 made an
        index with no room). The count is the plain int it is."""
        from asyncpin.tier import BlockIndex

        class Lying(int):
            def __lt__(self, other: object) -> bool:
                return False

            def __gt__(self, other: object) -> bool:
                return False

        layout = KVLayout.from_tensors(_tensors_of((4, 8)))
        with pytest.raises(ConfigError, match="num_host_blocks"):
            OffloadManager.for_kv(layout, Lying(0), backend=FakeBackend())
        with pytest.raises(ConfigError, match="num_host_blocks"):
            BlockIndex(Lying(0))
        index = BlockIndex(Lying(3))
        assert type(index.num_host_blocks) is int and index.num_host_blocks == 3

    async def test_for_kv_takes_numpy_integers(self) -> None:
        """Any integer type counts as blocks (a newcomer's trial: np.int64(4) was refused
        as 'must be an int', although block ids take NumPy's)."""
        import numpy as np

        layout = KVLayout.from_tensors(_tensors_of((4, 8)))
        integers: list[Any] = [np.int64(4), np.uint16(4)]
        for blocks in integers:
            async with OffloadManager.for_kv(layout, blocks, backend=FakeBackend()) as mgr:
                assert mgr.num_host_blocks == 4 and type(mgr.num_host_blocks) is int

    def test_kv_layout_and_num_host_blocks_go_together(self) -> None:
        layout = KVLayout.from_tensors(_tensors_of((4, 8)))
        with pytest.raises(ConfigError, match="together"):
            OffloadManager(PAGE, backend=FakeBackend(), kv_layout=layout)
        with pytest.raises(ConfigError, match="together"):
            OffloadManager(PAGE, backend=FakeBackend(), num_host_blocks=4)
        with pytest.raises(ConfigError, match="num_host_blocks"):
            OffloadManager(PAGE, backend=FakeBackend(), kv_layout=layout, num_host_blocks=0)
        with pytest.raises(ConfigError, match="do not fit"):
            OffloadManager(PAGE, backend=FakeBackend(), kv_layout=layout, num_host_blocks=1000)
        with pytest.raises(ConfigError, match="KVLayout"):
            OffloadManager(
                PAGE,
                backend=FakeBackend(),
                kv_layout=object(),  # type: ignore[arg-type]
                num_host_blocks=4,
            )
        with pytest.raises(ConfigError, match="unpinned_policy"):
            OffloadManager.for_kv(
                layout,
                4,
                backend=FakeBackend(),
                unpinned_policy="sometimes",
            )

    def test_arrays_on_an_unsupported_device(self) -> None:
        # Refused before anything is mapped (tests/test_engine_choice.py, every engine).
        layout = KVLayout.from_tensors([torch.empty(4, 8, device="meta")])
        with pytest.raises(ConfigError, match="meta"):
            OffloadManager.for_kv(layout, 4, backend=FakeBackend())


class TestPinDevice:
    """A KV manager pins for its layout's GPU, not whichever device is current."""

    @pytest.mark.parametrize(("given", "expected"), [({}, 1), ({"device": 0}, 0)])
    def test_for_kv_resolves_the_backend_for_the_layout_device(
        self, monkeypatch: pytest.MonkeyPatch, given: dict[str, int], expected: int
    ) -> None:
        asked: list[int | None] = []

        def resolve(backend: Any, device: int | None = None) -> FakeBackend:
            asked.append(device)
            return FakeBackend()

        monkeypatch.setattr("asyncpin.manager.resolve_backend", resolve)
        layout = dataclasses.replace(
            KVLayout.from_tensors([torch.ones(4, 8)]), device=torch.device("cuda", 1)
        )
        OffloadManager.for_kv(layout, 2, backend="cuda", **given)
        assert asked == [expected]
