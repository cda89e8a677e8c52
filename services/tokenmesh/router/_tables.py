"""Checks of a weight table before any of it is applied."""

from __future__ import annotations

import math

from tokenmesh.config import address_error
from tokenmesh.errors import InvalidArgument
from tokenmesh.v1 import router_pb2


def check_table(table: router_pb2.WeightTable, allowed: frozenset[str] | None) -> None:
    """Raise InvalidArgument naming the first bad entry of table; allowed: the workers it may name (None: any)."""
    seen: set[str] = set()
    for i, worker in enumerate(table.workers):
        entry = f"workers[{i}] ({worker.address!r})"
        if problem := address_error(worker.address):
            raise InvalidArgument(
                f"weight table v{table.version} refused: {entry}: address {problem}", field=f"workers[{i}].address"
            )
        if worker.address in seen:
            raise InvalidArgument(
                f"weight table v{table.version} refused: {entry} is listed twice", field=f"workers[{i}].address"
            )
        seen.add(worker.address)
        if not (math.isfinite(worker.weight) and 0.0 <= worker.weight <= 1.0):
            raise InvalidArgument(
                f"weight table v{table.version} refused: {entry}: weight {worker.weight:g} must be a number in [0, 1]",
                field=f"workers[{i}].weight",
            )
        if allowed is not None and worker.address not in allowed:
            raise InvalidArgument(
                f"weight table v{table.version} refused: {entry} is not one of this router's --workers "
                f"({', '.join(sorted(allowed)) or 'none'}); give it to the router, or run it with --discovery prober "
                "to let the prober's tables add workers",
                field=f"workers[{i}].address",
                reason="WORKER_NOT_ALLOWED",
            )
