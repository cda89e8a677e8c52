"""A real DNS server for discovery tests (dnslib, UDP on a loopback port), whose records a test changes live."""

from __future__ import annotations

import socket
import threading
from typing import Any

from dnslib import AAAA, QTYPE, RCODE, RR, A
from dnslib.server import DNSLogger, DNSServer


class Zone:
    """Name -> IP addresses; answers A and AAAA, NXDOMAIN for names it does not hold."""

    def __init__(self) -> None:
        self._records: dict[str, list[str]] = {}
        self._lock = threading.Lock()
        self.queries = 0

    def set(self, name: str, *ips: str) -> None:
        """Replace name's records (no ips: the name exists with no address)."""
        with self._lock:
            self._records[name.rstrip(".").lower()] = list(ips)

    def delete(self, name: str) -> None:
        """The name no longer exists (NXDOMAIN)."""
        with self._lock:
            self._records.pop(name.rstrip(".").lower(), None)

    def resolve(self, request: Any, handler: Any) -> Any:
        reply = request.reply()
        name = str(request.q.qname).rstrip(".").lower()
        with self._lock:
            self.queries += 1
            ips = self._records.get(name)
        if ips is None:
            reply.header.rcode = RCODE.NXDOMAIN
            return reply
        for ip in ips:
            v6 = ":" in ip
            if request.q.qtype == QTYPE.A and not v6:
                reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(ip), ttl=1))
            elif request.q.qtype == QTYPE.AAAA and v6:
                reply.add_answer(RR(request.q.qname, QTYPE.AAAA, rdata=AAAA(ip), ttl=1))
        return reply


class DnsServer:
    """The zone served on host:port (default 127.0.0.1 and a free port) until stop().

    Args:
        host: the address to answer on (the cluster harness: the host's end of its bridge).
        port: 0 picks a free one; 53 where resolv.conf names the server (it has no port).
        zone: the records to serve (a server started again after a stop serves the same ones); default: a new zone.

    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, zone: Zone | None = None) -> None:
        self.zone = zone or Zone()
        quiet = DNSLogger("-request,-reply,-truncated,-error,-recv,-send,-data")
        self._server = DNSServer(self.zone, address=host, port=port, logger=quiet)

    @property
    def address(self) -> str:
        host, port = self._server.server.server_address[:2]
        return f"{host}:{port}"

    def start(self) -> DnsServer:
        self._server.start_thread()
        return self

    def stop(self) -> None:
        self._server.stop()
        self._server.server.server_close()


def free_port_on(*hosts: str) -> int:
    """A port free on every host (workers on 127.0.0.x share one: an A record carries no port)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((hosts[0], 0))
            port: int = probe.getsockname()[1]
        try:
            for host in hosts[1:]:
                with socket.socket() as other:
                    other.bind((host, port))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no port free on all of {hosts}")
