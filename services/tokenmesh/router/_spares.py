"""Worker/Generate calls opened ahead of need, one per worker.

Opening a bidi call (HTTP/2 stream, initial metadata, the worker's handler)
took about 0.5 ms of the first token's path; a spare has done that while the
previous generation ran. A spare carries no deadline: the caller's goes in
the start command (``timeout_s``).
"""

from __future__ import annotations

from typing import Any

from tokenmesh.v1 import worker_pb2_grpc


class Spares:
    """One open Generate call per worker, taken by the next generation that goes there.

    Args:
        stubs: the router's worker stubs by address (shared: the router adds a stub per worker it learns of,
            and removes it, with the worker's spare, when discovery drops the worker).

    """

    open_calls: dict[str, Any]
    """Per worker address, the spare Worker/Generate call (a StreamStreamCall; the stub is untyped)."""
    _stubs: dict[str, worker_pb2_grpc.WorkerStub]

    def __init__(self, stubs: dict[str, worker_pb2_grpc.WorkerStub]) -> None:
        self._stubs = stubs
        self.open_calls = {}

    def take(self, address: str) -> Any:  # a Worker/Generate StreamStreamCall
        """A Generate call to the worker: its spare if that is still open, else a new one."""
        spare = self.open_calls.pop(address, None)
        if spare is not None and not spare.done():
            return spare
        return self._stubs[address].Generate()

    def open(self, address: str) -> None:
        """Open the worker's spare for its next generation (unless one is open)."""
        if address not in self.open_calls:
            self.open_calls[address] = self._stubs[address].Generate()

    def close(self) -> None:
        """Cancel every spare (the router is stopping)."""
        for call in self.open_calls.values():
            call.cancel()
        self.open_calls.clear()
