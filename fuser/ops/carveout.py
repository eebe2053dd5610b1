"""One shared-memory carveout for every Triton kernel (an experiment for the FP8 verify step).

An H200 SM splits 256 KB between L1 and shared memory, per kernel: by default the driver picks
each kernel's split from the shared memory it asks for. The verify step (T = 5) alternates
kernels that ask different amounts: the several-row GEMV (its MMA operands staged in shared
memory, pipelined), the norm kernel that writes e4m3 pieces (little), attention's split kernel
and its combine. An SM changes its split only when idle, so at every
such boundary the next kernel cannot start on an SM the previous one still holds. That would
explain what the twenty-third session measured (benchmarks/RESULTS.md): 1.67 us between
kernels at 5 rows against -0.18 at one row, and PDL at 5 rows gaining nothing (the next
kernel's programs could not become resident early).

FUSER_SMEM_CARVEOUT=<0..100> (or `install(percent)`) sets CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_
MEMORY_CARVEOUT to that percent of the maximum on every Triton kernel loaded afterwards (fuser's
and Inductor's: a Triton kernel-load hook), so that they all keep one split. Unset: nothing
changes. The attribute is a preference the driver may override; it changes no result.

Measured on the H200 (benchmarks/RESULTS.md, twenty-fourth session): the guess does not hold.
A kernel boundary at 5 rows costs ~0.2 us with or without it (benchmarks/gap_lab.py), and at
100% the 8B FP8 decode step took 2.493 against 2.290 ms, the verify step no faster. Off.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import triton

__all__ = ["CARVEOUT_ATTRIBUTE", "carveout_from_env", "install", "installed_percent"]

CARVEOUT_ATTRIBUTE = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT (cuda.h)

_state: dict[str, Any] = {"percent": None, "driver": None, "done": set()}


def carveout_from_env() -> int | None:
    """FUSER_SMEM_CARVEOUT as a percent (None when unset or empty); another value raises."""
    value = os.environ.get("FUSER_SMEM_CARVEOUT", "").strip()
    if not value:
        return None
    if not value.isdigit() or not 0 <= int(value) <= 100:
        raise ValueError(f"FUSER_SMEM_CARVEOUT={value!r}: a percent of the maximum shared "
                         "memory, an integer from 0 to 100")
    return int(value)


def installed_percent() -> int | None:
    """The carveout `install` set (None: not installed)."""
    return _state["percent"]


def _driver() -> Any:
    if _state["driver"] is None:
        _state["driver"] = ctypes.CDLL("libcuda.so.1")
    return _state["driver"]


def _on_load(module: Any, function: Any, name: str, metadata_group: Any, hash: str) -> None:
    """Triton's kernel-load hook: set the carveout on the kernel just loaded (once a handle)."""
    percent = _state["percent"]
    if percent is None or not function or function in _state["done"]:
        return
    result = _driver().cuFuncSetAttribute(ctypes.c_void_p(function),
                                          ctypes.c_int(CARVEOUT_ATTRIBUTE), ctypes.c_int(percent))
    if result != 0:
        raise RuntimeError(f"cuFuncSetAttribute(carveout={percent}) on {name} failed: CUresult "
                           f"{result}")
    _state["done"].add(function)


def install(percent: int) -> None:
    """Every Triton kernel loaded from now on prefers `percent` of the maximum shared memory.
    Installing twice keeps one hook (the latest percent)."""
    if not 0 <= int(percent) <= 100:
        raise ValueError(f"carveout {percent}: a percent from 0 to 100")
    _state["percent"] = int(percent)
    runtime = triton.knobs.runtime
    if not hasattr(runtime, "kernel_load_end_hook"):  # a Triton without load hooks
        _patch_init_handles()
        return
    hook = runtime.kernel_load_end_hook
    if hasattr(hook, "add"):  # Triton's HookChain
        hook.add(_on_load)
    elif hook is None or hook is _on_load:
        triton.knobs.runtime.kernel_load_end_hook = _on_load
    else:  # another single hook: call both
        def both(*args: Any) -> None:
            hook(*args)
            _on_load(*args)

        triton.knobs.runtime.kernel_load_end_hook = both


def _patch_init_handles() -> None:
    from triton.compiler.compiler import CompiledKernel  # noqa: PLC0415

    original = CompiledKernel._init_handles
    if getattr(original, "_fuser_carveout", False):
        return

    def init_handles(self: Any) -> None:
        original(self)
        _on_load(self.module, self.function, self.name, None, "")

    init_handles._fuser_carveout = True  # type: ignore[attr-defined]
    CompiledKernel._init_handles = init_handles


_from_env = carveout_from_env()
if _from_env is not None:
    install(_from_env)
