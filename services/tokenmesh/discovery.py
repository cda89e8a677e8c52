"""Where a service's peers come from: the addresses it was given, or DNS names re-resolved on an interval.

``--discovery dns`` takes ``host:port`` names (a Kubernetes headless Service:
one A record per ready pod) and resolves them every ``--discovery-interval-s``
itself: a gRPC ``dns:///`` channel re-resolves only when a connection drops,
so a pod added behind the name would stay unseen, and one channel to a name
cannot say which pod a stream runs on. The owner (router, prober) gets one
call per address that appears and one per address that goes, and keeps one
channel per address.

Answers that would cut work in progress are not trusted at once: a lookup that
fails (timeout, SERVFAIL) changes nothing and is retried next round; a name that
answers empty (NXDOMAIN, no records: every pod of a rollout gone at once, or a
DNS hiccup) drops its addresses only after it stayed empty for two intervals.
An address missing from a non-empty answer goes at once (its pod is
terminating); the owner drains it, it does not cut it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.rdatatype
import dns.resolver

log = logging.getLogger(__name__)

EMPTY_ROUNDS = 3
"""Consecutive empty answers (the name empty for two intervals) after which a name's addresses go."""

Resolve = Callable[[str], Awaitable[list[str]]]
"""Looks a host name up: its IP addresses ([] when the name has none); raises LookupFailed when it cannot tell."""


class LookupFailed(Exception):
    """The lookup did not get an answer (timeout, server failure): nothing is known about the name."""


class DnsResolver:
    """A and AAAA lookups with dnspython, uncached, so every round sees the records as they are now.

    Args:
        server: ``ip:port`` of the DNS server to ask ('' = the system's, from /etc/resolv.conf, with its
            search domains, as a pod's own lookups get them).
        timeout_s: longest wait for one lookup.

    """

    _resolver: dns.asyncresolver.Resolver

    def __init__(self, server: str = "", timeout_s: float = 2.0) -> None:
        if server:
            host, _, port = server.rpartition(":")
            self._resolver = dns.asyncresolver.Resolver(configure=False)
            self._resolver.nameservers = [dns.nameserver.Do53Nameserver(host.strip("[]"), int(port))]
        else:
            self._resolver = dns.asyncresolver.Resolver()
        self._resolver.lifetime = timeout_s

    async def __call__(self, host: str) -> list[str]:
        """IP addresses of host: its A records, then its AAAA records."""
        found: list[str] = []
        for kind in (dns.rdatatype.A, dns.rdatatype.AAAA):
            try:
                answer = await self._resolver.resolve(host, kind, search=True)
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                continue
            except (dns.exception.Timeout, dns.resolver.NoNameservers) as exc:
                raise LookupFailed(f"{type(exc).__name__}: {exc}") from exc
            found.extend(record.to_text() for record in answer)
        return found


def join(ip: str, port: str) -> str:
    """host:port for an IP address (an IPv6 one in brackets)."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def literal_ip(host: str) -> bool:
    """Whether host is an IP address (needs no lookup)."""
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


@dataclass
class _Name:
    host: str
    port: str
    addresses: set[str] = field(default_factory=set)
    empty_rounds: int = 0
    problem: str = ""
    """What the last round said was wrong ('' = nothing), so each problem is logged once."""


class Discovery:
    """Keeps the addresses behind a set of ``host:port`` names current, telling the owner of each change.

    Args:
        names: ``host:port`` names (an IP host is its own address).
        resolve: looks a host up (a :class:`DnsResolver` in production).
        on_add: called with (address, the name that found it) for each address that appears.
        on_remove: called with (address, why) once no name has the address any more.
        what: what the addresses are, in logs ("worker", "router").

    """

    found: dict[str, set[str]]
    """Address -> the names that have it now."""
    _names: list[_Name]
    _resolve: Resolve
    _on_add: Callable[[str, str], None]
    _on_remove: Callable[[str, str], None]
    _what: str

    def __init__(
        self,
        names: tuple[str, ...],
        resolve: Resolve,
        on_add: Callable[[str, str], None],
        on_remove: Callable[[str, str], None],
        what: str = "peer",
    ) -> None:
        self._names = []
        for name in names:
            host, _, port = name.rpartition(":")
            self._names.append(_Name(host, port))
        self._resolve = resolve
        self._on_add = on_add
        self._on_remove = on_remove
        self._what = what
        self.found = {}

    async def refresh(self) -> None:
        """One round: look every name up and apply what changed."""
        answers = await asyncio.gather(*(self._lookup(name) for name in self._names))
        for name, answer in zip(self._names, answers, strict=True):
            self._apply(name, answer)

    async def run(self, interval_s: float, then: Callable[[], None] | None = None) -> None:
        """Refresh every interval_s, for ever (the first round is the caller's :meth:`refresh`); then after each."""
        while True:
            await asyncio.sleep(interval_s)
            await self.refresh()
            if then is not None:
                then()

    async def _lookup(self, name: _Name) -> set[str] | None:
        """The name's addresses now; None when the lookup failed."""
        if literal_ip(name.host):
            return {join(name.host.strip("[]"), name.port)}
        try:
            return {join(ip, name.port) for ip in await self._resolve(name.host)}
        except LookupFailed as exc:
            self._report(
                name, f"lookup failed ({exc}); keeping its {len(name.addresses)} {self._what}(s), retrying next round"
            )
            return None

    def _apply(self, name: _Name, answer: set[str] | None) -> None:
        label = f"{name.host}:{name.port}"
        if answer is None:
            return
        if not answer:
            name.empty_rounds += 1
            if name.empty_rounds < EMPTY_ROUNDS or not name.addresses:
                kept = (
                    f"; keeping its {len(name.addresses)} {self._what}(s) until it stays empty for "
                    f"{EMPTY_ROUNDS - 1} intervals"
                    if name.addresses
                    else "; looking again every interval"
                )
                self._report(name, f"answers no address (NXDOMAIN or no records){kept}")
                return
        else:
            name.empty_rounds = 0
            self._report(name, "")
        for address in sorted(answer - name.addresses):
            name.addresses.add(address)
            names = self.found.setdefault(address, set())
            names.add(label)
            if len(names) == 1:
                log.info("%s %s found by DNS name %s", self._what, address, label)
                self._on_add(address, label)
        for address in sorted(name.addresses - answer):
            name.addresses.discard(address)
            names = self.found.get(address, set())
            names.discard(label)
            if not names:
                self.found.pop(address, None)
                why = f"gone from DNS name {label}"
                log.info("%s %s %s; draining it", self._what, address, why)
                self._on_remove(address, why)

    def _report(self, name: _Name, problem: str) -> None:
        if problem == name.problem:
            return
        label = f"{name.host}:{name.port}"
        if problem:
            log.warning("discovery: DNS name %s %s", label, problem)
        elif name.problem:
            log.info("discovery: DNS name %s answers again", label)
        name.problem = problem
