"""The NVML gauges of `fuser serve`'s /metrics (fuser/server/gpu_metrics.py) over a fake pynvml
module: values read at scrape time, per GPU index, CUDA_VISIBLE_DEVICES honoured; and silence
(no gauge, no warning, no error) without pynvml, without a driver, or without a GPU."""

from __future__ import annotations

import logging
import sys
import types
import warnings

import pytest

pytest.importorskip("prometheus_client")

from fuser.server.gpu_metrics import visible_indices  # noqa: E402
from fuser.server.metrics import ServingMetrics  # noqa: E402

MEMORY = "fuser_gpu_memory_used_bytes"
UTILIZATION = "fuser_gpu_utilization_perc"


class FakeNVMLError(Exception):
    pass


def fake_pynvml(used: list[int], util: list[int | None], init_error: bool = False
                ) -> types.ModuleType:
    """A pynvml stand-in over len(used) devices; util None = NotSupported for that device.
    `calls` counts the reads (to show nothing is read between scrapes)."""
    module = types.ModuleType("pynvml")
    module.calls = {"init": 0, "memory": 0, "utilization": 0}
    module.used, module.util = used, util

    def nvmlInit() -> None:
        module.calls["init"] += 1
        if init_error:
            raise FakeNVMLError("NVML Shared Library Not Found")

    def handle(index: int) -> int:
        if not 0 <= index < len(module.used):
            raise FakeNVMLError("Invalid Argument")
        return index

    def memory(h: int) -> types.SimpleNamespace:
        module.calls["memory"] += 1
        return types.SimpleNamespace(total=141 << 30, used=module.used[h], free=0)

    def utilization(h: int) -> types.SimpleNamespace:
        module.calls["utilization"] += 1
        if module.util[h] is None:
            raise FakeNVMLError("Not Supported")
        return types.SimpleNamespace(gpu=module.util[h], memory=0)

    module.nvmlInit = nvmlInit
    module.nvmlDeviceGetCount = lambda: len(module.used)
    module.nvmlDeviceGetHandleByIndex = handle
    module.nvmlDeviceGetMemoryInfo = memory
    module.nvmlDeviceGetUtilizationRates = utilization
    return module


def samples(text: str, name: str) -> dict[str, float]:
    """{gpu label: value} of `name`'s samples in an exposition."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].split("} ")
            out[dict(kv.split("=") for kv in labels.split(","))["gpu"].strip('"')] = float(value)
    return out


def test_gauges_carry_nvml_values_read_at_each_scrape(monkeypatch) -> None:
    nvml = fake_pynvml(used=[3 << 30, 5 << 30], util=[40, 97])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    metrics = ServingMetrics(lambda: None)
    assert nvml.calls == {"init": 0, "memory": 0, "utilization": 0}  # nothing before a scrape
    text = metrics.text()
    assert samples(text, MEMORY) == {"0": float(3 << 30), "1": float(5 << 30)}
    assert samples(text, UTILIZATION) == {"0": 40.0, "1": 97.0}
    assert f"# TYPE {MEMORY} gauge" in text and f"# TYPE {UTILIZATION} gauge" in text
    nvml.used[1], nvml.util[0] = 7 << 30, 3  # the next scrape reads the new values
    text = metrics.text()
    assert samples(text, MEMORY)["1"] == float(7 << 30)
    assert samples(text, UTILIZATION)["0"] == 3.0
    assert nvml.calls == {"init": 1, "memory": 4, "utilization": 4}  # initialized once


def test_cuda_visible_devices_selects_gpus_and_unsupported_values_are_left_out(monkeypatch
                                                                                ) -> None:
    nvml = fake_pynvml(used=[1, 2, 3], util=[10, None, 30])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,1")
    text = ServingMetrics(lambda: None).text()
    assert samples(text, MEMORY) == {"2": 3.0, "1": 2.0}
    assert samples(text, UTILIZATION) == {"2": 30.0}  # device 1: NotSupported (a MIG slice)


@pytest.mark.parametrize("env, want", [(None, [0, 1, 2]), ("", [0, 1, 2]), ("1", [1]),
                                       ("2,0,2", [2, 0]), ("5", []), ("0,7", [0]),
                                       ("GPU-8f3c1a2e", [0, 1, 2])])
def test_visible_indices(env: str | None, want: list[int]) -> None:
    assert visible_indices(3, env) == want


@pytest.mark.parametrize("case", ["no pynvml", "no driver", "no gpu"])
def test_without_nvml_the_gauges_are_absent_and_silent(case: str, monkeypatch, caplog) -> None:
    if case == "no pynvml":
        monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    else:
        monkeypatch.setitem(sys.modules, "pynvml",
                            fake_pynvml(used=[] if case == "no gpu" else [1], util=[1],
                                        init_error=case == "no driver"))
    caplog.set_level(logging.INFO)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning would fail the test
        metrics = ServingMetrics(lambda: None)
        text = metrics.text() + metrics.text()
    assert MEMORY not in text and UTILIZATION not in text
    assert "fuser_num_requests_running" in text  # the rest of the exposition is unchanged
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]
