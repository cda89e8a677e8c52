"""A gateway in the test's loop over an in-process mesh, and SSE helpers for raw checks."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson

from tokenmesh_gateway import Gateway, GatewayConfig

from .mesh import InProcessMesh


@contextlib.asynccontextmanager
async def gateway_over(
    mesh: InProcessMesh | None, routers: tuple[str, ...] = (), **settings: Any
) -> AsyncIterator[Gateway]:
    """A started gateway on 127.0.0.1:0 in front of the mesh's router (or routers); shut down after."""
    gateway = Gateway(GatewayConfig(port=0, routers=routers or (mesh.router.host.address,), **settings))
    await gateway.start()
    try:
        yield gateway
    finally:
        await gateway.shutdown()


def events(raw: bytes) -> list[dict[str, str]]:
    """The events of an SSE body: each {"id": ..., "data": ...} (fields it has), comment lines dropped."""
    found = []
    for block in raw.split(b"\n\n"):
        fields: dict[str, str] = {}
        for line in block.split(b"\n"):
            if not line or line.startswith(b":"):
                continue
            name, _, value = line.decode().partition(": ")
            fields[name] = value
        if fields:
            found.append(fields)
    return found


def datas(raw: bytes) -> list[Any]:
    """The JSON of every data field, [DONE] as the string."""
    return [e["data"] if e["data"] == "[DONE]" else orjson.loads(e["data"]) for e in events(raw) if "data" in e]


def text_of(raw: bytes) -> str:
    """The generated text in an SSE body (chat deltas or completion texts)."""
    out = []
    for data in datas(raw):
        if isinstance(data, dict):
            for choice in data.get("choices", []):
                out.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(out)


def text_after(raw: bytes, seq: int) -> str:
    """The text of the chunks after seq in an SSE body (an event without id belongs to the next id's chunk)."""
    out: list[str] = []
    pending: list[str] = []
    for event in events(raw):
        if "data" in event and event["data"] != "[DONE]":
            pending.append(text_of(b"data: " + event["data"].encode() + b"\n\n"))
        if "id" in event:
            if int(event["id"].rpartition(":")[2]) > seq:
                out += pending
            pending = []
    return "".join(out + pending)


class Reader:
    """Reads a streamed response piece by piece (one iterator: breaking out of aiter_raw would close it)."""

    def __init__(self, response: httpx.Response) -> None:
        self._pieces = response.aiter_raw()
        self.raw = b""

    async def events(self, count: int) -> bytes:
        """Read until count complete events arrived in all; return every byte read so far."""
        while self.raw.count(b"\n\n") < count:
            self.raw += await anext(self._pieces)
        return self.raw

    async def rest(self) -> bytes:
        """Read to the end; return what came after what was read before."""
        before = len(self.raw)
        async for piece in self._pieces:
            self.raw += piece
        return self.raw[before:]
