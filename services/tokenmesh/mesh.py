"""The embedded default: N workers (each with its Triton), a prober, a router and the HTTP gateway.

Every service runs as its own child process (``python -m tokenmesh <service>``)
on loopback, exactly as Kubernetes would run it. Children learn nothing from
us but flags; we learn their ports from the ready files they write once
SERVING. Children die with this process, even when it is SIGKILLed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from tokenmesh.config import check, not_a_setting, setting
from tokenmesh.process import dies_with_parent, stop_process

METERED = ("router", "worker", "prober", "gateway")
"""The services that serve metrics of their own when MeshConfig.metrics is set."""


def port_or_off(value: str) -> int | None:
    """A port number, or ``off`` (None: not started)."""
    return None if value.strip().lower() == "off" else int(value)


@dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """What ``tokenmesh up`` starts (flags ``--name``, env ``TOKENMESH_UP_NAME``; in code: ``Mesh(MeshConfig(...))``).

    Built in code it starts no gateway and no metrics unless asked; :class:`UpConfig` holds what the command
    starts when told nothing else.
    """

    workers: int = setting(2, "number of workers, each with its own Triton server")
    host: str = setting("127.0.0.1", "address every service listens on")
    port: int = setting(50051, "router port; 0 picks a free one")
    threads: int = setting(0, "llama.cpp threads per worker; 0 = the machine's cores divided by the workers")
    slots: int = setting(0, "concurrent generations per worker; 0 keeps the model's value")
    model_repository: str = setting("", "Triton model repository for every worker; empty = the shipped model (--model)")
    router_processes: int = setting(
        1, "router processes sharing its port with SO_REUSEPORT (tokenmesh router --processes)"
    )
    # SmolLM2's llama.cpp computes on the same cores as the processes that relay its tokens; at equal
    # priority each relayed token waited for the scheduler to preempt it (SmolLM2, 8 streams: engine's first
    # token -> caller p50 10.7 ms, 3.2 ms niced). The synthetic model is the opposite: its per-token work is
    # Python, like the relays'; niced, it starved at 24k tokens/s (router_cost.py: mesh 14.3k tokens/s vs 22.4k).
    triton_nice: int | None = setting(
        None,
        "niceness (0-19) of every worker's Triton and its model; unset: 19 for "
        "the shipped SmolLM2 (llama.cpp then yields the cores at once to the "
        "processes relaying its tokens), 0 for any other repository, such as the "
        "synthetic model, whose per-token work is like theirs",
        parse=int,
    )
    gateway_port: int | None = setting(
        None,
        "port of the OpenAI-compatible HTTP gateway in front of the router; 0 "
        "picks a free one; off (unset in code) = no gateway",
        parse=port_or_off,
    )
    tls_dir: str = setting(
        "",
        "run every service with mutual TLS from the certificates in this folder "
        "(<service>.crt/.key and ca.crt, as tokenmesh certs makes them; tokenmesh up makes "
        "them there unless ca.crt exists); empty = plaintext (or --tls: a temporary folder)",
    )
    metrics: bool = setting(
        False, "router, workers, prober and gateway serve Prometheus metrics, each on a free port (printed at start)"
    )
    log_dir: str = setting("", "write each service's log to LOG_DIR/<name>.log; empty = stderr")
    start_timeout_s: float = setting(240.0, "how long the services may take to become SERVING")
    extra_env: dict[str, str] = not_a_setting(dict)
    """Environment added for every child (tests set TOKENMESH_* knobs here)."""

    def __post_init__(self) -> None:
        """Validate ranges."""
        check(1 <= self.workers <= 64, f"workers must be 1..64, got {self.workers}")
        check(0 <= self.port <= 65535, f"port must be 0..65535, got {self.port}")
        check(
            self.gateway_port is None or 0 <= self.gateway_port <= 65535,
            f"gateway_port must be 0..65535 (or off: no gateway), got {self.gateway_port}",
        )
        check(self.threads >= 0, f"threads must be >= 0, got {self.threads}")
        check(self.slots >= 0, f"slots must be >= 0, got {self.slots}")
        check(1 <= self.router_processes <= 64, f"router_processes must be 1..64, got {self.router_processes}")
        check(
            self.triton_nice is None or 0 <= self.triton_nice <= 19,
            f"triton_nice must be 0..19, got {self.triton_nice}",
        )
        check(self.start_timeout_s > 0, f"start_timeout_s must be > 0, got {self.start_timeout_s}")

    @property
    def engine_nice(self) -> int:
        """The niceness the workers give their Triton."""
        if self.triton_nice is not None:
            return self.triton_nice
        return 0 if self.model_repository else 19


@dataclass(frozen=True, kw_only=True)
class UpConfig(MeshConfig):
    """What ``tokenmesh up`` starts when told nothing else: the mesh with the gateway on 8000 and metrics on.

    Only the defaults differ from :class:`MeshConfig` (redeclared fields keep their place).
    """

    gateway_port: int | None = setting(
        8000,
        "port of the OpenAI-compatible HTTP gateway in front of the router; 0 picks a free one; off = no gateway",
        parse=port_or_off,
    )
    metrics: bool = setting(
        True, "router, workers, prober and gateway serve Prometheus metrics, each on a free port (printed at start)"
    )


@dataclass
class Child:
    """One service process of the mesh."""

    name: str
    proc: subprocess.Popen[bytes]
    ready_file: Path
    log_path: Path | None
    info: dict[str, object] = field(default_factory=dict)

    @property
    def address(self) -> str:
        """host:port the service listens on (after it is ready)."""
        return str(self.info["address"])

    def log_tail(self, lines: int = 20) -> str:
        """End of its log (when logging to a file)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


