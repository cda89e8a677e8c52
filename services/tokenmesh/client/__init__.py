"""The Python client of the mesh: ``Client`` (asyncio) and ``SyncClient`` (threads), over several routers."""

from tokenmesh.client._client import BROKEN_CODES, Client
from tokenmesh.client._sync import SyncClient

__all__ = ["BROKEN_CODES", "Client", "SyncClient"]
