"""The router: admits generations, picks workers from the live weight table, relays chunks."""

from tokenmesh.router._admission import FAILOVER, Admission
from tokenmesh.router._config import DISCOVERY, RouterConfig
from tokenmesh.router._inference import InferenceServicer
from tokenmesh.router._peers import FORWARDED, Peers
from tokenmesh.router._pool import NO_AFFINITY, POLICIES, Affinity, WorkerEntry, WorkerPool, affinity_of, prefix_key
from tokenmesh.router._service import ControlServicer, Router, RouterServicer

__all__ = [
    "DISCOVERY",
    "FAILOVER",
    "FORWARDED",
    "NO_AFFINITY",
    "POLICIES",
    "Admission",
    "Affinity",
    "ControlServicer",
    "InferenceServicer",
    "Peers",
    "Router",
    "RouterConfig",
    "RouterServicer",
    "WorkerEntry",
    "WorkerPool",
    "affinity_of",
    "prefix_key",
]
