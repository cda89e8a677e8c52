"""The worker's settings, and the CPU lists they name."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tokenmesh.config import ServerSettings, check, setting
from tokenmesh.tls import TlsSettings


@dataclass(frozen=True, kw_only=True)
class WorkerConfig(ServerSettings, TlsSettings):
    """Settings of one worker (flags ``--name``, env ``TOKENMESH_WORKER_NAME``)."""

    port: int = setting(50061, "gRPC port; 0 picks a free one")
    triton_url: str = setting("", "use this running Triton (host:port, e.g. a sidecar) instead of starting one")
    triton_tls: bool = setting(
        False,
        "with --triton-url: reach that Triton over TLS, verifying it against "
        "--tls-ca and, with --tls-mode mtls, presenting --tls-cert (Triton's "
        "--grpc-use-ssl-mutual)",
    )
    triton_metrics_url: str = setting(
        "", "that Triton's metrics endpoint (http://host:8002/metrics), for its pending count; ours is known"
    )
    triton_trace_url: str = setting(
        "",
        "the Triton we start exports OpenTelemetry traces of every request to "
        "this OTLP/HTTP endpoint (http://collector:4318/v1/traces), as children "
        "of the worker's span; empty = Triton does not trace",
    )
    model_repository: str = setting("", "model repository for the Triton we start; empty = the shipped SmolLM2 model")
    devices: str = setting("", "CUDA_VISIBLE_DEVICES for our Triton; empty inherits the environment")
    cpus: str = setting("", "CPUs to pin the worker and its Triton to, e.g. '0-3' or '0,2'; empty = no pinning")
    threads: int = setting(0, "llama.cpp threads per model (config.pbtxt n_threads); 0 keeps the model's value")
    slots: int = setting(0, "concurrent generations per model (config.pbtxt n_parallel); 0 keeps the model's value")
    triton_nice: int = setting(
        0,
        "niceness (0-19) of the Triton we start and its models; where the engine shares "
        "CPUs with the mesh, a high value lets every relayed token preempt it at once",
    )
    work_dir: str = setting("", "folder for Triton's files and log; empty = a new temporary folder")
    resume_grace_s: float = setting(30.0, "how long a generation whose stream dropped is kept (running) for Resume")
    replay_buffer_bytes: int = setting(1024 * 1024, "per-generation replay buffer; a reader further behind fails")
    memory_threshold: float = setting(0.92, "device memory fraction above which no generation is added")
    link_linger_us: int = setting(
        1000,
        "on a router's Worker/Link with 2 or more streams, wait up to this long (0-1000 us) for more of them "
        "to have a chunk before a send holds fewer chunks than streams (never with one stream alone)",
    )
    drain_grace_s: float = setting(30.0, "on SIGTERM, how long in-flight generations may take to finish")
    backend_restart_timeout_s: float = setting(
        600.0,
        "a Triton that cannot be restarted within this stops the "
        "worker with a non-zero exit (its supervisor restarts it)",
    )

    def __post_init__(self) -> None:
        """Validate ranges."""
        self.check_tls()
        check(
            not self.triton_tls or (bool(self.triton_url) and self.tls_mode != "off"),
            "--triton-tls needs --triton-url and --tls-mode tls or mtls (its CA, and for mtls its certificate)",
        )
        self.check_server()
        check(self.threads >= 0, f"threads must be >= 0, got {self.threads}")
        check(self.slots >= 0, f"slots must be >= 0, got {self.slots}")
        check(0 <= self.triton_nice <= 19, f"triton_nice must be 0..19, got {self.triton_nice}")
        check(0 < self.memory_threshold <= 1, f"memory_threshold must be in (0, 1], got {self.memory_threshold}")
        check(self.drain_grace_s >= 0, f"drain_grace_s must be >= 0, got {self.drain_grace_s}")
        check(
            self.backend_restart_timeout_s > 0,
            f"backend_restart_timeout_s must be > 0, got {self.backend_restart_timeout_s}",
        )
        check(self.resume_grace_s > 0, f"resume_grace_s must be > 0, got {self.resume_grace_s}")
        check(0 <= self.link_linger_us <= 1000, f"link_linger_us must be 0..1000, got {self.link_linger_us}")
        check(self.replay_buffer_bytes >= 4096, f"replay_buffer_bytes must be >= 4096, got {self.replay_buffer_bytes}")
        if self.model_repository:
            check(Path(self.model_repository).is_dir(), f"model_repository {self.model_repository!r} is not a folder")
        if self.cpus:
            available = os.sched_getaffinity(0)
            wanted = parse_cpus(self.cpus)
            check(
                wanted <= available,
                f"cpus {self.cpus!r} names CPUs this process cannot use (available: {format_cpus(available)})",
            )


def parse_cpus(spec: str) -> set[int]:
    """'0-2,5' -> {0, 1, 2, 5}; ConfigError on anything else."""
    cpus: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        low, _, high = part.partition("-")
        check(low.isdigit() and (not high or high.isdigit()), f"cpus: {part!r} is not N or N-M")
        cpus.update(range(int(low), int(high or low) + 1))
    check(bool(cpus), "cpus: name at least one CPU")
    return cpus


def format_cpus(cpus: set[int] | tuple[int, ...]) -> str:
    """{0, 1, 2, 5} -> '0-2,5'."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)
