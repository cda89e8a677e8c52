"""A router run as several processes on one port (``--processes N``, SO_REUSEPORT).

The kernel spreads incoming connections over the processes, so the prober's
weight stream reaches only one of them. Each process therefore also listens
on a private loopback port, lists it in a shared folder, and passes every
table it gets from the prober on to the others (marked as forwarded, so it
travels one hop only). Each process keeps its own admission queue and
in-flight counts, and uses its share of every worker's limit (WorkerPool.share).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path

import grpc
import tenacity

from tokenmesh.links import Links
from tokenmesh.retry import Reconnect, StreamEnded, write
from tokenmesh.tls import Tls, TlsSettings
from tokenmesh.v1 import router_pb2, router_pb2_grpc

log = logging.getLogger(__name__)

FORWARDED = ("tokenmesh-forwarded", "1")
"""Metadata on a weight stream from a sibling process: apply, do not pass on."""


class Peers:
    """The sibling processes of this router, and the weight tables passed on to them.

    Args:
        directory: the folder where each process lists its private address.
        index: this process's index (0 started the others).
        count: how many processes the router runs.

    """

    directory: Path
    index: int
    count: int
    _latest: router_pb2.WeightTable | None
    """The newest table from the prober, which every sibling gets."""
    links: Links
    """The channels to the siblings, by private address (renewed with the router's certificate)."""
    _forwards: dict[int, asyncio.Task[None]]
    """Per sibling, the task that keeps a weight stream to it."""
    _wake: dict[int, asyncio.Event]
    """Per sibling, set when there is a newer table to send."""

    def __init__(self, directory: Path, index: int, count: int, tls: Tls | None = None) -> None:
        self.tls = tls if tls is not None else Tls(TlsSettings())
        self.directory = directory
        self.index = index
        self.count = count
        self._latest: router_pb2.WeightTable | None = None
        # A renewal leaves a stream running on its old channel; the next one opens on the new channel.
        self.links = Links(self.tls.channel)
        self._forwards = {}
        self._wake: dict[int, asyncio.Event] = {}

    def register(self, private_address: str) -> None:
        """List our private address for the others."""
        self.directory.mkdir(parents=True, exist_ok=True)
        target = self.directory / f"{self.index}.addr"
        tmp = target.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(private_address)
        os.replace(tmp, target)

    def unregister(self) -> None:
        """Remove our listing."""
        with contextlib.suppress(FileNotFoundError):
            (self.directory / f"{self.index}.addr").unlink()

    def addresses(self) -> dict[int, str]:
        """The siblings' private addresses listed so far."""
        found = {}
        for path in self.directory.glob("*.addr"):
            index = int(path.stem)
            if index != self.index:
                with contextlib.suppress(FileNotFoundError):
                    found[index] = path.read_text().strip()
        return found

    async def wait_listed(self, timeout_s: float) -> None:
        """Until every sibling has listed itself; TimeoutError after timeout_s.

        The siblings tell nothing but their files (a folder has no event to
        wait on without inotify), so the folder is looked at again with a
        growing wait, 10 ms up to 200 ms, within the one deadline.
        """
        waiting = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_result(lambda listed: listed < self.count - 1),
            wait=tenacity.wait_exponential(multiplier=0.01, max=0.2),
            stop=tenacity.stop_after_delay(timeout_s),
        )

        async def listed() -> int:
            return len(self.addresses())

        try:
            await waiting(listed)
        except tenacity.RetryError:
            raise TimeoutError(
                f"{len(self.addresses()) + 1} of {self.count} router processes started within {timeout_s:g} s"
            ) from None

    def forward(self, table: router_pb2.WeightTable) -> None:
        """Pass a table from the prober on to every sibling (the newest wins if they lag)."""
        self._latest = table
        for index in self.addresses():
            forward = self._forwards.get(index)
            if forward is None or forward.done():  # it ends only on a permanent error (logged): try it afresh
                self._wake[index] = asyncio.Event()
                self._forwards[index] = asyncio.create_task(self._forward(index))
                self._forwards[index].add_done_callback(_logged_already)
            self._wake[index].set()

    async def _forward(self, index: int) -> None:
        """One weight stream to a sibling, reopened through the retry policy when it breaks."""
        wake = self._wake[index]
        reconnect = Reconnect("weight forward", f"router process {index}", logger=log)

        async def session() -> None:
            listed = self.addresses()
            address = listed.get(index)
            if address is None:
                raise ConnectionError(f"router process {index} is not listed (restarting?)")
            for gone in set(self.links) - set(listed.values()):  # a sibling that restarted listed a new address
                self.links.drop(gone)
            call = self.links.open(address).stub(router_pb2_grpc.ControlStub).PushWeights(metadata=(FORWARDED,))
            # A stream that breaks while no table is due wakes the task too: the sibling
            # restarted, and gets the latest table as soon as it is back, not with the next one.
            call.add_done_callback(lambda _: wake.set())
            try:
                sent = 0  # a new stream: the latest table goes again
                while True:
                    # Cleared before the table is read: one forwarded meanwhile sets it again.
                    wake.clear()
                    if call.done():
                        await call.read()  # raises the stream's status (UNAVAILABLE when the sibling stopped)
                        raise StreamEnded(f"router process {index} ended the weight stream")
                    table = self._latest
                    if table is not None and table.version > sent:
                        await write(call, table)
                        if await call.read() is grpc.aio.EOF:  # the ack: one table in flight per sibling
                            raise StreamEnded(f"router process {index} ended the weight stream")
                        reconnect.connected()
                        sent = table.version
                    await wake.wait()
            finally:
                call.cancel()  # the channel stays open (the link's): the stream ends with the session

        await reconnect.run(session)

    async def close(self) -> None:
        """Stop passing tables on."""
        for task in self._forwards.values():
            task.cancel()
        for task in self._forwards.values():
            with contextlib.suppress(asyncio.CancelledError, Exception):  # a failed stream logged its error
                await task
        await self.links.close()


def _logged_already(task: asyncio.Task[None]) -> None:
    """Take a finished forward's error: Reconnect logged it (without this, asyncio would again at exit)."""
    if not task.cancelled():
        task.exception()
