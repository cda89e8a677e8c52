"""A tokenmesh cluster on one machine: each service in its own network namespace, as the Helm chart runs it.

Workers (each with its real Triton and the synthetic model), routers, the prober and the gateway each get a pod
(:mod:`tests.support.netns`): their own address on one bridge, their own loopback (each worker's Triton ports are
its own), and a resolv.conf naming the harness's DNS server (the dnslib server of the discovery tests, on the
host's end of the bridge, port 53). They are started all at once, as Kubernetes starts pods, with the arguments
and environment ``helm template`` renders for the chart's Deployments (``--discovery=dns`` and the headless
Services' names, which the DNS server answers with the pods' addresses); the harness adds only the
``--ready-file`` it waits for and the synthetic model's repository (the chart's ``worker.extraArgs``). The
gateway, which the chart does not deploy, gets the router Service's name. The DNS records stay as they are when
a pod restarts: its address does not change, and Kubernetes would take it out of the endpoints only after its
readiness probe failed for 10 s.

``tests/cluster`` (pytest fixture) and ``benchmarks/chaos.py`` both run this code.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import grpc
import psutil
import yaml

from tests.support.dns_server import DnsServer
from tests.support.netns import Network, Pod, in_namespace, namespace_pids
from tests.support.processes import descendants
from tokenmesh.process import dies_with_parent
from tokenmesh.v1 import router_pb2, router_pb2_grpc
from tokenmesh.worker.triton import synthetic_repository

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "tokenmesh"
RELEASE, NAMESPACE = "tm", "chaos"
ROUTER_SERVICE = f"{RELEASE}-tokenmesh-router.{NAMESPACE}.svc.cluster.local"
"""The router Service callers use (ClusterIP in the chart; here its name answers with the router pods)."""
SEARCH = f"{NAMESPACE}.svc.cluster.local svc.cluster.local cluster.local"
GATEWAY_PORT = 8000


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """What the cluster runs."""

    log_dir: Path
    """Each service's log: <log_dir>/<pod>.log."""
    workers: int = 3
    """Worker pods (each with its Triton)."""
    routers: int = 1
    """Router pods."""
    gateway: bool = True
    """A gateway pod in front of the routers."""
    slots: int = 8
    """The synthetic model's slots per worker (n_parallel): each worker's concurrency limit."""
    tokens_per_s: float = 50
    """Tokens per second of each generation."""
    responses_per_s: float = 10
    """Responses (chunks) per second of each generation."""
    max_queue: int = 8
    """Chart value router.maxQueue (--max-queue): generations that may wait for a slot, per router."""
    discovery_interval_s: float = 1.0
    """Chart value discovery.intervalSeconds."""
    start_timeout_s: float = 300
    """How long the pods may take to become ready."""


