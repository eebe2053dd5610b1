"""C of our own, compiled at first use: a source next to this module becomes a shared library
in a cache directory, loaded with ctypes (no Python C API: one library serves every Python).

    library("suffix_native")   # runtime/suffix_native.c -> ctypes.CDLL, or None (one warning)

The compiler is $CC, else `cc`, else `gcc` (`-O2 -shared -fPIC`, no -march=native: a cache
on a shared disk serves other CPUs too; $FUSER_NATIVE_CFLAGS adds flags, e.g.
`-fsanitize=address -g` to check the C's memory accesses). The cache is $FUSER_CACHE_DIR, else
$XDG_CACHE_HOME/fuser, else ~/.cache/fuser (a `native/` directory in it); a library's name
holds a hash of its source, the compiler's version and the platform, so a machine compiles
each source once, and a changed source or compiler builds anew. The library is written to a
temporary file and renamed into place: concurrent processes (pytest-xdist workers, several
servers) may build at once and each loads a whole file.

Where no compiler is found or the build fails, `library` logs one warning naming why and
returns None; callers fall back to their numpy code. FUSER_NATIVE=0 turns native code off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["cache_dir", "enabled", "library", "unavailable"]

log = logging.getLogger("fuser")

_FLAGS = ["-O2", "-shared", "-fPIC", "-std=c99"]
_loaded: dict[str, ctypes.CDLL | None] = {}
_reasons: dict[str, str] = {}


def enabled() -> bool:
    """False where FUSER_NATIVE=0 (or "false", "off", "no") turns native code off."""
    return os.environ.get("FUSER_NATIVE", "1").strip().lower() not in ("0", "false", "off", "no")


def cache_dir() -> Path:
    """Where compiled libraries are kept: $FUSER_CACHE_DIR, else $XDG_CACHE_HOME/fuser, else
    ~/.cache/fuser; the libraries in its native/ directory."""
    root = os.environ.get("FUSER_CACHE_DIR")
    if not root:
        root = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fuser")
    return Path(root) / "native"


def _compiler() -> list[str] | None:
    """The C compiler's command: $CC (it may hold arguments), else cc, else gcc."""
    cc = os.environ.get("CC", "").split()
    if cc:
        return cc if shutil.which(cc[0]) else None
    for name in ("cc", "gcc"):
        path = shutil.which(name)
        if path:
            return [path]
    return None


def _version(cc: list[str]) -> str:
    """The compiler's `--version` text (part of the cache key)."""
    try:
        run = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as error:
        return f"unknown ({error})"
    return run.stdout + run.stderr


def _build(name: str) -> ctypes.CDLL:
    """Compile (or find in the cache) and load runtime/<name>.c; raises RuntimeError with the
    reason where it cannot."""
    source = Path(__file__).with_name(f"{name}.c")
    try:
        text = source.read_bytes()
    except OSError as error:
        raise RuntimeError(f"its source {source} cannot be read ({error})") from None
    cc = _compiler()
    if cc is None:
        wanted = os.environ.get("CC") or "cc or gcc"
        raise RuntimeError(f"no C compiler found ({wanted} is not on PATH)")
    flags = _FLAGS + os.environ.get("FUSER_NATIVE_CFLAGS", "").split()
    key = hashlib.sha256(b"\0".join([
        text, _version(cc).encode(), " ".join(cc + flags).encode(),
        f"{sys.platform} {platform.machine()} {ctypes.sizeof(ctypes.c_void_p)}".encode(),
    ])).hexdigest()[:20]
    suffix = ".dll" if sys.platform == "win32" else ".so"
    directory = cache_dir()
    path = directory / f"{name}-{key}{suffix}"
    if not path.exists():
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise RuntimeError(f"the cache directory {directory} cannot be made ({error})") \
                from None
        handle, temporary = tempfile.mkstemp(prefix=f".{name}-", suffix=suffix, dir=directory)
        os.close(handle)
        try:
            run = subprocess.run([*cc, *flags, "-o", temporary, str(source)],
                                 capture_output=True, text=True, timeout=300)
            if run.returncode != 0:
                lines = (run.stderr or run.stdout).strip().splitlines()
                raise RuntimeError(f"{' '.join(cc)} failed (exit {run.returncode})"
                                   + (f": {lines[-1]}" if lines else ""))
            os.replace(temporary, path)  # atomic: others see no file or a whole one
        except (OSError, subprocess.SubprocessError) as error:
            raise RuntimeError(f"{' '.join(cc)} could not run ({error})") from None
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
    try:
        return ctypes.CDLL(str(path))
    except OSError as error:
        raise RuntimeError(f"{path} cannot be loaded ({error})") from None


def library(name: str) -> ctypes.CDLL | None:
    """runtime/<name>.c compiled and loaded (once a process), or None: native code turned off
    (FUSER_NATIVE=0) or not built (one warning a process says why; `unavailable` too)."""
    if not enabled():
        _reasons[name] = "FUSER_NATIVE=0"
        return None  # (not cached: the variable may change)
    if name in _loaded:
        return _loaded[name]
    try:
        lib = _build(name)
    except RuntimeError as error:
        _reasons[name] = str(error)
        log.warning("fuser: runtime/%s.c not built, numpy used instead: %s", name, error)
        lib = None
    _loaded[name] = lib
    return lib


def unavailable(name: str) -> str | None:
    """Why `library(name)` returned None (None: it did not, or was not asked)."""
    if not enabled():
        return "FUSER_NATIVE=0"
    return None if _loaded.get(name) is not None else _reasons.get(name)
