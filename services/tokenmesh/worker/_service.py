"""The worker process: its lifecycle over ``tokenmesh.v1.Worker`` and one backend (Triton)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
from pathlib import Path

from tokenmesh.lifecycle import Service
from tokenmesh.metrics import MetricsEndpoint
from tokenmesh.retry import Backoff, Reconnect
from tokenmesh.server import ServiceHost, write_ready_file
from tokenmesh.tls import Tls
from tokenmesh.tracing import Tracing
from tokenmesh.v1 import worker_pb2, worker_pb2_grpc
from tokenmesh.worker._backend import Backend, GenerationParams
from tokenmesh.worker._config import WorkerConfig, format_cpus, parse_cpus
from tokenmesh.worker._devices import nvml_reader
from tokenmesh.worker._servicer import WorkerServicer

log = logging.getLogger(__name__)


def triton_trace_args(url: str) -> tuple[str, ...]:
    """The tritonserver flags that export OpenTelemetry traces of every request to url (none for '')."""
    if not url:
        return ()
    return (
        "--trace-config",
        "mode=opentelemetry",
        "--trace-config",
        f"opentelemetry,url={url}",
        "--trace-config",
        "rate=1",
        "--trace-config",
        "level=TIMESTAMPS",
    )


class Worker(Service):
    """Lifecycle of one worker: start, ready (SERVING), drain, stop.

    Draining: readiness goes NOT_SERVING (routers stop sending work), new
    generations get UNAVAILABLE, in-flight ones may finish within
    ``drain_grace_s``; Attach (resume) and Cancel keep working meanwhile.

    Args:
        config: the worker's settings.
        backend: the engine; None starts (or reaches) Triton as the config says.

    """

    config: WorkerConfig
    backend: Backend
    servicer: WorkerServicer
    metrics_endpoint: MetricsEndpoint | None
    tracing: Tracing
    _tmp: tempfile.TemporaryDirectory[str] | None

    def __init__(self, config: WorkerConfig, backend: Backend | None = None) -> None:
        service_name = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
        self.tracing = Tracing("worker")  # first: the server takes its RPC span interceptor
        tls = Tls(config)
        host = ServiceHost(
            config.host, config.port, [service_name], health_port=config.health_port, tls=tls, tracing=self.tracing
        )
        super().__init__(host, drain_grace_s=config.drain_grace_s, stop_grace_s=config.stop_grace_s)
        self.config = config
        self._tmp = None
        self.backend = backend or self._triton_backend()
        self.metrics_endpoint = None
        self.servicer = WorkerServicer(
            self.backend,
            nvml_reader(config.devices or None),
            config.devices,
            resume_grace_s=config.resume_grace_s,
            replay_buffer_bytes=config.replay_buffer_bytes,
            memory_threshold=config.memory_threshold,
            link_linger_s=config.link_linger_us / 1e6,
        )
        self.servicer.metrics.enabled = bool(config.metrics_port)
        tls.denied = lambda group: self.servicer.metrics.denied.labels(group).inc()
        self.servicer.tracer = self.tracing.tracer
        worker_pb2_grpc.add_WorkerServicer_to_server(self.servicer, host.server)

    def _triton_backend(self) -> Backend:
        from tokenmesh.worker.triton import (
            DEFAULT_MODEL_REPOSITORY,
            TritonBackend,
            TritonBackendConfig,
            TritonProcessConfig,
        )

        cfg = self.config
        if cfg.triton_url:
            tls = None
            if cfg.triton_tls:
                mutual = cfg.tls_mode == "mtls"
                tls = (cfg.tls_ca, cfg.tls_key if mutual else "", cfg.tls_cert if mutual else "")
            return TritonBackend(
                TritonBackendConfig(url=cfg.triton_url, metrics_url=cfg.triton_metrics_url or None, tls=tls)
            )
        if cfg.work_dir:
            work_dir = Path(cfg.work_dir)
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="tokenmesh-worker-")
            work_dir = Path(self._tmp.name)
        overrides = []
        if cfg.threads:
            overrides.append(("n_threads", str(cfg.threads)))
        if cfg.slots:
            overrides.append(("n_parallel", str(cfg.slots)))
        process = TritonProcessConfig(
            work_dir=work_dir,
            model_repository=Path(cfg.model_repository) if cfg.model_repository else DEFAULT_MODEL_REPOSITORY,
            model_parameters=tuple(overrides),
            cuda_visible_devices=cfg.devices or None,
            nice=cfg.triton_nice,
            extra_args=triton_trace_args(cfg.triton_trace_url),
        )
        return TritonBackend(TritonBackendConfig(process=process))

    async def start(self) -> None:
        """Pin CPUs, listen (NOT_SERVING), start the backend, warm up, then SERVING."""
        if self.config.cpus:
            # Before the server starts its threads and Triton starts: they inherit the CPU set.
            os.sched_setaffinity(0, parse_cpus(self.config.cpus))
            self.servicer.cpus = tuple(sorted(os.sched_getaffinity(0)))
            log.info("worker pinned to CPUs %s", format_cpus(self.servicer.cpus))
        await super().start()

    async def _start(self) -> None:
        log.info("worker listening on %s; starting backend", self.host.address)
        if self.config.metrics_port:  # from the start: a model load that hangs shows there too
            self.metrics_endpoint = MetricsEndpoint(
                self.servicer.metrics.registry, self.config.host, self.config.metrics_port, "worker"
            )
        await self.backend.start()
        await self._warm_up()
        self.servicer.serving = True
        self.servicer.state_reason = "serving"
        await self.host.set_ready(True)
        self.spawn(self._supervise_backend(), "backend supervisor")
        self.spawn(self.servicer.telemetry.poll_engine(self.servicer.engine_polled), "engine statistics")
        log.info("worker SERVING on %s (Triton %s)", self.host.address, self.backend.endpoint)
        write_ready_file(
            self.config.ready_file,
            address=self.host.address,
            triton_url=self.backend.endpoint,
            pid=os.getpid(),
            triton_pid=self.backend.pid,
            cpus=format_cpus(self.servicer.cpus),
        )

    async def _warm_up(self) -> None:
        spec = self.backend.models()[0]
        async for _ in self.backend.generate(GenerationParams(model=spec.name, prompt="Hello", max_tokens=2)):
            pass
        # Before SERVING: the Describe a router reads then says which LoRA adapters are loaded, not all declared.
        await self.servicer.telemetry.read_adapters()

    async def _restart_backend(self) -> None:
        """One restart attempt: the engine back and answering a probe generation."""
        try:
            await self.backend.restart()
            await self._warm_up()
        except Exception as exc:
            self.servicer.state_reason = f"backend restart failed: {str(exc).splitlines()[0]}"
            raise

    async def _supervise_backend(self) -> None:
        """Restart the backend when it dies or loses its device; SERVING only once it answers again.

        Restarts follow the retry policy (full jitter, capped at 30 s); one that
        does not succeed within backend_restart_timeout_s raises, which stops the
        worker with a non-zero exit.
        """
        servicer = self.servicer
        backoff = Backoff(initial_s=1.0, max_s=30.0, deadline_s=self.config.backend_restart_timeout_s, warn_after=1)
        while True:
            died = asyncio.create_task(self.backend.failed())
            lost = asyncio.create_task(servicer.device_lost.wait())
            try:
                done, _ = await asyncio.wait({died, lost}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                died.cancel()
                lost.cancel()
            reason = died.result() if died in done else "the device context was lost"
            servicer.device_lost.clear()
            log.error("backend failed (%s); NOT_SERVING while it restarts", reason.splitlines()[0])
            servicer.serving = False
            servicer.state_reason = f"restarting backend: {reason.splitlines()[0]}"
            await self.host.set_ready(False)
            restart = Reconnect("backend restart", self.backend.endpoint or "the engine", backoff, log)
            await restart.run(self._restart_backend, retry_on=lambda exc: isinstance(exc, Exception))
            servicer.backend_restarts += 1
            servicer.serving = True
            servicer.state_reason = "serving"
            await self.host.set_ready(True)
            log.info(
                "backend restarted (%d so far); SERVING again on Triton %s",
                servicer.backend_restarts,
                self.backend.endpoint,
            )

    async def _drain(self) -> None:
        """NOT_SERVING to routers; in-flight generations finish within the grace period."""
        self.servicer.serving = False
        self.servicer.state_reason = "draining"
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.servicer.idle.wait(), self.drain_grace_s)

    async def _close(self) -> None:
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.close()
        await asyncio.to_thread(self.tracing.shutdown)  # exports what is pending (blocking I/O)
        await self.servicer.registry.close()
        await self.backend.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
