"""fuser/bytecode.py: the imported modules Python had to compile at this start (no cached
bytecode), by package, and the line `fuser serve` prints under its cold-start table."""

from __future__ import annotations

import compileall
import importlib
import sys
from pathlib import Path

import pytest

from fuser.bytecode import uncached_modules


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A package `bcpkg` (two modules, one in a subpackage) importable from tmp_path, its
    bytecode never written by the import; removed from sys.modules after."""
    root = tmp_path / "bcpkg"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("X = 1\n")
    (root / "sub" / "__init__.py").write_text("")
    (root / "sub" / "mod.py").write_text("Y = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    yield root
    for name in [n for n in sys.modules if n == "bcpkg" or n.startswith("bcpkg.")]:
        del sys.modules[name]


def test_modules_imported_without_bytecode_are_counted_by_package(package: Path) -> None:
    importlib.import_module("bcpkg.sub.mod")
    assert uncached_modules().counts.get("bcpkg") == 3
    found = uncached_modules({n: m for n, m in sys.modules.items() if n.startswith("bcpkg")})
    assert found.counts.get("bcpkg") == 3  # bcpkg, bcpkg.sub, bcpkg.sub.mod
    assert found.directories["bcpkg"] == [str(package)]  # (the subpackage lies under it)
    note = found.note()
    assert note is not None and "bcpkg 3" in note and f"compileall -q {package}" in note


def test_compiled_modules_are_not_counted(package: Path) -> None:
    assert compileall.compile_dir(str(package), quiet=1)
    importlib.import_module("bcpkg.sub.mod")
    assert "bcpkg" not in uncached_modules().counts


def test_modules_without_a_source_file_are_left_out() -> None:
    class Module:  # a built-in or extension module: no .py source
        __file__ = "/somewhere/ext.so"

    found = uncached_modules({"ext": Module(), "builtin": object()})
    assert found.counts == {} and found.note() is None
