"""The pods' network itself: isolation, a silent partition, and nothing left behind, even by a killed run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.netns import Network, harness_links, harness_namespaces, in_namespace

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PORT = 7000
LISTEN = (
    "import socket, sys\n"
    f"s = socket.create_server(('0.0.0.0', {PORT}))\n"
    "print('up', flush=True)\n"
    "while True:\n"
    "    c, _ = s.accept(); c.sendall(b'hi'); c.close()\n"
)
CONNECT = (
    "import socket, sys\n"
    "try:\n"
    "    print(socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.5).recv(2).decode())\n"
    "except OSError as exc:\n"
    "    print(type(exc).__name__, exc.errno)\n"
)


def connect(network: Network, pod: str, host: str, port: int = PORT) -> str:
    argv = in_namespace(network.pods[pod].namespace, [sys.executable, "-c", CONNECT, host, str(port)])
    return subprocess.run(argv, capture_output=True, text=True, timeout=10, check=True).stdout.strip()


def test_pods_reach_each_other_not_the_outside_and_a_partition_is_silent() -> None:
    network = Network()
    try:
        a, b = network.add_pod("a"), network.add_pod("b")
        argv = in_namespace(a.namespace, [sys.executable, "-c", LISTEN])
        with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as server:  # noqa: S603
            try:
                assert server.stdout is not None and server.stdout.readline().strip() == "up"
                assert connect(network, "b", a.address) == "hi"
                # No default route: the host's own network is unreachable from a pod.
                assert connect(network, "b", "192.0.2.1", 80) == "OSError 101"  # ENETUNREACH
                network.iptables(a, "-A", "INPUT", "-s", b.address, "-j", "DROP")
                began = time.monotonic()
                assert connect(network, "b", a.address) == "TimeoutError None"  # dropped, not refused: no RST
                assert time.monotonic() - began >= 1.4
                network.iptables(a, "-D", "INPUT", "-s", b.address, "-j", "DROP")
                assert connect(network, "b", a.address) == "hi"
            finally:
                server.kill()
    finally:
        network.teardown()
    assert not network.leftovers()
    assert not Path(f"/etc/netns/{a.namespace}").exists()


def test_a_run_killed_with_sigkill_is_cleaned_at_the_next_start_and_sigterm_cleans_up() -> None:
    script = (
        "import sys, time\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from tests.support.netns import Network\n"
        "n = Network(); n.add_pod('x', nameserver=n.gateway)\n"
        "print(n.tag, flush=True); time.sleep(120)\n"
    )
    for sig in (signal.SIGKILL, signal.SIGTERM):
        with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) as run:  # noqa: S603
            assert run.stdout is not None
            tag = run.stdout.readline().strip()
            assert harness_namespaces(f"{tag}-") == [f"{tag}-x"]
            os.kill(run.pid, sig)
            run.wait(30)
        if sig == signal.SIGTERM:  # the run removed what it made
            assert not harness_namespaces(f"{tag}-") and not harness_links(tag)
            continue
        assert harness_namespaces(f"{tag}-") and harness_links(tag)  # left behind ...
        network = Network()  # ... until the next run starts
        try:
            assert f"{tag}-x" in network.stale_removed
            assert not harness_namespaces(f"{tag}-") and not harness_links(tag)
            assert not Path(f"/etc/netns/{tag}-x").exists()
        finally:
            network.teardown()
