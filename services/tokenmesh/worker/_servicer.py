"""``tokenmesh.v1.Worker``: the RPC handlers over a :class:`~tokenmesh.worker.Backend`."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc
from opentelemetry import trace

from tokenmesh import logs
from tokenmesh.errors import InvalidArgument, NotFound, ResourceExhausted, Unavailable
from tokenmesh.tracing import from_mapping, inject, parent
from tokenmesh.v1 import inference_pb2, worker_pb2, worker_pb2_grpc
from tokenmesh.validation import check_max_tokens, check_request, require_request_id
from tokenmesh.worker._backend import AdapterKey, AdapterState, Backend, BackendError, GenerationParams, ModelSpec
from tokenmesh.worker._devices import DeviceReader
from tokenmesh.worker._limits import Limits
from tokenmesh.worker._link import WorkerLink, trace_event
from tokenmesh.worker._metrics import WorkerMetrics, WorkerState
from tokenmesh.worker._registry import Record, Registry
from tokenmesh.worker._telemetry import Telemetry

Target = tuple[ModelSpec, str]
"""What a request's model names: the engine's model, and one of its LoRA adapters ('' = none)."""


def model_infos(models: list[ModelSpec], adapters: AdapterState | None = None) -> list[inference_pb2.ModelInfo]:
    """What Describe lists: each model (the first is the default), then each of its adapters as a model.

    An adapter the engine reports not loaded is marked ``not_loaded``; those of a model that does not report (or
    with no report at all: None) count as loaded.
    """
    infos = []
    for i, m in enumerate(models):
        infos.append(inference_pb2.ModelInfo(name=m.name, max_context=m.max_context, is_default=(i == 0), workers=1))
        infos += [
            inference_pb2.ModelInfo(
                name=m.adapter_model(a),
                max_context=m.max_context,
                workers=1,
                base=m.name,
                not_loaded=adapters is not None and not adapters.has_loaded(m.name, a),
            )
            for a in m.adapters
        ]
    return infos


def loaded_adapters(models: list[ModelSpec], adapters: AdapterState | None) -> list[AdapterKey]:
    """(model, adapter) of each declared adapter the engine has loaded (all of them while it has not said)."""
    return [(m.name, a) for m in models for a in m.adapters if adapters is None or adapters.has_loaded(m.name, a)]


def _start_command(first: worker_pb2.WorkerCommand | None) -> worker_pb2.WorkerCommand:
    """The stream's first command, which must start the generation."""
    if first is None or first.WhichOneof("command") != "start":
        raise InvalidArgument("the first WorkerCommand must be `start` with the GenerateRequest")
    return first


def structured(output: inference_pb2.StructuredOutput) -> dict[str, Any]:
    """A request's format as vLLM's structured-output parameters (the tensor contract's ``guided_decoding``)."""
    kind = output.WhichOneof("format")
    if kind == "json_schema":
        return {"json": json.loads(output.json_schema)}  # checked at the router (validation.json_schema)
    if kind == "json_object":
        return {"json_object": True}
    if kind == "choice":
        return {"choice": list(output.choice.options)}
    return {"grammar": output.grammar}


