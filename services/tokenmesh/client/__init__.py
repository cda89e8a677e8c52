"""The Python client of the mesh: ``Client`` (asyncio) and ``SyncClient`` (threads), over several routers."""

from tokenmesh.client._client import Client
from tokenmesh.client._sync import SyncClient
from tokenmesh.mux import BROKEN_CODES

__all__ = ["BROKEN_CODES", "Client", "SyncClient"]