class MeshStartError(RuntimeError):
    """A service of the mesh failed to start; ``services`` names which (e.g. ``("gateway",)``)."""

    services: tuple[str, ...]

    def __init__(self, message: str, services: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.services = services


class Mesh:
    """Start and stop the embedded mesh; usable as a context manager."""

    def __init__(self, config: MeshConfig) -> None:
        self.config = config
        self._tmp = tempfile.TemporaryDirectory(prefix="tokenmesh-up-")
        self.run_dir = Path(self._tmp.name)
        self.workers: list[Child] = []
        self.router: Child | None = None
        self.prober: Child | None = None
        self.gateway: Child | None = None
        self.metrics_urls: dict[str, str] = {}
        """Each service's Prometheus endpoint by name (with MeshConfig.metrics)."""
        self._logs: list[IO[bytes]] = []

    def cpus_of(self, index: int) -> list[int]:
        """The CPUs worker index is pinned to: an equal share, or one each, round robin, when short."""
        cores = sorted(os.sched_getaffinity(0))
        workers = self.config.workers
        if workers >= len(cores):
            return [cores[index % len(cores)]]
        share = len(cores) // workers
        return cores[index * share : (index + 1) * share]

    @property
    def threads_per_worker(self) -> int:
        """llama.cpp threads each worker's model gets (its CPU share)."""
        return self.config.threads or len(self.cpus_of(0))

    def spawn(self, name: str, service: str, *args: str) -> Child:
        """Start ``tokenmesh <service> <args>`` with a ready file; return at once."""
        ready = self.run_dir / f"{name}.ready"
        ready.unlink(missing_ok=True)
        log_path: Path | None = None
        out: int | IO[bytes] | None = None
        if self.config.log_dir:
            Path(self.config.log_dir).mkdir(parents=True, exist_ok=True)
            log_path = Path(self.config.log_dir) / f"{name}.log"
            log_file = log_path.open("ab")
            self._logs.append(log_file)
            out = log_file
        cmd = [sys.executable, "-m", "tokenmesh", service, "--ready-file", str(ready), *args]
        if self.config.tls_dir and service in METERED:  # each with its own identity, mutual TLS
            folder = Path(self.config.tls_dir)
            cmd += [
                "--tls-mode",
                "mtls",
                "--tls-cert",
                str(folder / f"{service}.crt"),
                "--tls-key",
                str(folder / f"{service}.key"),
                "--tls-ca",
                str(folder / "ca.crt"),
            ]
        if self.config.metrics and service in METERED:
            with socket.socket() as probe:  # a free port now; the service binds it at once
                probe.bind((self.config.host, 0))
                port = probe.getsockname()[1]
            cmd += ["--metrics-port", str(port)]
            self.metrics_urls[name] = f"http://{self.config.host}:{port}/metrics"
        proc = subprocess.Popen(  # noqa: S603 - our own interpreter and module
            dies_with_parent(cmd),  # no child outlives `up`, even a SIGKILLed one
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
            env={**os.environ, **self.config.extra_env},
        )
        return Child(name, proc, ready, log_path)

    def wait_ready(self, children: list[Child]) -> None:
        """Block until every child wrote its ready file, or raise MeshStartError."""
        deadline = time.monotonic() + self.config.start_timeout_s
        pending = list(children)
        while pending:
            for child in list(pending):
                if child.ready_file.exists():
                    child.info = json.loads(child.ready_file.read_text())
                    pending.remove(child)
                elif child.proc.poll() is not None:
                    raise MeshStartError(
                        f"{child.name} exited with {child.proc.returncode} during start\n{child.log_tail()}",
                        (child.name,),
                    )
            if pending and time.monotonic() > deadline:
                names = ", ".join(c.name for c in pending)
                raise MeshStartError(
                    f"{names} not ready after {self.config.start_timeout_s:.0f} s", tuple(c.name for c in pending)
                )
            time.sleep(0.1)

    def _worker_args(self, i: int) -> list[str]:
        """Worker i's command-line flags: its threads, work folder, CPUs and engine niceness."""
        cfg = self.config
        args = [
            "--host",
            cfg.host,
            "--port",
            "0",
            "--threads",
            str(self.threads_per_worker),
            "--work-dir",
            str(self.run_dir / f"worker-{i}"),
            "--cpus",
            ",".join(map(str, self.cpus_of(i))),
            "--triton-nice",
            str(cfg.engine_nice),
        ]
        if cfg.slots:
            args += ["--slots", str(cfg.slots)]
        if cfg.model_repository:
            args += ["--model-repository", cfg.model_repository]
        return args

    def start(self) -> None:
        """Workers first (in parallel), then the router, then the prober (and the gateway)."""
        cfg = self.config
        try:
            for i in range(cfg.workers):
                self.workers.append(self.spawn(f"worker-{i}", "worker", *self._worker_args(i)))
            self.wait_ready(self.workers)
            addresses = ",".join(w.address for w in self.workers)
            self.router = self.spawn(
                "router",
                "router",
                "--host",
                cfg.host,
                "--port",
                str(cfg.port),
                "--workers",
                addresses,
                "--processes",
                str(cfg.router_processes),
            )
            self.wait_ready([self.router])
            self.prober = self.spawn(
                "prober",
                "prober",
                "--host",
                cfg.host,
                "--port",
                "0",
                "--workers",
                addresses,
                "--routers",
                self.router.address,
            )
            if cfg.gateway_port is not None:
                self.gateway = self.spawn(
                    "gateway",
                    "gateway",
                    "--host",
                    cfg.host,
                    "--port",
                    str(cfg.gateway_port),
                    "--routers",
                    self.router.address,
                )
            self.wait_ready([c for c in (self.prober, self.gateway) if c is not None])
        except BaseException:
            self.stop()
            raise

    def supervise(self, report: Callable[[str], None], poll_s: float = 0.2) -> str:
        """Block while the mesh runs; return why it cannot go on.

        A worker that exits is reported and the mesh goes on without it (the
        prober sets its weight to 0). The router, prober or gateway exiting ends it.
        """
        reported: set[str] = set()
        while True:
            for child in self.children():
                code = child.proc.poll()
                if code is None or child.name in reported:
                    continue
                if child in self.workers:
                    reported.add(child.name)
                    report(f"{child.name} ({child.address}) exited with {code}; serving on without it")
                else:
                    return f"{child.name} exited with {code}"
            time.sleep(poll_s)

    def children(self) -> list[Child]:
        """Every started child, the gateway and router first (the order they are stopped in)."""
        return [c for c in (self.gateway, self.router, self.prober, *self.workers) if c is not None]

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM each child (router first, so it drains), SIGKILL stragglers. Idempotent."""
        for child in self.children():
            if child.proc.poll() is None:
                child.proc.terminate()
        deadline = time.monotonic() + timeout_s
        for child in self.children():
            stop_process(child.proc, max(0.1, deadline - time.monotonic()))
        for log_file in self._logs:
            log_file.close()
        self._logs.clear()
        self._tmp.cleanup()

    def __enter__(self) -> Mesh:
        """Start the mesh."""
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop the mesh."""
        self.stop()
