"""The HTTP edge of tokenmesh: an OpenAI- and Anthropic-compatible, resumable SSE gateway over the routers.

``tokenmesh gateway --port 8000 --routers r1:50051,r2:50051`` serves
``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``, Anthropic's ``/v1/messages``
(streamed as Server-Sent Events or whole), ``/v1/models`` and ``/health``, through
:class:`tokenmesh.client.Client`: a router that fails mid-stream is
invisible to the caller, and a caller whose connection drops resumes with
``Last-Event-ID``.
"""

from tokenmesh_gateway._app import GatewayApp
from tokenmesh_gateway._auth import hash_key, load_keys
from tokenmesh_gateway._config import GatewayConfig
from tokenmesh_gateway._errors import HttpError
from tokenmesh_gateway._service import Gateway

__all__ = ["Gateway", "GatewayApp", "GatewayConfig", "HttpError", "hash_key", "load_keys"]
