"""Checks of a weight table before any of it is applied, and of worker addresses."""

from __future__ import annotations

import ipaddress
import math
import re

from tokenmesh.errors import InvalidArgument
from tokenmesh.v1 import router_pb2

_HOST_NAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?")
"""A DNS name or an IPv4 address: letters, digits, '-', '_' and '.' (not at either end)."""


def address_error(address: str) -> str:
    """Why address is not host:port with a port 1..65535 ('' when it is); an IPv6 host goes in brackets."""
    host, colon, port = address.rpartition(":")
    if not colon or not host:
        return "must be host:port"
    if not (port.isascii() and port.isdigit()):
        return f"port {port!r} must be 1..65535"
    if not 1 <= int(port) <= 65535:
        return f"port {int(port)} must be 1..65535"
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return f"host {host} is not an IPv6 address"
        return ""
    if ":" in host:
        return "an IPv6 host goes in brackets, e.g. [::1]:50061"
    if not _HOST_NAME.fullmatch(host):
        return f"host {host!r} is not a host name or IPv4 address"
    return ""


def check_table(table: router_pb2.WeightTable, allowed: frozenset[str] | None) -> None:
    """Raise InvalidArgument naming the first bad entry of table; allowed: the workers it may name (None: any)."""
    seen: set[str] = set()
    for i, worker in enumerate(table.workers):
        entry = f"workers[{i}] ({worker.address!r})"
        if problem := address_error(worker.address):
            raise InvalidArgument(f"weight table v{table.version} refused: {entry}: address {problem}")
        if worker.address in seen:
            raise InvalidArgument(f"weight table v{table.version} refused: {entry} is listed twice")
        seen.add(worker.address)
        if not (math.isfinite(worker.weight) and 0.0 <= worker.weight <= 1.0):
            raise InvalidArgument(
                f"weight table v{table.version} refused: {entry}: weight {worker.weight:g} must be a number in [0, 1]"
            )
        if allowed is not None and worker.address not in allowed:
            raise InvalidArgument(
                f"weight table v{table.version} refused: {entry} is not one of this router's --workers "
                f"({', '.join(sorted(allowed)) or 'none'}); give it to the router, or run it with --discovery prober "
                "to let the prober's tables add workers"
            )
