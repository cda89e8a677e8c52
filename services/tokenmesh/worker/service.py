"""The worker: serves ``tokenmesh.v1.Worker`` over one backend (Triton)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from tokenmesh.config import check, setting
from tokenmesh.errors import InvalidArgument, NotFound, ResourceExhausted, Unavailable
from tokenmesh.lifecycle import Service
from tokenmesh.retry import Backoff, Reconnect
from tokenmesh.server import ServiceHost, write_ready_file
from tokenmesh.v1 import inference_pb2, worker_pb2, worker_pb2_grpc
from tokenmesh.worker.backend import Backend, BackendError, EngineStats, GenerationParams, ModelSpec
from tokenmesh.worker.concurrency import AdaptiveLimit
from tokenmesh.worker.devices import DeviceReader, DeviceReading, nvml_reader
from tokenmesh.worker.registry import Record, Registry

log = logging.getLogger(__name__)

QUEUE_FACTOR = 4
"""Generations admitted per model slot (the rest wait in the engine's queue)."""
ENGINE_POLL_S = 1.0
"""Seconds between reads of the engine's queue figures (each is a statistics call and a metrics scrape)."""
OOM_RECOVERY_S = 10.0
"""After a device OOM the admission limit grows back by one per this many seconds."""


def _ewma(previous: float | None, value: float, alpha: float = 0.2) -> float:
    return value if previous is None else previous + alpha * (value - previous)

@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """Settings of one worker (flags ``--name``, env ``TOKENMESH_WORKER_NAME``)."""

    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(50061, "gRPC port; 0 picks a free one")
    triton_url: str = setting("", "use this running Triton (host:port, e.g. a sidecar) instead of starting one")
    triton_metrics_url: str = setting("", "that Triton's metrics endpoint (http://host:8002/metrics), for its "
                                          "pending count; ours is known")
    model_repository: str = setting("", "model repository for the Triton we start; empty = the shipped SmolLM2 model")
    devices: str = setting("", "CUDA_VISIBLE_DEVICES for our Triton; empty inherits the environment")
    cpus: str = setting("", "CPUs to pin the worker and its Triton to, e.g. '0-3' or '0,2'; empty = no pinning")
    threads: int = setting(0, "llama.cpp threads per model (config.pbtxt n_threads); 0 keeps the model's value")
    slots: int = setting(0, "concurrent generations per model (config.pbtxt n_parallel); 0 keeps the model's value")
    triton_nice: int = setting(0, "niceness (0-19) of the Triton we start and its models; where the engine shares "
                                  "CPUs with the mesh, a high value lets every relayed token preempt it at once")
    work_dir: str = setting("", "folder for Triton's files and log; empty = a new temporary folder")
    resume_grace_s: float = setting(30.0, "how long a generation whose stream dropped is kept (running) for Resume")
    replay_buffer_bytes: int = setting(1024 * 1024, "per-generation replay buffer; a reader further behind fails")
    memory_threshold: float = setting(0.92, "device memory fraction above which no generation is added")
    drain_grace_s: float = setting(30.0, "on SIGTERM, how long in-flight generations may take to finish")
    stop_grace_s: float = setting(1.0, "after the drain, how long calls still open (stats streams, health "
                                       "watches, resumes) may take before they are ended")
    backend_restart_timeout_s: float = setting(600.0, "a Triton that cannot be restarted within this stops the "
                                                      "worker with a non-zero exit (its supervisor restarts it)")
    ready_file: str = setting("", "write {address, triton_url, pid, triton_pid} as JSON here once SERVING")

    def __post_init__(self) -> None:
        """Validate ranges."""
        check(0 <= self.port <= 65535, f"port must be 0..65535, got {self.port}")
        check(self.threads >= 0, f"threads must be >= 0, got {self.threads}")
        check(self.slots >= 0, f"slots must be >= 0, got {self.slots}")
        check(0 <= self.triton_nice <= 19, f"triton_nice must be 0..19, got {self.triton_nice}")
        check(0 < self.memory_threshold <= 1, f"memory_threshold must be in (0, 1], got {self.memory_threshold}")
        check(self.drain_grace_s >= 0, f"drain_grace_s must be >= 0, got {self.drain_grace_s}")
        check(self.stop_grace_s >= 0, f"stop_grace_s must be >= 0, got {self.stop_grace_s}")
        check(self.backend_restart_timeout_s > 0,
              f"backend_restart_timeout_s must be > 0, got {self.backend_restart_timeout_s}")
        check(self.resume_grace_s > 0, f"resume_grace_s must be > 0, got {self.resume_grace_s}")
        check(self.replay_buffer_bytes >= 4096, f"replay_buffer_bytes must be >= 4096, got {self.replay_buffer_bytes}")
        if self.model_repository:
            check(Path(self.model_repository).is_dir(), f"model_repository {self.model_repository!r} is not a folder")
        if self.cpus:
            available = os.sched_getaffinity(0)
            wanted = parse_cpus(self.cpus)
            check(wanted <= available, f"cpus {self.cpus!r} names CPUs this process cannot use "
                                       f"(available: {format_cpus(available)})")


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


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Generate/Attach/Cancel/Stats/Describe over a :class:`Backend`."""

    def __init__(
        self,
        backend: Backend,
        devices: DeviceReader | None,
        cuda_visible_devices: str = "",
        *,
        resume_grace_s: float = 30.0,
        replay_buffer_bytes: int = 1024 * 1024,
        memory_threshold: float = 0.92,
    ) -> None:
        self._backend = backend
        self._devices = devices
        self._cuda_visible_devices = cuda_visible_devices
        self.registry = Registry(resume_grace_s, replay_buffer_bytes, self._settled, self._failed, self._timing)
        self.ttft_ms: float | None = None
        self.itl_ms: float | None = None
        self.cpus: tuple[int, ...] = ()
        self.serving = False
        self.state_reason = "starting"
        self.in_flight = 0
        self.served_total = 0
        self.tokens_total = 0
        self.oom_total = 0
        self.backend_restarts = 0
        self.limit: int | None = None
        """Admission limit while lowered after a device OOM; None = QUEUE_FACTOR x slots."""
        self.last_oom = 0.0
        self._memory_threshold = memory_threshold
        self._adaptive: AdaptiveLimit | None = None
        self.device_readings: list[DeviceReading] = []
        """The latest NVML readings (taken on each stats ping)."""
        self.engine_poll_s = ENGINE_POLL_S
        self.engine_pending: int | None = None
        self.engine_queue_ms: float | None = None
        self.device_lost = asyncio.Event()
        self.idle = asyncio.Event()
        self.idle.set()

    def admission_limit(self) -> int:
        """Most generations accepted at once: the slots plus a queue as deep, or less after an OOM."""
        full = QUEUE_FACTOR * self.slots()
        if self.limit is None:
            return full
        # Additive increase: one more every OOM_RECOVERY_S without another OOM.
        grown = self.limit + int((time.monotonic() - self.last_oom) / OOM_RECOVERY_S)
        if grown >= full:
            self.limit = None
            return full
        return grown

    def _failed(self, record: Record, error: BackendError) -> None:
        if error.error_class == worker_pb2.ERROR_CLASS_OUT_OF_MEMORY:
            self.oom_total += 1
            self.last_oom = time.monotonic()
            # Multiplicative decrease from what was running when memory ran out.
            self.limit = max(1, min(self.admission_limit(), self.in_flight) // 2)
            waiting = [r for r in self.registry.records.values() if r.total == 0 and not r.done]
            for victim in waiting[max(0, self.limit - (self.in_flight - len(waiting))):]:
                self.registry.shed(victim, "shed: the worker ran out of device memory; run it elsewhere")
            log.warning("device out of memory: admission limit now %d (%d OOMs)", self.limit, self.oom_total)
        elif error.error_class == worker_pb2.ERROR_CLASS_DEVICE_LOST:
            self.device_lost.set()

    def _timing(self, record: Record, ttft_s: float | None, gap_s: float | None) -> None:
        if ttft_s is not None:
            self.ttft_ms = _ewma(self.ttft_ms, ttft_s * 1000)
            self.adaptive().sample(ttft_s * 1000, queued=record.queued)
        if gap_s is not None:
            self.itl_ms = _ewma(self.itl_ms, gap_s * 1000)

    def _settled(self, record: Record) -> None:
        self.in_flight -= 1
        self.tokens_total += record.tokens
        if record.events and record.events[-1].WhichOneof("event") == "end":
            self.served_total += 1
        if self.in_flight == 0:
            self.idle.set()

    def _model(self, name: str) -> ModelSpec:
        models = self._backend.models()
        if not models:
            raise Unavailable("worker has no model loaded yet")
        if not name:
            return models[0]
        for spec in models:
            if spec.name == name:
                return spec
        raise NotFound(f"model {name!r} is not served here; served: {', '.join(m.name for m in models)}")

    def _tokens_now(self) -> int:
        """Tokens generated so far, running generations included."""
        return self.tokens_total + sum(r.tokens for r in self.registry.records.values() if not r.done)

    def slots(self) -> int:
        """Generations the models run at once (sum of their slots)."""
        return sum(spec.slots for spec in self._backend.models()) or 1

    def adaptive(self) -> AdaptiveLimit:
        """The latency- and memory-driven limit (made once the models, hence the slots, are known)."""
        if self._adaptive is None:
            slots = self.slots()
            self._adaptive = AdaptiveLimit(initial=slots, maximum=slots, memory_threshold=self._memory_threshold)
        return self._adaptive

    def concurrency_limit(self) -> int:
        """Generations the worker should run at once: adaptive, never above the admission limit."""
        return min(self.adaptive().limit(self.in_flight, self.device_readings), self.admission_limit())

    async def poll_engine(self) -> None:
        """Follow the engine's own queue figures (Triton's pending count and queue time)."""
        previous: EngineStats | None = None
        while True:
            try:
                stats = await self._backend.engine_stats()
            except Exception as exc:  # noqa: BLE001 - a restarting engine; the figures go unset
                log.debug("engine stats unavailable: %s", exc)
                stats = None
            if stats is None:
                self.engine_pending = None
            else:
                self.engine_pending = stats.pending
                if previous is not None and stats.queued_total > previous.queued_total:
                    mean_ns = (stats.queue_ns_total - previous.queue_ns_total) / (
                        stats.queued_total - previous.queued_total)
                    self.engine_queue_ms = _ewma(self.engine_queue_ms, mean_ns / 1e6)
            previous = stats
            await asyncio.sleep(self.engine_poll_s)

    async def Generate(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[worker_pb2.WorkerCommand], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[worker_pb2.WorkerEvent]:
        """Start a generation and stream it; a cancel command stops it.

        If this stream goes away without a cancel, the generation goes on
        (detached) for the resume grace period; ``Attach`` picks it up.
        """
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("command") != "start":
            raise InvalidArgument("the first WorkerCommand must be `start` with the GenerateRequest")
        if not self.serving:
            raise Unavailable("worker is not serving (starting, draining, or its Triton is down)")
        req = first.start
        if not req.request_id:
            raise InvalidArgument("start.request_id is required (the router assigns one)")
        if self.in_flight >= self.admission_limit():
            lowered = " (lowered after a device out-of-memory)" if self.limit is not None else ""
            raise ResourceExhausted(f"worker is at its limit of {self.admission_limit()} generations{lowered}")
        spec = self._model(req.model)
        params = GenerationParams(
            model=spec.name,
            prompt=req.prompt,
            messages=tuple((m.role, m.content) for m in req.messages),
            max_tokens=req.max_tokens,
            temperature=req.temperature if req.HasField("temperature") else None,
            top_p=req.top_p if req.HasField("top_p") else None,
            stop=tuple(req.stop),
            seed=req.seed if req.HasField("seed") else None,
            ignore_eos=req.ignore_eos,
            request_id=req.request_id,
            timeout_s=first.timeout_s if first.HasField("timeout_s") else context.time_remaining(),
            labels=dict(req.labels),
        )
        queued = self.in_flight >= self.slots()
        self.in_flight += 1
        self.idle.clear()
        record = self.registry.start(req.request_id, first.first_seq or 1, first.tokens_before,
                                     self._backend.generate(params))
        record.queued = queued

        async def watch_commands() -> None:
            async for command in request_iterator:
                if command.WhichOneof("command") == "cancel" and self.registry.records.get(req.request_id) is record:
                    self.registry.cancel(req.request_id)
                    return

        watcher = asyncio.create_task(watch_commands())
        try:
            async for event in record.stream(record.first_seq - 1):
                yield event
        finally:
            watcher.cancel()
            if not first.resumable and self.registry.records.get(req.request_id) is record:
                if record.done:
                    self.registry.forget(record)  # delivered; nobody will resume it
                else:
                    self.registry.cancel(req.request_id)  # its caller is gone

    async def Attach(  # noqa: N802 - gRPC method name
        self, request: worker_pb2.AttachRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[worker_pb2.WorkerEvent]:
        """Replay a held generation after after_seq, then follow it live."""
        record = self.registry.get(request.request_id)
        async for event in record.stream(request.after_seq):
            yield event

    async def Cancel(  # noqa: N802 - gRPC method name
        self, request: inference_pb2.CancelRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> inference_pb2.CancelResponse:
        """Stop and forget a held generation."""
        if not self.registry.cancel(request.request_id):
            raise NotFound(f"no generation {request.request_id!r} on this worker")
        return inference_pb2.CancelResponse(cancelled=True)

    async def Stats(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[worker_pb2.StatsPing], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[worker_pb2.WorkerStats]:
        """Answer each ping with the worker's stats right now."""
        last_time, last_tokens = time.monotonic(), self._tokens_now()
        async for ping in request_iterator:
            now, tokens = time.monotonic(), self._tokens_now()
            rate = max(0.0, (tokens - last_tokens) / (now - last_time)) if now > last_time else 0.0
            last_time, last_tokens = now, tokens
            if self._devices is not None:  # NVML calls block: off the event loop
                self.device_readings = await asyncio.to_thread(self._devices)
            devices = [
                worker_pb2.DeviceStats(
                    index=d.index,
                    name=d.name,
                    memory_used_bytes=d.memory_used_bytes,
                    memory_total_bytes=d.memory_total_bytes,
                    utilization_percent=d.utilization_percent,
                )
                for d in self.device_readings
            ]
            yield worker_pb2.WorkerStats(
                ping_id=ping.ping_id,
                in_flight=self.in_flight,
                concurrency_limit=self.concurrency_limit(),
                serving=self.serving,
                oom_total=self.oom_total,
                backend_restarts=self.backend_restarts,
                state_reason=self.state_reason,
                ttft_ms=self.ttft_ms,
                itl_ms=self.itl_ms,
                tokens_per_s=rate,
                cpus=self.cpus,
                served_total=self.served_total,
                tokens_total=self.tokens_total,
                devices=devices,
                triton_url=self._backend.endpoint,
                triton_pending=self.engine_pending,
                triton_queue_ms=self.engine_queue_ms,
                ttft_baseline_ms=self.adaptive().baseline_ms if self._backend.models() else None,
            )

    async def Describe(  # noqa: N802 - gRPC method name
        self, request: worker_pb2.DescribeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> worker_pb2.DescribeResponse:
        """Models served, Triton endpoint and devices."""
        models = self._backend.models()
        return worker_pb2.DescribeResponse(
            models=[
                inference_pb2.ModelInfo(name=m.name, max_context=m.max_context, is_default=(i == 0), workers=1)
                for i, m in enumerate(models)
            ],
            triton_url=self._backend.endpoint,
            cuda_visible_devices=self._cuda_visible_devices,
            triton_pid=self._backend.pid or 0,
            concurrency_limit=self.concurrency_limit() if models else 0,
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
    _tmp: tempfile.TemporaryDirectory[str] | None

    def __init__(self, config: WorkerConfig, backend: Backend | None = None) -> None:
        service_name = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
        host = ServiceHost(config.host, config.port, [service_name])
        super().__init__(host, drain_grace_s=config.drain_grace_s, stop_grace_s=config.stop_grace_s)
        self.config = config
        self._tmp = None
        self.backend = backend or self._triton_backend()
        self.servicer = WorkerServicer(
            self.backend,
            nvml_reader(config.devices or None),
            config.devices,
            resume_grace_s=config.resume_grace_s,
            replay_buffer_bytes=config.replay_buffer_bytes,
            memory_threshold=config.memory_threshold,
        )
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
            return TritonBackend(TritonBackendConfig(url=cfg.triton_url, metrics_url=cfg.triton_metrics_url or None))
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
        await self.backend.start()
        await self._warm_up()
        self.servicer.serving = True
        self.servicer.state_reason = "serving"
        await self.host.set_ready(True)
        self.spawn(self._supervise_backend(), "backend supervisor")
        self.spawn(self.servicer.poll_engine(), "engine statistics")
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
            log.info("backend restarted (%d so far); SERVING again on Triton %s",
                     servicer.backend_restarts, self.backend.endpoint)

    async def _drain(self) -> None:
        """NOT_SERVING to routers; in-flight generations finish within the grace period."""
        self.servicer.serving = False
        self.servicer.state_reason = "draining"
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.servicer.idle.wait(), self.drain_grace_s)

    async def _close(self) -> None:
        await self.servicer.registry.close()
        await self.backend.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
