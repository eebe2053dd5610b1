"""GPU gauges for `fuser serve`'s /metrics, read from NVML at every scrape.

    fuser_gpu_memory_used_bytes{gpu}       device memory in use (NVML's used bytes, every
                                           process on the GPU, not only this server)
    fuser_gpu_utilization_perc{gpu}        percent of the last sample period in which a kernel
                                           ran (NVML's utilization.gpu, 0..100)

`gpu` is NVML's device index. With CUDA_VISIBLE_DEVICES set to device indices, only those
devices are exported; otherwise every device NVML sees.

NVML comes from the optional package nvidia-ml-py (`import pynvml`; in the serve extra). Without
it, without a driver, or without a GPU, the gauges are simply not exported: no error and no
warning. A device whose reading fails at a scrape (or that does not support utilization, as a
MIG instance) leaves out that value only.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from prometheus_client.core import GaugeMetricFamily

__all__ = ["GpuCollector", "visible_indices"]

log = logging.getLogger(__name__)


def visible_indices(count: int, env: str | None) -> list[int]:
    """NVML indices to export among `count` devices: those of CUDA_VISIBLE_DEVICES (`env`) when
    it lists device indices, else all of them (unset, empty or UUIDs: all)."""
    if env is None or not env.strip():
        return list(range(count))
    try:
        wanted = [int(part) for part in env.split(",") if part.strip()]
    except ValueError:  # GPU-<uuid> or MIG-<uuid> entries: no index to filter on
        return list(range(count))
    return [i for i in dict.fromkeys(wanted) if 0 <= i < count]


def _load_nvml() -> ModuleType | None:
    """pynvml, initialized; None when the package, the driver or a GPU is missing."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() < 1:
            return None
    except Exception as error:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        log.debug("NVML unavailable: %s", error)
        return None
    return pynvml


class GpuCollector:
    """A prometheus_client collector of the GPU gauges (module docstring). NVML is initialized
    on the first scrape (once) and read at each one; nothing runs between scrapes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._nvml: ModuleType | None = None
        self._tried = False

    def nvml(self) -> ModuleType | None:
        """The initialized pynvml module, or None (tried once per collector)."""
        with self._lock:
            if not self._tried:
                self._tried = True
                self._nvml = _load_nvml()
            return self._nvml

    def describe(self) -> list[Any]:
        """Nothing at registration: the registry must not initialize NVML before a scrape."""
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        nvml = self.nvml()
        if nvml is None:
            return
        memory = GaugeMetricFamily("fuser_gpu_memory_used_bytes",
                                   "GPU memory in use (NVML, every process), bytes.",
                                   labels=["gpu"])
        utilization = GaugeMetricFamily("fuser_gpu_utilization_perc",
                                        "Percent of the last sample period in which a kernel "
                                        "ran on the GPU (NVML).", labels=["gpu"])
        try:
            indices = visible_indices(nvml.nvmlDeviceGetCount(),
                                      os.environ.get("CUDA_VISIBLE_DEVICES"))
        except Exception as error:
            log.debug("NVML device count failed: %s", error)
            return
        for index in indices:
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
            except Exception as error:
                log.debug("NVML device %d: %s", index, error)
                continue
            try:
                memory.add_metric([str(index)], float(nvml.nvmlDeviceGetMemoryInfo(handle).used))
            except Exception as error:
                log.debug("NVML memory of device %d: %s", index, error)
            try:
                utilization.add_metric([str(index)],
                                       float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu))
            except Exception as error:  # NVMLError_NotSupported on a MIG instance
                log.debug("NVML utilization of device %d: %s", index, error)
        for family in (memory, utilization):
            if family.samples:
                yield family
