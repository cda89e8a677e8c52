"""Triton Inference Server: the process a worker starts, and the backend over it.

:class:`TritonProcess` runs the ``tritonserver`` binary shipped in the
nvidia-pytriton wheel on loopback ports, in a per-worker folder.
:class:`TritonBackend` forwards generations to a Triton (its own or one given by
URL) as one ``ModelStreamInfer`` call each, on a decoupled model whose tensors
follow the Triton vLLM backend contract, and reads queue statistics through the
same generated stub; ``tritonclient`` serves the rest (model index, configs,
readiness, loading).

The modules, one job each: ``_process`` (the tritonserver child), ``_codec``
(the tensors on the wire), ``_generation`` (one streaming call), ``_metrics``
(the Prometheus endpoint) and ``_backend`` (the :class:`Backend` over them).
"""

from tokenmesh.worker.triton._backend import PORT_ATTEMPTS, TRITON_CHANNEL_OPTIONS, TritonBackend, TritonBackendConfig
from tokenmesh.worker.triton._codec import MalformedBytes, build_request, decode_first, encode_bytes
from tokenmesh.worker.triton._generation import TritonGeneration
from tokenmesh.worker.triton._metrics import parse_metrics, parse_pending
from tokenmesh.worker.triton._process import (
    DEFAULT_MODEL_REPOSITORY,
    SHIPPED_REPOSITORIES,
    PortTaken,
    TritonProcess,
    TritonProcessConfig,
    synthetic_repository,
)

__all__ = [
    "DEFAULT_MODEL_REPOSITORY",
    "MalformedBytes",
    "PORT_ATTEMPTS",
    "SHIPPED_REPOSITORIES",
    "TRITON_CHANNEL_OPTIONS",
    "PortTaken",
    "TritonBackend",
    "TritonBackendConfig",
    "TritonGeneration",
    "TritonProcess",
    "TritonProcessConfig",
    "build_request",
    "decode_first",
    "encode_bytes",
    "parse_metrics",
    "parse_pending",
    "synthetic_repository",
]
