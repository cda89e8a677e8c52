"""A blocking face of :class:`~tokenmesh.client.Client` for code without an event loop.

One event loop runs in a daemon thread per SyncClient; each call hands a
coroutine to it and waits. The async client does all the work, so both behave
alike (retries, resume, errors).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Iterator, Sequence
from concurrent.futures import Future
from types import TracebackType
from typing import Any, Self, TypeVar

from tokenmesh.client._client import Client
from tokenmesh.v1 import inference_pb2

T = TypeVar("T")


class SyncClient:
    """Blocking client of the mesh's ``Inference`` service (arguments as :class:`Client`'s)."""

    _loop: asyncio.AbstractEventLoop
    _thread: threading.Thread
    _client: Client

    def __init__(self, routers: str | Sequence[str], **settings: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tokenmesh-client", daemon=True)
        self._thread.start()
        self._client = self._call(self._make(routers, settings))

    @staticmethod
    async def _make(routers: str | Sequence[str], settings: dict[str, Any]) -> Client:
        return Client(routers, **settings)

    def _call(self, coro: Any) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result()

    def generate(
        self, request: inference_pb2.GenerateRequest, *, timeout: float | None = None
    ) -> Iterator[inference_pb2.GenerateChunk]:
        """Chunks of a generation, as :meth:`Client.generate` yields them."""
        return self._iterate(self._client.generate(request, timeout=timeout))

    def resume(
        self, request_id: str, after_seq: int = 0, *, timeout: float | None = None
    ) -> Iterator[inference_pb2.GenerateChunk]:
        """Chunks after after_seq, as :meth:`Client.resume` yields them."""
        return self._iterate(self._client.resume(request_id, after_seq, timeout=timeout))

    def _iterate(
        self, stream: AsyncGenerator[inference_pb2.GenerateChunk, None]
    ) -> Iterator[inference_pb2.GenerateChunk]:
        """The async generator's chunks, one loop round trip each."""
        try:
            while True:
                try:
                    yield self._call(stream.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._call(stream.aclose())  # a caller that stops early cancels, as with the async client

    def cancel(self, request_id: str, *, timeout: float = 5.0) -> inference_pb2.CancelResponse:
        """Stop a generation wherever it runs."""
        response: inference_pb2.CancelResponse = self._call(self._client.cancel(request_id, timeout=timeout))
        return response

    def list_models(self, *, timeout: float = 5.0) -> inference_pb2.ListModelsResponse:
        """The models the mesh serves."""
        response: inference_pb2.ListModelsResponse = self._call(self._client.list_models(timeout=timeout))
        return response

    def close(self) -> None:
        """Close the channels and stop the loop thread. Idempotent."""
        if not self._loop.is_running():
            return
        self._call(self._client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
