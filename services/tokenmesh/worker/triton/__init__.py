"""Triton Inference Server: the process a worker starts, and the backend over it.

:class:`TritonProcess` runs the ``tritonserver`` binary shipped in the
nvidia-pytriton wheel on loopback ports, in a per-worker folder.
:class:`TritonBackend` forwards generations to a Triton as one streaming
request each, on a decoupled model whose tensors follow the Triton vLLM
backend contract: to its own Triton as one HTTP ``generate_stream`` request
(server-sent events, one socket read for every response that has arrived),
to one given by URL as one gRPC ``ModelStreamInfer`` call (TLS where asked).
It reads queue statistics through the generated gRPC stub; ``tritonclient``
serves the rest (model index, configs, readiness, loading).

The modules, one job each: ``_process`` (the tritonserver child), ``_codec``
(the tensors on the wire), ``_generation`` (one gRPC streaming call), ``_sse``
(one HTTP streaming request), ``_metrics``
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
from tokenmesh.worker.triton._sse import TritonSseGeneration

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
    "TritonSseGeneration",
    "build_request",
    "decode_first",
    "encode_bytes",
    "parse_metrics",
    "parse_pending",
    "synthetic_repository",
]
