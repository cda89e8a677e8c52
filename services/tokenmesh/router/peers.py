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

from tokenmesh.v1 import router_pb2, router_pb2_grpc

log = logging.getLogger(__name__)

FORWARDED = ("tokenmesh-forwarded", "1")
"""Metadata on a weight stream from a sibling process: apply, do not pass on."""


class Peers:
    """The sibling processes of this router, and the weight tables passed on to them."""

    def __init__(self, directory: Path, index: int, count: int) -> None:
        self.directory = directory
        self.index = index
        self.count = count
        self._latest: router_pb2.WeightTable | None = None
        self._links: dict[int, asyncio.Task[None]] = {}
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
        """Until every sibling has listed itself; TimeoutError after timeout_s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while len(self.addresses()) < self.count - 1:
            if loop.time() > deadline:
                raise TimeoutError(f"{len(self.addresses()) + 1} of {self.count} router processes started")
            await asyncio.sleep(0.05)

    def forward(self, table: router_pb2.WeightTable) -> None:
        """Pass a table from the prober on to every sibling (the newest wins if they lag)."""
        self._latest = table
        for index in self.addresses():
            if index not in self._links:
                self._wake[index] = asyncio.Event()
                self._links[index] = asyncio.create_task(self._link(index))
            self._wake[index].set()

    async def _link(self, index: int) -> None:
        """One weight stream to a sibling, reopened when it breaks."""
        wake = self._wake[index]
        while True:
            address = self.addresses().get(index)
            if address is None:
                await asyncio.sleep(0.5)
                continue
            try:
                async with grpc.aio.insecure_channel(address) as channel:
                    call = router_pb2_grpc.ControlStub(channel).PushWeights(metadata=(FORWARDED,))
                    sent = 0
                    while True:
                        await wake.wait()
                        wake.clear()
                        table = self._latest
                        if table is not None and table.version > sent:
                            await call.write(table)
                            await call.read()  # the ack: one table in flight per sibling
                            sent = table.version
            except grpc.aio.AioRpcError as exc:
                log.warning("router process %d unreachable at %s (%s); retrying", index, address, exc.code().name)
                wake.set()  # resend the latest once it is back
                await asyncio.sleep(0.5)

    async def close(self) -> None:
        """Stop passing tables on."""
        for task in self._links.values():
            task.cancel()
        for task in self._links.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
