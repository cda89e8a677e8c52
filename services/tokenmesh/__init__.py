"""tokenmesh: a gRPC service mesh that streams LLM tokens from Triton-backed workers.

``services/`` is the source root and the package lives in
``services/tokenmesh/``: ``tokenmesh.router``,
``tokenmesh.worker`` and ``tokenmesh.prober`` are the three services, the
modules here are what they share, and ``tokenmesh.v1`` is the code generated
from ``protos/`` (never edited by hand).
"""

__version__ = "0.1.0"
