"""The router: admits generations, picks workers from the live weight table, relays chunks."""

from tokenmesh.router.pool import WorkerPool
from tokenmesh.router.service import Router, RouterConfig

__all__ = ["Router", "RouterConfig", "WorkerPool"]
