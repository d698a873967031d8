"""Block ids as engines keep them: NumPy arrays and NumPy integer scalars are taken like
lists of ints (the same checks, the same copy); other dtypes and shapes are refused."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import numpy as np
import pytest

from asyncpin import InvalidTransferError
from asyncpin.transfers import CheckedIds, block_ids


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8, np.uint32, np.intp])
def test_integer_arrays_are_ids(dtype: Any) -> None:
    ids = np.array([3, 0, 7], dtype=dtype)
    got = block_ids(ids, "gpu_block_ids", 8)
    assert got == [3, 0, 7] and all(type(v) is int for v in got)
    ids[0] = 5  # a copy: the caller may reuse its buffer at once
    assert got[0] == 3


def test_numpy_integer_scalars_in_a_list_are_ids() -> None:
    got = block_ids([np.int64(2), np.uint16(1), 4], "cpu_block_ids", 5)
    assert got == [2, 1, 4] and all(type(v) is int for v in got)


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        (np.array([1.0, 2.0]), "must be integers, got dtype float64"),
        (np.array([True, False]), "must be integers, got dtype bool"),
        (np.zeros((2, 2), dtype=np.int64), "must be 1-D, got shape"),
        (np.array([1, 8]), "holds 8, outside"),
        (np.array([-1, 2]), "holds -1, outside"),
        ([np.float64(1.0)], "must hold ints only"),
        ([np.bool_(True)], "must hold ints only"),
        # A masked entry has no value: tolist() gives None for it.
        (np.ma.masked_array([1, 2], mask=[False, True]), "must hold ints only"),
        (np.ma.masked_array([5], mask=[True]), "must hold ints only"),
    ],
)
def test_other_arrays_are_refused(ids: Any, match: str) -> None:
    with pytest.raises(InvalidTransferError, match=match):
        block_ids(ids, "ids", 8)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_manager_takes_numpy_ids(anyio_backend: str) -> None:
    import anyio
    import torch

    from asyncpin import KVLayout, OffloadManager
    from asyncpin.testing import FakeBackend

    array = torch.arange(8 * 16, dtype=torch.uint8).view(8, 16)
    with anyio.fail_after(10):
        async with OffloadManager.for_kv(
            KVLayout.from_tensors([array]), 4, backend=FakeBackend()
        ) as mgr:
            await mgr.pinned
            await mgr.store(np.array([5, 6], dtype=np.int32), np.array([0, 3]))
            assert torch.equal(mgr.host_blocks()[3, 0], array[6])
            await mgr.load(np.array([3], dtype=np.uint64), [np.int64(1)])
            assert torch.equal(array[1], array[6])


def test_checked_ids_are_checked_once_and_keep_their_bound() -> None:
    ids = CheckedIds(np.array([5, 2, 9], dtype=np.int32), "gpu_block_ids", 10)
    assert (tuple(ids), ids.bound, ids.unique) == ((5, 2, 9), 10, True)
    assert block_ids(ids, "gpu_block_ids", 10) == [5, 2, 9]
    with pytest.raises(InvalidTransferError, match=r"holds 9, outside \[0, 9\)"):
        block_ids(ids, "gpu_block_ids", 9)
    assert CheckedIds([1, 1], "x", 4).unique is False
    assert (CheckedIds([], "x", 4).bound, block_ids(CheckedIds([], "x", 4), "x", 0)) == (0, [])
    with pytest.raises(InvalidTransferError, match="outside"):
        CheckedIds([0, 4], "x", 4)


def test_checked_ids_cannot_be_forged_or_edited() -> None:
    """Only the constructor's check is trusted (review: bound and unique could be set,
    and ``tuple.__new__`` skipped the check, so -1 or an id past the end got through)."""
    ids = CheckedIds([1, 2], "x", 4)
    for name, value in (("bound", 0), ("unique", True), ("_checked", None), ("other", 1)):
        with pytest.raises(AttributeError):
            setattr(ids, name, value)
    with pytest.raises(AttributeError):
        del ids.bound
    forged = tuple.__new__(CheckedIds, [-1, 7])  # never checked
    assert (forged.bound, forged.unique) == (0, False)
    with pytest.raises(InvalidTransferError, match="-1"):
        block_ids(forged, "cpu_block_ids", 8)
    with pytest.raises(InvalidTransferError, match="must hold ints"):
        block_ids(tuple.__new__(CheckedIds, [0, "x"]), "cpu_block_ids", 8)


def test_a_copied_or_pickled_checked_ids_is_a_plain_tuple() -> None:
    ids = CheckedIds([3, 1], "x", 4)
    for twin in (pickle.loads(pickle.dumps(ids)), copy.deepcopy(ids), copy.copy(ids)):
        assert type(twin) is tuple and twin == (3, 1)
