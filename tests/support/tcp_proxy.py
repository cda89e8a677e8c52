"""A TCP proxy for tests: forwards to a target and can cut every connection (RST)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(OSError):
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers -= {writer, up_writer}

    def cut(self) -> None:
        """Reset every open connection, as a failing network path does; new ones are accepted."""
        for writer in list(self._writers):
            sock = writer.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        self._writers.clear()

    async def stop(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


class DelayProxy:
    """A TCP proxy that holds every byte for ``delay_s`` in each direction, in order (``tc netem`` is not in this
    kernel, so added latency needs a proxy).

    Args:
        target_host: where connections go.
        target_port: its port.
        host: the address to listen on (the cluster harness: the host's end of its bridge, which the pods reach).
        delay_s: added to each direction: a reply arrives 2 x delay_s later than without the proxy.

    """

    target: tuple[str, int]
    host: str
    delay_s: float
    port: int
    accepted: int
    """Connections accepted so far."""
    forwarded_bytes: int
    """Bytes forwarded so far, both directions."""
    _server: asyncio.Server | None
    _tasks: set[asyncio.Task[None]]

    def __init__(self, target_host: str, target_port: int, host: str = "127.0.0.1", delay_s: float = 0.2) -> None:
        self.target = (target_host, target_port)
        self.host = host
        self.delay_s = delay_s
        self.port = 0
        self.accepted = 0
        self.forwarded_bytes = 0
        self._server = None
        self._tasks = set()

    @property
    def address(self) -> str:
        """host:port it listens on."""
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        """Listen on a free port."""
        self._server = await asyncio.start_server(self._handle, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self.accepted += 1
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            # Cancelled by stop(): the handler ends normally (asyncio logs a handler task that ends cancelled).
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        finally:
            self._tasks.discard(task)
            for end in (writer, up_writer):
                end.close()

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        """Read as it comes; write each piece delay_s after it was read (a queue keeps the order)."""
        held: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def release() -> None:
            loop = asyncio.get_running_loop()
            while True:
                due, data = await held.get()
                if not data:
                    break
                await asyncio.sleep(max(0.0, due - loop.time()))
                dst.write(data)
                await dst.drain()
                self.forwarded_bytes += len(data)
            if dst.can_write_eof():
                dst.write_eof()

        releasing = asyncio.create_task(release())
        loop = asyncio.get_running_loop()
        try:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    held.put_nowait((loop.time() + self.delay_s, data))
            held.put_nowait((0.0, b""))
            with contextlib.suppress(OSError):
                await releasing
        finally:
            releasing.cancel()

    async def stop(self) -> None:
        """Stop listening and close every connection."""
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
