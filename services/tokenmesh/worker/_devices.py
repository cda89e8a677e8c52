"""GPU readings through NVML, behind a seam so they can be tested with fixed values.

No GPU (or no driver) means no readings: fields stay unset, never a fake zero.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DeviceReading:
    """One device as NVML reports it."""

    index: int
    name: str
    memory_used_bytes: int
    memory_total_bytes: int
    utilization_percent: int | None


DeviceReader = Callable[[], list[DeviceReading]]


def _visible_indices(spec: str | None, count: int) -> list[int]:
    if spec is None or spec.strip() == "":
        return list(range(count)) if spec is None else []
    indices = []
    for part in spec.split(","):
        part = part.strip()
        if part.isdigit() and int(part) < count:
            indices.append(int(part))
    return indices


def nvml_reader(cuda_visible_devices: str | None) -> DeviceReader | None:
    """A reader for the devices named by CUDA_VISIBLE_DEVICES (all when None).

    None when NVML cannot start (no GPU here): there is nothing to read.
    """
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except Exception as exc:  # noqa: BLE001 - any NVML failure means "no readings"
        log.info("NVML unavailable (%s); device readings disabled", exc)
        return None

    indices = _visible_indices(cuda_visible_devices, count)

    def read() -> list[DeviceReading]:
        readings = []
        for ordinal, index in enumerate(indices):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
                try:
                    util: int | None = int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
                except pynvml.NVMLError:
                    util = None
                name = pynvml.nvmlDeviceGetName(handle)
                readings.append(
                    DeviceReading(
                        index=ordinal,
                        name=name.decode() if isinstance(name, bytes) else str(name),
                        memory_used_bytes=int(memory.used),
                        memory_total_bytes=int(memory.total),
                        utilization_percent=util,
                    )
                )
            except pynvml.NVMLError as exc:
                log.warning("NVML reading of device %d failed: %s", index, exc)
        return readings

    return read
