"""The router: admits generations, picks workers from the live weight table, relays chunks."""

from tokenmesh.router._admission import FAILOVER, Admission
from tokenmesh.router._config import DISCOVERY, RouterConfig
from tokenmesh.router._inference import InferenceServicer
from tokenmesh.router._peers import FORWARDED, Peers
from tokenmesh.router._pool import POLICIES, WorkerEntry, WorkerPool, prefix_key
from tokenmesh.router._service import ControlServicer, Router, RouterServicer

__all__ = [
    "DISCOVERY",
    "FAILOVER",
    "FORWARDED",
    "POLICIES",
    "Admission",
    "ControlServicer",
    "InferenceServicer",
    "Peers",
    "Router",
    "RouterConfig",
    "RouterServicer",
    "WorkerEntry",
    "WorkerPool",
    "prefix_key",
]
