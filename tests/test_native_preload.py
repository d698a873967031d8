"""Triton's native libraries are loaded through ctypes (the GIL let go) before Triton is
imported: the import's own load held the GIL for the dynamic loader's whole work."""

from __future__ import annotations

import ctypes
import ctypes.util
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from asyncpin.engines.cuda import methods


def _a_shared_library() -> str:
    name = ctypes.util.find_library("m")
    assert name is not None
    for folder in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64"):
        path = Path(folder) / name
        if path.exists():
            return str(path)
    pytest.skip(f"{name} not found in the usual folders")


def test_preload_loads_the_packages_libraries_without_importing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    native = tmp_path / "preloadpkg" / "_C"
    native.mkdir(parents=True)
    (tmp_path / "preloadpkg" / "__init__.py").write_text("raise RuntimeError('imported')\n")
    shutil.copy(_a_shared_library(), native / "libreal.so")
    (native / "broken.so").write_text("not a library")
    (native / "notes.txt").write_text("not a library either")
    monkeypatch.syspath_prepend(str(tmp_path))
    modes: list[int] = []
    real = ctypes.CDLL

    def recording(path: str, mode: int = 0, **kwargs: Any) -> ctypes.CDLL:
        modes.append(mode)
        return real(path, mode=mode, **kwargs)

    monkeypatch.setattr(ctypes, "CDLL", recording)
    loaded = methods.preload_native_libraries("preloadpkg")
    assert loaded == [str(native / "libreal.so")]
    assert modes == [sys.getdlopenflags()] * 2  # broken.so was tried, then left
    assert "preloadpkg" not in sys.modules


def test_preload_of_a_missing_package_loads_nothing() -> None:
    assert methods.preload_native_libraries("no_such_package_here") == []


def test_load_kernel_preloads_before_the_first_import(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(methods, "preload_native_libraries", lambda: calls.append("preload"))
    monkeypatch.delitem(sys.modules, "triton", raising=False)
    kernel = methods.load_kernel()
    assert calls == ["preload"]
    if "triton" in sys.modules:  # Triton is installed: the kernel came back
        assert kernel is not None
        calls.clear()
        methods.load_kernel()
        assert calls == []  # imported already: nothing to preload
    else:
        assert kernel is None
