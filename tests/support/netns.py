"""Pods on one machine: a network namespace per service, each with its own address on one bridge.

Every name the harness makes carries :data:`PREFIX` and the harness's pid (``tmc<pid>...``): the bridge
``tmc<pid>br``, the host ends of the veth pairs ``tmc<pid>v<i>``, the namespaces ``tmc<pid>-<pod>`` (and their
``/etc/netns/<namespace>/resolv.conf``, which ``ip netns exec`` mounts over ``/etc/resolv.conf``: the pod's
DNS is the harness's server). :meth:`Network.teardown` removes all of it, also from ``atexit`` and on SIGTERM; a
run that was SIGKILLed leaves names whose pid is dead, and the next :class:`Network` removes those first
(:func:`clean_stale`). The pods have no default route: their traffic stays on the bridge, between the
namespaces the harness made and the host end of the bridge (the callers and the DNS server).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import psutil

PREFIX = "tmc"
"""What every namespace, link and /etc/netns folder the harness makes starts with."""
NETNS_ETC = Path("/etc/netns")
_OWNED = re.compile(rf"^{PREFIX}(\d+)")


def why_not_available() -> str:
    """Why namespaces cannot be made here ('' when they can): the cluster tests skip with it."""
    if os.geteuid() != 0:
        return "network namespaces, veth pairs and iptables need root"
    missing = [tool for tool in ("ip", "iptables") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (scripts/install_debian_packages.sh installs them)"
    return ""


def ip(*args: str, namespace: str = "", check: bool = True) -> str:
    """Run ``ip`` (inside namespace when given); its output."""
    argv = ["ip", *(("-n", namespace) if namespace else ()), *args]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)  # noqa: S603 - fixed tool
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
    return done.stdout


def in_namespace(namespace: str, argv: list[str]) -> list[str]:
    """argv run inside namespace (``ip netns exec`` execs it: the same pid, the pod's /etc/resolv.conf)."""
    return ["ip", "netns", "exec", namespace, *argv]


def namespace_pids(namespace: str) -> list[int]:
    """Processes running inside namespace now."""
    return [int(pid) for pid in ip("netns", "pids", namespace, check=False).split()]


def _owner_alive(name: str) -> bool:
    match = _OWNED.match(name)
    if match is None:
        return True  # not the harness's
    try:
        return "python" in " ".join(psutil.Process(int(match.group(1))).cmdline())
    except psutil.Error:
        return False


def harness_namespaces(tag: str = PREFIX) -> list[str]:
    """Namespaces whose name starts with tag."""
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.startswith(tag)]


def harness_links(tag: str = "") -> list[str]:
    """The bridges and veth ends in this namespace that a harness made (tag: only those of one run)."""
    names = (line.split(":")[1].strip().split("@")[0] for line in ip("-o", "link", "show").splitlines())
    run = re.escape(tag) if tag else PREFIX + r"\d+"
    own = re.compile(rf"^{run}(br|v\d+|p\d+)$")
    return [name for name in names if own.match(name)]


def _remove_namespace(namespace: str) -> None:
    for pid in namespace_pids(namespace):  # only processes inside the harness's own namespace
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    ip("netns", "delete", namespace, check=False)
    shutil.rmtree(NETNS_ETC / namespace, ignore_errors=True)


def clean_stale() -> list[str]:
    """Remove the namespaces, links and /etc/netns folders of harness runs that are gone; what was removed."""
    removed = [ns for ns in harness_namespaces() if not _owner_alive(ns)]
    for namespace in removed:
        _remove_namespace(namespace)
    for link in harness_links():
        if not _owner_alive(link):
            ip("link", "delete", link, check=False)
            removed.append(link)
    if NETNS_ETC.is_dir():
        for folder in NETNS_ETC.iterdir():
            if folder.name.startswith(PREFIX) and not _owner_alive(folder.name):
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(str(folder))
    return removed


@dataclass(frozen=True)
class Pod:
    """One namespace on the bridge."""

    name: str
    namespace: str
    address: str
    """Its IPv4 address on the bridge."""


