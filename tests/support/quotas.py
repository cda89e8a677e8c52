"""Quota checks against a router run as several processes: connections of their own, refusals' details."""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from tokenmesh.v1 import router_pb2, router_pb2_grpc

OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)
"""Channel options for a connection of its own (grpc shares connections between channels by default), so the
kernel spreads a caller's calls over the processes of a router sharing one port (SO_REUSEPORT)."""


def refusal_of(error: grpc.aio.AioRpcError) -> tuple[str, float | None]:
    """A refusal's status and ErrorInfo reason (``RESOURCE_EXHAUSTED QUOTA_TOKENS_PER_MINUTE``) and its RetryInfo
    delay in seconds (None: it has none)."""
    status = rpc_status.from_call(error)
    reason, hint = "no ErrorInfo", None
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason = info.reason
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            hint = retry.retry_delay.ToNanoseconds() / 1e9
    return f"{error.code().name} {reason}", hint


async def served_by_process(address: str, connections: int = 32) -> dict[int, int]:
    """Generations each process of the router at address has served so far (its own table's served_total).

    Each table is asked for on a new connection until every process answered (or after ``connections``).
    """
    seen: dict[int, int] = {}
    for _ in range(connections):
        async with grpc.aio.insecure_channel(address, options=OWN_CONNECTION) as channel:
            table = await router_pb2_grpc.RouterStub(channel).GetRoutingTable(
                router_pb2.GetRoutingTableRequest(), timeout=5
            )
        seen[table.process_index] = sum(w.served_total for w in table.workers)
        if len(seen) == table.processes:
            break
    return seen