def render_chart(values: dict[str, Any], folder: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Container name -> (args, env) of the chart's router, worker and prober Deployments rendered with values."""
    values_file = folder / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    helm = Path(sys.prefix) / "bin" / "helm3"  # scripts/install_helm.py puts it in the venv
    argv = [str(helm), "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "-f", str(values_file)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)  # noqa: S603 - our venv's helm
    if done.returncode != 0:
        raise RuntimeError(f"helm template failed: {done.stderr}")
    found: dict[str, tuple[list[str], dict[str, str]]] = {}
    for doc in yaml.safe_load_all(done.stdout):
        if not doc or doc.get("kind") != "Deployment":
            continue
        for container in doc["spec"]["template"]["spec"]["containers"]:
            env = {e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e}
            found[container["name"]] = ([str(a) for a in container["args"]], env)
    return found


def flag(args: list[str], name: str) -> str:
    """The value of ``--name=value`` in args."""
    return next(a.split("=", 1)[1] for a in args if a.startswith(f"--{name}="))


@dataclass
class Service:
    """One service in its pod."""

    pod: Pod
    argv: list[str]
    """``tokenmesh`` arguments, the service's name first."""
    env: dict[str, str]
    ready_file: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    pids: list[int] = field(default_factory=list)
    """Every process seen in its tree (checked to be gone at the end)."""

    @property
    def name(self) -> str:
        """The pod's name (worker-0, router-0, ...)."""
        return self.pod.name

    @property
    def address(self) -> str:
        """pod address:service port."""
        return f"{self.pod.address}:{flag(self.argv, 'port')}"

    def alive(self) -> bool:
        """Its process runs."""
        return self.proc is not None and self.proc.poll() is None

    def note_pids(self) -> None:
        """Remember its process tree now (a Triton and its stubs too)."""
        if self.proc is not None:
            self.pids += [pid for pid in descendants(self.proc.pid) if pid not in self.pids]

    def log_tail(self, lines: int = 30, containing: str = "") -> str:
        """The end of its log: its last lines (those containing ``containing``)."""
        if not self.log_path.exists():
            return ""
        said = [line for line in self.log_path.read_text(errors="replace").splitlines() if containing in line]
        return "\n".join(said[-lines:])


class Cluster:
    """Pods for every service, the DNS server, and the faults the chaos rows inject.

    Args:
        config: what to run.

    """

    config: ClusterConfig
    network: Network | None
    dns: DnsServer | None
    services: dict[str, Service]
    dns_stopped: bool
    """The DNS server is stopped (a chaos row's fault)."""
    _folder: tempfile.TemporaryDirectory[str]
    _logs: list[IO[bytes]]
    _stopped: bool

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.network = None
        self.dns = None
        self.services = {}
        self.dns_stopped = False
        self._folder = tempfile.TemporaryDirectory(prefix="tokenmesh-cluster-")
        self._logs = []
        self._stopped = False

    @property
    def workers(self) -> list[Service]:
        """The worker services, in order."""
        return [s for s in self.services.values() if s.argv[0] == "worker"]

    @property
    def routers(self) -> list[Service]:
        """The router services, in order."""
        return [s for s in self.services.values() if s.argv[0] == "router"]

    @property
    def prober(self) -> Service:
        """The prober service."""
        return self.services["prober"]

    def start(self) -> None:
        """Make the pods and the DNS records, start every service at once, wait until the routers route to all."""
        cfg = self.config
        folder = Path(self._folder.name)
        try:
            self.network = Network()
            self.dns = DnsServer(self.network.gateway, 53).start()
            repository = synthetic_repository(
                folder, tokens_per_s=cfg.tokens_per_s, responses_per_s=cfg.responses_per_s, n_parallel=cfg.slots
            )
            values = {
                "discovery": {"intervalSeconds": cfg.discovery_interval_s},
                "router": {"maxQueue": cfg.max_queue},
                "worker": {"extraArgs": [f"--model-repository={repository}"]},
            }
            chart = render_chart(values, folder)
            for i in range(cfg.workers):
                self._add(f"worker-{i}", *chart["worker"])
            for i in range(cfg.routers):
                self._add(f"router-{i}", *chart["router"])
            self._add("prober", *chart["prober"])
            if cfg.gateway:
                routers = f"--routers={ROUTER_SERVICE}:{flag(chart['router'][0], 'port')}"
                gateway = ["gateway", "--host=0.0.0.0", f"--port={GATEWAY_PORT}", routers]
                self._add("gateway", gateway, chart["router"][1])
            self._publish(chart)
            for service in self.services.values():
                self.spawn(service)
            self.wait_ready(list(self.services.values()))
            self.wait_routable()
        except BaseException:
            self.stop()
            raise

    def _add(self, name: str, args: list[str], env: dict[str, str]) -> None:
        assert self.network is not None
        pod = self.network.add_pod(name, nameserver=self.network.gateway, search=SEARCH)
        ready = Path(self._folder.name) / f"{name}.ready"
        self.services[name] = Service(pod, list(args), env, ready, self.config.log_dir / f"{name}.log")

    def _publish(self, chart: dict[str, tuple[list[str], dict[str, str]]]) -> None:
        """The headless Services' names (and the router Service's) answer with the pods' addresses."""
        assert self.dns is not None
        workers = flag(chart["router"][0], "workers").rsplit(":", 1)[0]
        routers = flag(chart["prober"][0], "routers").rsplit(":", 1)[0]
        self.dns.zone.set(workers, *(s.pod.address for s in self.workers))
        for name in (routers, ROUTER_SERVICE):
            self.dns.zone.set(name, *(s.pod.address for s in self.routers))

    def spawn(self, service: Service) -> None:
        """Start (or start again) the service in its pod; returns at once.

        Only from the main thread: the kernel sends a child's PR_SET_PDEATHSIG (``dies_with_parent``) when the
        *thread* that forked it exits, and asyncio.run ends its pool's threads, so a service started from
        asyncio.to_thread would be SIGKILLed at the end of its row.
        """
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(f"spawn {service.name} from the main thread: it dies with the thread that forks it")
        service.ready_file.unlink(missing_ok=True)
        self.config.log_dir.mkdir(parents=True, exist_ok=True)
        log = service.log_path.open("ab")
        self._logs.append(log)
        argv = [sys.executable, "-m", "tokenmesh", *service.argv, f"--ready-file={service.ready_file}"]
        env = {**os.environ, **service.env}
        # ip netns exec keeps the working directory, but a relative PYTHONPATH must not depend on it.
        env["PYTHONPATH"] = os.pathsep.join(str(Path(p).resolve()) for p in env.get("PYTHONPATH", "").split(":") if p)
        service.proc = subprocess.Popen(  # noqa: S603 - our interpreter, in our namespace
            dies_with_parent(in_namespace(service.pod.namespace, argv)),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def wait_ready(self, services: list[Service]) -> None:
        """Until each service wrote its ready file (it serves); RuntimeError with its log if one exits."""
        deadline = time.monotonic() + self.config.start_timeout_s
        pending = list(services)
        while pending:
            for service in list(pending):
                assert service.proc is not None
                if _ready(service.ready_file):
                    service.note_pids()
                    pending.remove(service)
                elif service.proc.poll() is not None:
                    raise RuntimeError(f"{service.name} exited with {service.proc.returncode}\n{service.log_tail()}")
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"{', '.join(s.name for s in pending)} not ready: {pending[0].log_tail()}")
            time.sleep(0.2)

    def table(self, router: Service) -> router_pb2.RoutingTable:
        """The router's routing table now."""
        with grpc.insecure_channel(router.address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            return stub.GetRoutingTable(router_pb2.GetRoutingTableRequest(), timeout=5)

    def wait_routable(self, timeout_s: float = 120) -> None:
        """Until every router routes to every worker at its full slots."""
        deadline = time.monotonic() + timeout_s
        want = sorted(w.address for w in self.workers)
        for router in self.routers:
            while True:
                table = self.table(router)
                full = [w.address for w in table.workers if routable(w) and w.concurrency_limit == self.config.slots]
                if sorted(full) == want:
                    break
                if time.monotonic() > deadline:
                    lost = [w for w in self.workers if w.address not in full]
                    logs = "".join(
                        f"\n{w.name} (alive: {w.alive()}) log:\n{w.log_tail()}\n"
                        f"{router.name} on it:\n{router.log_tail(10, containing=w.address)}"
                        for w in lost
                    )
                    raise RuntimeError(f"{router.name} does not route to every worker:\n{table}{logs}")
                time.sleep(0.2)

    def kill(self, service: Service) -> None:
        """SIGKILL the service (its Triton dies with it) and reap it."""
        assert service.proc is not None
        service.note_pids()
        service.proc.send_signal(signal.SIGKILL)
        service.proc.wait(30)

    def partition(self, service: Service, peers: list[Service], *, heal: bool = False) -> None:
        """Drop every packet between service and peers, both ways, inside the service's pod (no RST); heal: undo."""
        assert self.network is not None
        action = "-D" if heal else "-A"
        for peer in peers:
            self.network.iptables(service.pod, action, "INPUT", "-s", peer.pod.address, "-j", "DROP")
            self.network.iptables(service.pod, action, "OUTPUT", "-d", peer.pod.address, "-j", "DROP")

    def lose(self, service: Service, probability: float, *, heal: bool = False) -> None:
        """Drop that fraction of the packets in and out of the service's pod, at random; heal: undo."""
        assert self.network is not None
        random = ["-m", "statistic", "--mode", "random", "--probability", f"{probability:g}", "-j", "DROP"]
        for chain in ("INPUT", "OUTPUT"):
            self.network.iptables(service.pod, "-D" if heal else "-A", chain, *random)

    def redirect(self, service: Service, peer: Service, to: str, *, undo: bool = False) -> None:
        """New connections from service to peer's port go to ``to`` (host:port) instead (DNAT in service's pod).

        Connections open already keep their way: :meth:`reset` them.
        """
        assert self.network is not None
        host, port = peer.address.rsplit(":", 1)
        match = ["-p", "tcp", "-d", host, "--dport", port, "-j", "DNAT", "--to-destination", to]
        self.network.iptables(service.pod, "-t", "nat", "-D" if undo else "-A", "OUTPUT", *match)

    def reset(self, service: Service, peer: Service) -> None:
        """Close service's TCP connections to peer's port at once (``ss -K``: the service sees them fail)."""
        host, port = peer.address.rsplit(":", 1)
        argv = in_namespace(service.pod.namespace, ["ss", "-K", "dst", host, "dport", "=", f":{port}"])
        done = subprocess.run(argv, capture_output=True, text=True, check=False)  # noqa: S603 - fixed tool
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")

    def rules(self) -> list[str]:
        """iptables rules (filter and nat) left in the pods: 'pod: rule'."""
        found = []
        for service in self.services.values():
            for table in ("filter", "nat"):
                argv = in_namespace(service.pod.namespace, ["iptables", "-w", "-t", table, "-S"])
                listed = subprocess.run(argv, capture_output=True, text=True, check=True).stdout  # noqa: S603
                found += [f"{service.name}: {line}" for line in listed.splitlines() if line.startswith("-A")]
        return found

    def stop_dns(self) -> None:
        """Stop the DNS server: every lookup of the pods fails (ICMP port unreachable) until :meth:`start_dns`."""
        assert self.dns is not None and not self.dns_stopped
        self.dns.stop()
        self.dns_stopped = True

    def start_dns(self) -> None:
        """Start the DNS server again, on its address, with the records it had."""
        assert self.network is not None and self.dns is not None and self.dns_stopped
        self.dns = DnsServer(self.network.gateway, 53, zone=self.dns.zone).start()
        self.dns_stopped = False

    def stop_draining(self, service: Service, grace_s: float = 60) -> float:
        """SIGTERM the service (it drains) and wait until it exited; seconds it took (:meth:`spawn` starts it
        again, from the main thread)."""
        assert service.proc is not None
        service.note_pids()
        began = time.monotonic()
        service.proc.terminate()
        try:
            service.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            service.proc.kill()
            service.proc.wait()
            raise RuntimeError(f"{service.name} did not exit within {grace_s:g} s of SIGTERM") from None
        return time.monotonic() - began

    def strays(self) -> list[int]:
        """Processes in the pods that belong to no running service (a killed worker's Triton, say)."""
        own: set[int] = set()
        for service in self.services.values():
            if service.alive():
                assert service.proc is not None
                own.update(descendants(service.proc.pid))
        return [pid for s in self.services.values() for pid in namespace_pids(s.pod.namespace) if pid not in own]

    def stop(self, grace_s: float = 40) -> list[str]:
        """Stop every service (SIGTERM, then SIGKILL), remove the pods and the DNS server; what was left behind.

        Idempotent; a second call returns [].
        """
        if self._stopped:
            return []
        self._stopped = True
        running = [s for s in self.services.values() if s.alive()]
        for service in running:
            service.note_pids()
            assert service.proc is not None
            service.proc.terminate()
        deadline = time.monotonic() + grace_s
        for service in running:
            assert service.proc is not None
            try:
                service.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                service.proc.kill()
                service.proc.wait()
        pids = [pid for s in self.services.values() for pid in s.pids]
        deadline = time.monotonic() + 15  # Tritons and their stubs exit after their worker (parent-death signal)
        while any(map(_running, pids)) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [f"process {pid}" for pid in pids if _running(pid)]
        if self.network is not None:
            self.network.teardown()
            left += self.network.leftovers()
        if self.dns is not None and not self.dns_stopped:
            self.dns.stop()
        for log in self._logs:
            log.close()
        self._folder.cleanup()
        return left


def routable(row: router_pb2.RoutingEntry) -> bool:
    """The router sends the worker new work: SERVING with weight > 0, not avoided after a failure, a link open."""
    # State and weight are the prober's once a table is in force, so a worker the prober reaches and this router
    # does not (a partition between the two) still shows SERVING; the router's own view is in the reason ("avoided
    # by this router" while a worker that failed a stream is suspended, router/_pool.py) and in `link`, which is
    # empty while its Worker/Link call is down and being opened again.
    serving = row.state == router_pb2.WORKER_STATE_SERVING and row.weight > 0
    return serving and "avoided" not in row.reason and row.link != ""


def _ready(path: Path) -> bool:
    """The service wrote its ready file (whole: it is JSON)."""
    try:
        json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return True


def _running(pid: int) -> bool:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    return False