class Network:
    """A bridge, and pods attached to it; every piece removed by :meth:`teardown` (idempotent).

    Args:
        subnet_octet: the third octet of the bridge's 10.213.X.0/24 (default: from the pid, the next one free).

    """

    tag: str
    """The prefix of every name this network makes (``tmc<pid>``)."""
    bridge: str
    subnet: str
    """The first three octets, e.g. 10.213.7."""
    gateway: str
    """The host's address on the bridge (callers, the DNS server)."""
    pods: dict[str, Pod]
    stale_removed: list[str]
    """What :func:`clean_stale` removed when this network was made."""
    _torn_down: bool

    def __init__(self, subnet_octet: int | None = None) -> None:
        self.stale_removed = clean_stale()
        self.tag = f"{PREFIX}{os.getpid()}"
        self.bridge = f"{self.tag}br"
        octet = os.getpid() % 250 if subnet_octet is None else subnet_octet
        routes = ip("-4", "route", "show")
        while subnet_octet is None and f"10.213.{octet}." in routes:  # another run's bridge
            octet = (octet + 1) % 250
        self.subnet = f"10.213.{octet}"
        self.gateway = f"{self.subnet}.1"
        self.pods = {}
        self._torn_down = False
        atexit.register(self.teardown)
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # SIGTERM runs finally blocks and atexit
            signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            ip("link", "add", self.bridge, "type", "bridge")
            ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
        except BaseException:
            self.teardown()
            raise

    def add_pod(self, name: str, nameserver: str = "", search: str = "") -> Pod:
        """A namespace with loopback and one veth on the bridge; its resolv.conf names nameserver."""
        index = len(self.pods)
        pod = Pod(name, f"{self.tag}-{name}", f"{self.subnet}.{10 + index}")
        host_end, pod_end = f"{self.tag}v{index}", f"{self.tag}p{index}"
        self.pods[name] = pod
        if nameserver:
            folder = NETNS_ETC / pod.namespace
            folder.mkdir(parents=True, exist_ok=True)
            lines = [f"nameserver {nameserver}", *([f"search {search}"] if search else []), "options ndots:5"]
            (folder / "resolv.conf").write_text("\n".join(lines) + "\n")
        ip("netns", "add", pod.namespace)
        ip("link", "add", host_end, "type", "veth", "peer", "name", pod_end)
        ip("link", "set", pod_end, "netns", pod.namespace)
        ip("link", "set", host_end, "master", self.bridge, "up")
        ip("link", "set", "lo", "up", namespace=pod.namespace)
        ip("link", "set", pod_end, "name", "eth0", namespace=pod.namespace)
        ip("addr", "add", f"{pod.address}/24", "dev", "eth0", namespace=pod.namespace)
        ip("link", "set", "eth0", "up", namespace=pod.namespace)
        return pod

    def iptables(self, pod: Pod, *rule: str) -> None:
        """Run ``iptables <rule>`` inside the pod (its rules go with its namespace)."""
        argv = in_namespace(pod.namespace, ["iptables", "-w", *rule])
        done = subprocess.run(argv, capture_output=True, text=True, check=False)  # noqa: S603 - fixed tool
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")

    def leftovers(self) -> list[str]:
        """Namespaces, links and /etc/netns folders of this network that still exist."""
        found = harness_namespaces(f"{self.tag}-") + harness_links(self.tag)
        if NETNS_ETC.is_dir():
            found += [str(p) for p in NETNS_ETC.iterdir() if p.name.startswith(f"{self.tag}-")]
        return found

    def teardown(self) -> None:
        """Remove every namespace (its processes, veth and rules with it), the bridge and the resolv.conf files."""
        if self._torn_down:
            return
        self._torn_down = True
        for pod in self.pods.values():
            _remove_namespace(pod.namespace)
        for link in harness_links(self.tag):
            ip("link", "delete", link, check=False)
        atexit.unregister(self.teardown)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
