"""What the calling side of a multiplexed call writes: its commands in order, and credit per logical stream.

Two calls carry many generations as logical streams: ``Worker/Link`` (the
router calls it) and ``Inference/GenerateStream`` (``tokenmesh.client`` calls
it). On both, the caller's side queues starts, cancels and detaches, and
returns credit as its consumers read; one writer task sends everything
pending when it runs as one message (commands in order, credit in columns),
so what is queued during a write goes in the next message, and no message
grows past the peer's announced ``max_batch_bytes`` (an oversized message
would end the call, and every stream on it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import grpc
from google.protobuf.message import Message

Command = TypeVar("Command", bound=Message)

FRAMING_BYTES = 8
"""What a command costs in its message beyond its own bytes (its field tag and length), counted generously."""


class Outbox(Generic[Command]):
    """Commands and credit waiting for the writer (``write_loop``), one message per write.

    Args:
        message: builds one message from (commands, credit streams, credit bytes).
        max_bytes: the commands of one message stay under this (a single larger command goes alone).

    """

    max_bytes: int
    _message: Callable[[list[Command], list[int], list[int]], Any]
    _commands: list[Command]
    _credit: dict[int, int]
    _flush: asyncio.Event
    _written: asyncio.Event
    """Set while nothing waits to be written."""

    def __init__(self, message: Callable[[list[Command], list[int], list[int]], Any], max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._message = message
        self._commands = []
        self._credit = {}
        self._flush = asyncio.Event()
        self._written = asyncio.Event()
        self._written.set()

    def send(self, command: Command) -> None:
        """Queue a command for the writer's next message."""
        self._commands.append(command)
        self._pending()

    def grant(self, stream: int, credit: int) -> None:
        """Return credit to a stream in the writer's next message (added to what it is owed already)."""
        self._credit[stream] = self._credit.get(stream, 0) + credit
        self._pending()

    def forget(self, stream: int) -> None:
        """No credit for a stream let go of (its peer sends nothing more for it)."""
        self._credit.pop(stream, None)

    def clear(self) -> None:
        """The call ended: nothing queued will be written."""
        self._commands.clear()
        self._credit.clear()
        self._flush.clear()
        self._written.set()

    async def written(self) -> None:
        """Until nothing waits to be written."""
        await self._written.wait()

    def _pending(self) -> None:
        self._flush.set()
        self._written.clear()

    async def write_loop(self, call: Any) -> None:
        """Everything pending when it runs, as one message, until the call ends (the reader sees how)."""
        while True:
            await self._flush.wait()
            self._flush.clear()
            credit, self._credit = self._credit, {}
            message = self._message(self._take(), list(credit), list(credit.values()))
            if self._commands:
                self._flush.set()  # the rest goes in the next message
            try:
                await call.write(message)
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
                return
            if not self._flush.is_set():
                self._written.set()

    def _take(self) -> list[Command]:
        """The pending commands that fit in max_bytes (at least one)."""
        size = 0
        for taken, command in enumerate(self._commands):
            size += command.ByteSize() + FRAMING_BYTES
            if size > self.max_bytes and taken:
                batch, self._commands = self._commands[:taken], self._commands[taken:]
                return batch
        batch, self._commands = self._commands, []
        return batch
