"""The worker: owns its devices and its Triton server, streams generations as chunks.

``Backend`` (in ``_backend``) is the one seam between the worker and an
inference engine; ``tokenmesh.worker.triton`` implements it over Triton.
"""

from tokenmesh.worker._backend import (
    AdapterState,
    Backend,
    BackendError,
    Delta,
    EngineStats,
    Finished,
    Generation,
    GenerationParams,
    ModelSpec,
    parse_adapters,
)
from tokenmesh.worker._concurrency import AdaptiveLimit
from tokenmesh.worker._config import WorkerConfig, format_cpus, parse_cpus
from tokenmesh.worker._devices import DeviceReader, DeviceReading, nvml_reader
from tokenmesh.worker._registry import Record, Registry
from tokenmesh.worker._service import Worker
from tokenmesh.worker._servicer import WorkerServicer

__all__ = [
    "AdapterState",
    "AdaptiveLimit",
    "Backend",
    "BackendError",
    "Delta",
    "DeviceReader",
    "DeviceReading",
    "EngineStats",
    "Finished",
    "Generation",
    "GenerationParams",
    "ModelSpec",
    "Record",
    "Registry",
    "Worker",
    "WorkerConfig",
    "WorkerServicer",
    "format_cpus",
    "parse_cpus",
    "nvml_reader",
    "parse_adapters",
]
