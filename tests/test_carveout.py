"""fuser/ops/carveout.py: FUSER_SMEM_CARVEOUT and the kernel-load hook (no GPU: the driver call
is stubbed; on the H200 benchmarks/gpu_all.sh s24a measures what it changes)."""

from __future__ import annotations

import pytest
import triton

from fuser.ops import carveout


@pytest.fixture
def clean_state(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(carveout, "_state", {"percent": None, "driver": None, "done": set()})
    hook = triton.knobs.runtime.kernel_load_end_hook
    calls = list(getattr(hook, "calls", []))
    yield
    if hasattr(hook, "calls"):
        hook.calls[:] = calls


@pytest.mark.parametrize("value, expected", [("", None), ("0", 0), ("100", 100), (" 64 ", 64)])
def test_env_values(monkeypatch: pytest.MonkeyPatch, value: str, expected: int | None) -> None:
    monkeypatch.setenv("FUSER_SMEM_CARVEOUT", value)
    assert carveout.carveout_from_env() == expected


@pytest.mark.parametrize("value", ["101", "-1", "max", "1.5"])
def test_bad_env_values_raise(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("FUSER_SMEM_CARVEOUT", value)
    with pytest.raises(ValueError, match="FUSER_SMEM_CARVEOUT"):
        carveout.carveout_from_env()


def test_hook_sets_the_attribute_once_per_kernel(clean_state) -> None:
    calls = []

    class Driver:
        def cuFuncSetAttribute(self, function, attribute, value):  # noqa: N802 (cuda.h's name)
            calls.append((function.value, attribute.value, value.value))
            return 0

    carveout._state["driver"] = Driver()
    carveout._on_load(None, 1234, "k", None, "")  # not installed: nothing
    assert calls == []
    carveout.install(100)
    carveout.install(100)  # one hook, not two
    hook = triton.knobs.runtime.kernel_load_end_hook
    hook(None, 1234, "k", None, "")
    hook(None, 1234, "k", None, "")  # the same handle again: nothing
    hook(None, 5678, "k2", None, "")
    assert calls == [(1234, carveout.CARVEOUT_ATTRIBUTE, 100), (5678, carveout.CARVEOUT_ATTRIBUTE,
                                                                100)]
    assert carveout.installed_percent() == 100
    with pytest.raises(ValueError, match="percent"):
        carveout.install(101)


def test_a_driver_error_names_the_kernel(clean_state) -> None:
    class Driver:
        def cuFuncSetAttribute(self, function, attribute, value):  # noqa: N802
            return 1  # CUDA_ERROR_INVALID_VALUE

    carveout._state["driver"] = Driver()
    carveout.install(50)
    with pytest.raises(RuntimeError, match="my_kernel"):
        carveout._on_load(None, 42, "my_kernel", None, "")