def generation_params(
    first: worker_pb2.WorkerCommand,
    target: Target,
    time_remaining: float | None,
    trace_context: tuple[tuple[str, str], ...],
) -> GenerationParams:
    """The backend's parameters for a start command on target's model (and adapter).

    Args:
        first: the start command (the router's request, its deadline).
        target: the model it runs on, and the adapter applied ('' for none).
        time_remaining: the call's own deadline, used when the start names none.
        trace_context: the W3C headers that make the backend's spans children of ours.

    """
    req = first.start
    spec, adapter = target
    return GenerationParams(
        model=spec.name,
        adapter=adapter,
        prompt=req.prompt,
        messages=tuple((m.role, m.content) for m in req.messages),
        max_tokens=req.max_tokens,
        temperature=req.temperature if req.HasField("temperature") else None,
        top_p=req.top_p if req.HasField("top_p") else None,
        stop=tuple(req.stop),
        seed=req.seed if req.HasField("seed") else None,
        ignore_eos=req.ignore_eos,
        top_k=req.top_k if req.HasField("top_k") else None,
        min_p=req.min_p if req.HasField("min_p") else None,
        presence_penalty=req.presence_penalty if req.HasField("presence_penalty") else None,
        frequency_penalty=req.frequency_penalty if req.HasField("frequency_penalty") else None,
        repetition_penalty=req.repetition_penalty if req.HasField("repetition_penalty") else None,
        logit_bias=tuple(sorted(req.logit_bias.items())),
        logprobs=req.top_logprobs if req.logprobs else None,
        structured=structured(req.structured_output) if req.HasField("structured_output") else None,
        flags=spec.flags,
        request_id=req.request_id,
        timeout_s=first.timeout_s if first.HasField("timeout_s") else time_remaining,
        labels=dict(req.labels),
        trace_context=trace_context,
    )


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Generate/Attach/Cancel/Stats/Describe over a :class:`Backend`.

    Args:
        backend: the engine generations go to.
        devices: reads the worker's GPUs (None: no NVML, e.g. on CPU).
        cuda_visible_devices: the devices the worker owns, as reported by Describe.
        resume_grace_s: how long a generation whose stream dropped is kept for Attach.
        replay_buffer_bytes: per-generation replay buffer.
        memory_threshold: device memory fraction above which no generation is added.
        link_linger_s: how long a Link's send may wait for more of its streams to have a chunk (``--link-linger-us``).

    """

    registry: Registry
    limits: Limits
    telemetry: Telemetry
    serving: bool
    """Generate accepts new generations (False while starting, draining or restarting the engine)."""
    state_reason: str
    """Why the worker is (not) serving, for operators."""
    in_flight: int
    """Generations started and not settled."""
    backend_restarts: int
    cpus: tuple[int, ...]
    """The CPUs the worker is pinned to (empty: not pinned)."""
    device_lost: asyncio.Event
    """Set when a generation failed in a way that says the device context is gone (the engine must restart)."""
    idle: asyncio.Event
    """Set while no generation is in flight (the drain waits for it)."""
    tracer: trace.Tracer
    """Spans per generation (OpenTelemetry's no-op tracer while tracing is off)."""
    link_linger_s: float
    """How long a Link's send may wait for more of its streams to have a chunk (0: never; see WorkerLink)."""
    _backend: Backend
    _devices: DeviceReader | None
    _cuda_visible_devices: str

    def __init__(  # wide: keyword-only settings, each with a default
        self,
        backend: Backend,
        devices: DeviceReader | None,
        cuda_visible_devices: str = "",
        *,
        resume_grace_s: float = 30.0,
        replay_buffer_bytes: int = 1024 * 1024,
        memory_threshold: float = 0.92,
        link_linger_s: float = 0.0,
    ) -> None:
        self._backend = backend
        self.link_linger_s = link_linger_s
        self._devices = devices
        self._cuda_visible_devices = cuda_visible_devices
        self.tracer = trace.NoOpTracer()
        self.metrics = WorkerMetrics()
        self.registry = Registry(resume_grace_s, replay_buffer_bytes, self._settled, self._failed, self._timing)
        self.limits = Limits(backend, memory_threshold)
        self.telemetry = Telemetry(backend)
        self.serving = False
        self.state_reason = "starting"
        self.in_flight = 0
        self.backend_restarts = 0
        self.cpus = ()
        self.device_lost = asyncio.Event()
        self.idle = asyncio.Event()
        self.idle.set()
        self.metrics.watch(
            WorkerState(
                limits=self.limits,
                telemetry=self.telemetry,
                in_flight=lambda: self.in_flight,
                serving=lambda: self.serving,
                has_model=self.backend_models,
                adapters=lambda: loaded_adapters(self._backend.models(), self.telemetry.adapters),
                held=lambda: len(self.registry.records),
                restarts=lambda: self.backend_restarts,
            )
        )

    def _failed(self, record: Record, error: BackendError) -> None:
        if error.error_class == worker_pb2.ERROR_CLASS_OUT_OF_MEMORY:
            self.limits.out_of_memory(self.in_flight, self._shed_waiting)
        elif error.error_class == worker_pb2.ERROR_CLASS_DEVICE_LOST:
            self.device_lost.set()

    def _shed_waiting(self, limit: int) -> None:
        """Shed generations still waiting for their first token beyond limit (they run elsewhere)."""
        waiting = [r for r in self.registry.records.values() if r.total == 0 and not r.done]
        for victim in waiting[max(0, limit - (self.in_flight - len(waiting))) :]:
            self.registry.shed(victim, "shed: the worker ran out of device memory; run it elsewhere")

    def _timing(self, record: Record, ttft_s: float | None, gap_s: float | None) -> None:
        self.telemetry.timing(ttft_s, gap_s)
        if ttft_s is not None:
            self.limits.adaptive().sample(ttft_s * 1000, queued=record.queued)
        self.metrics.timing(ttft_s, gap_s)

    def engine_polled(self, pending: int | None) -> None:
        """The engine's queue was read: the concurrency limit follows it."""
        if self._backend.models():
            self.limits.adaptive().observe_engine(pending, self.in_flight)

    def _settled(self, record: Record) -> None:
        self.in_flight -= 1
        self.telemetry.tokens_total += record.tokens
        self.metrics.settled(record.events[-1] if record.events else None, record.tokens)
        if record.events and record.events[-1].WhichOneof("event") == "end":
            self.telemetry.served_total += 1
        if self.in_flight == 0:
            self.idle.set()

    def backend_models(self) -> bool:
        """Whether the backend has a model loaded (the limit is known then)."""
        return bool(self._backend.models())

    def _model(self, name: str) -> Target:
        models = self._backend.models()
        if not models:
            raise Unavailable("worker has no model loaded yet")
        if not name:
            return models[0], ""
        for spec in models:
            if spec.name == name:
                return spec, ""
            adapter = next((a for a in spec.adapters if spec.adapter_model(a) == name), None)
            if adapter is not None:
                return spec, adapter
        raise NotFound(
            f"model {name!r} is not served here; served: {', '.join(i.name for i in model_infos(models))}",
            reason="MODEL_NOT_SERVED",
            metadata={"model": name},
        )

    def _tokens_now(self) -> int:
        """Tokens generated so far, running generations included."""
        return self.telemetry.tokens_total + sum(r.tokens for r in self.registry.records.values() if not r.done)

    async def Generate(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[worker_pb2.WorkerCommand], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[worker_pb2.WorkerEvent]:
        """Start a generation and stream it; a cancel command stops it.

        If this stream goes away without a cancel, the generation goes on
        (detached) for the resume grace period; ``Attach`` picks it up.
        """
        first = _start_command(await anext(aiter(request_iterator), None))
        record, span = self._begin(first, context.invocation_metadata() or (), context.time_remaining())
        watcher = asyncio.create_task(self._watch_commands(request_iterator, record))
        tracing = span.is_recording()  # asked once: with tracing off, an event costs no tracing work
        try:
            async for event in record.stream(record.first_seq - 1):
                if tracing:
                    trace_event(span, event)
                yield event
        finally:
            span.end()
            watcher.cancel()
            self._release(record, resumable=first.resumable)

    def _begin(
        self,
        first: worker_pb2.WorkerCommand,
        metadata: Iterable[tuple[str, Any]] | None = None,
        time_remaining: float | None = None,
    ) -> tuple[Record, trace.Span]:
        """Admit, trace and start the generation of a start command (a Generate call's, or a Link stream's).

        Raises the MeshError that refuses it (not serving, at the limit, a bad request, a model not served here).
        """
        target = self._admit(first.start)
        span = self._span(first, target, metadata)
        # Triton, tracing, makes its spans children of ours (or of the router's: a no-op span carries its context).
        params = generation_params(first, target, time_remaining, tuple(inject(span).items()))
        logs.about(params.request_id, span)  # before the pump task starts: it copies this context
        record = self._start(first, params)
        span.set_attribute("tokenmesh.first_seq", record.first_seq)
        return record, span

    def _admit(self, req: inference_pb2.GenerateRequest) -> Target:
        """The model (and adapter) a started request runs on, or why this worker does not take it now."""
        if not self.serving:
            raise Unavailable(
                "worker is not serving (starting, draining, or its Triton is down)", reason="WORKER_NOT_SERVING"
            )
        if not req.request_id:
            raise InvalidArgument("start.request_id is required (the router assigns one)")
        # The router checked these already; a caller of this internal RPC may not have.
        check_request(req)
        if self.in_flight >= self.limits.admission_limit():
            lowered = " (lowered after a device out-of-memory)" if self.limits.lowered is not None else ""
            raise ResourceExhausted(
                f"worker is at its limit of {self.limits.admission_limit()} generations{lowered}",
                reason="WORKER_AT_LIMIT",
            )
        if not req.HasField("max_tokens"):
            raise InvalidArgument("start.max_tokens is required (the router sets the default)")
        target = spec, _ = self._model(req.model)
        check_max_tokens(req, spec.name, spec.max_context)
        if req.messages and not spec.chat:
            # Sent anyway, Triton refuses the unknown input, which reads as a backend failure and fails over.
            raise InvalidArgument(
                f"model {spec.name!r} takes a prompt only: its Triton model declares no "
                "`messages` input (as the stock vLLM backend); send `prompt` with the chat "
                "template applied"
            )
        return target

    def _span(
        self, first: worker_pb2.WorkerCommand, target: Target, metadata: Iterable[tuple[str, Any]] | None
    ) -> trace.Span:
        """The generation's span on this worker: a child of the router's context, where that came.

        A router that does not trace sends its caller's context in the start command (on a call opened ahead of
        need); otherwise the context is in the call's metadata, and while this worker traces, the call's RPC server
        span (the current span) is the parent. A Link stream (metadata None) takes only the start command's
        context: the current span there is the link call's, which lives for hours and is no generation's parent.
        """
        linked = metadata is None
        context = from_mapping(first.trace_context) if first.trace_context or linked else parent(metadata)
        spec, adapter = target
        model = spec.adapter_model(adapter) if adapter else spec.name
        return self.tracer.start_span(
            f"generate {model}",
            context=context,
            kind=trace.SpanKind.INTERNAL if context is None else trace.SpanKind.SERVER,
            attributes={
                "gen_ai.request.model": model,
                "gen_ai.response.id": first.start.request_id,
                "tokenmesh.tokens_before": first.tokens_before,
                "tokenmesh.triton_url": self._backend.endpoint,
            },
        )

    def _start(self, first: worker_pb2.WorkerCommand, params: GenerationParams) -> Record:
        """Count the generation in flight and start it on the backend (queued when every slot is taken)."""
        queued = self.in_flight >= self.limits.slots()
        generation = self._backend.generate(params)  # may raise (Triton gone): nothing is counted yet
        self.in_flight += 1
        self.idle.clear()
        if params.adapter:
            self.metrics.adapter_generation(params.model, params.adapter)
        record = self.registry.start(
            params.request_id,
            first.first_seq or 1,
            first.tokens_before,
            generation,
            interval_s=first.stream_interval_ms / 1000,  # paces every reader of it, on any call (Record)
        )
        record.queued = queued
        return record

    async def _watch_commands(self, commands: AsyncIterator[worker_pb2.WorkerCommand], record: Record) -> None:
        """Stop the generation when its stream sends a cancel (while the record is still this stream's)."""
        async for command in commands:
            if command.WhichOneof("command") == "cancel":
                self._stop(record)
                return

    def _stop(self, record: Record) -> None:
        """A cancel command: stop and forget the generation (if the record is still the one held by its id)."""
        if self.registry.records.get(record.request_id) is record:
            self.registry.cancel(record.request_id)

    def _release(self, record: Record, *, resumable: bool) -> None:
        """The stream is over: a generation no one will resume is forgotten (delivered) or cancelled (caller gone)."""
        if resumable or self.registry.records.get(record.request_id) is not record:
            return
        if record.done:
            self.registry.forget(record)  # delivered; nobody will resume it
        else:
            self.registry.cancel(record.request_id)  # its caller is gone

    async def Attach(  # noqa: N802 - gRPC method name
        self, request: worker_pb2.AttachRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[worker_pb2.WorkerEvent]:
        """Replay a held generation after after_seq, then follow it live."""
        require_request_id(request.request_id)
        record = self.registry.get(request.request_id)
        async for event in record.stream(request.after_seq):
            yield event

    async def Cancel(  # noqa: N802 - gRPC method name
        self, request: inference_pb2.CancelRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> inference_pb2.CancelResponse:
        """Stop and forget a held generation."""
        require_request_id(request.request_id)
        if not self.registry.cancel(request.request_id):
            raise NotFound(f"no generation {request.request_id!r} on this worker")
        return inference_pb2.CancelResponse(cancelled=True)

    async def Link(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[worker_pb2.LinkCommands], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[worker_pb2.LinkEvents]:
        """Every generation of one router on one call: starts, cancels and credit in; batched chunks and ends out."""
        link = WorkerLink(
            self._begin,
            self._stop,
            lambda record, resumable: self._release(record, resumable=resumable),
            linger_s=self.link_linger_s,
        )
        async for events in link.run(request_iterator):
            yield events

    async def Stats(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[worker_pb2.StatsPing], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[worker_pb2.WorkerStats]:
        """Answer each ping with the worker's stats right now."""
        t = self.telemetry
        last_time, last_tokens = time.monotonic(), self._tokens_now()
        async for ping in request_iterator:
            now, tokens = time.monotonic(), self._tokens_now()
            rate = max(0.0, (tokens - last_tokens) / (now - last_time)) if now > last_time else 0.0
            last_time, last_tokens = now, tokens
            if self._devices is not None:  # NVML calls block: off the event loop
                self.limits.device_readings = await asyncio.to_thread(self._devices)
            devices = [
                worker_pb2.DeviceStats(
                    index=d.index,
                    name=d.name,
                    memory_used_bytes=d.memory_used_bytes,
                    memory_total_bytes=d.memory_total_bytes,
                    utilization_percent=d.utilization_percent,
                )
                for d in self.limits.device_readings
            ]
            yield worker_pb2.WorkerStats(
                ping_id=ping.ping_id,
                in_flight=self.in_flight,
                concurrency_limit=self.limits.concurrency_limit(self.in_flight),
                serving=self.serving,
                oom_total=self.limits.oom_total,
                backend_restarts=self.backend_restarts,
                state_reason=self.state_reason,
                ttft_ms=t.ttft_ms,
                itl_ms=t.itl_ms,
                tokens_per_s=rate,
                cpus=self.cpus,
                served_total=t.served_total,
                tokens_total=t.tokens_total,
                devices=devices,
                triton_url=self._backend.endpoint,
                triton_pending=t.engine_pending,
                triton_queue_ms=t.engine_queue_ms,
                ttft_baseline_ms=self.limits.adaptive().baseline_ms if self._backend.models() else None,
            )

    async def Describe(  # noqa: N802 - gRPC method name
        self, request: worker_pb2.DescribeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> worker_pb2.DescribeResponse:
        """Models served, Triton endpoint and devices."""
        models = self._backend.models()
        return worker_pb2.DescribeResponse(
            models=model_infos(models, self.telemetry.adapters),
            triton_url=self._backend.endpoint,
            cuda_visible_devices=self._cuda_visible_devices,
            triton_pid=self._backend.pid or 0,
            concurrency_limit=self.limits.concurrency_limit(self.in_flight) if models else 0,
        )
