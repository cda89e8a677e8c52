"""The worker: owns its devices and its Triton server, streams generations as chunks."""

from tokenmesh.worker.backend import Backend, BackendError, Delta, Finished, Generation, GenerationParams, ModelSpec
from tokenmesh.worker.service import Worker, WorkerConfig

__all__ = [
    "Backend",
    "BackendError",
    "Delta",
    "Finished",
    "Generation",
    "GenerationParams",
    "ModelSpec",
    "Worker",
    "WorkerConfig",
]
