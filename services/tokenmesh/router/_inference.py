"""``tokenmesh.v1.Inference`` on the router: Generate with failover, Resume, Cancel, ListModels.

One attempt on one worker is :class:`~tokenmesh.router._relay.Relay`'s; this
module decides what happens around it: admission, which failures move the
stream to another worker, and the streams this router holds by request_id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.trace import StatusCode

from tokenmesh import logs
from tokenmesh.errors import (
    CALLER_ERROR_CLASSES,
    AlreadyExists,
    Cancelled,
    MeshError,
    NotFound,
    ResourceExhausted,
    Unavailable,
    from_generation_error,
    from_rpc_error,
    label,
)
from tokenmesh.links import Links
from tokenmesh.redaction import StreamRedactor, capture_enabled, redact
from tokenmesh.retry import write
from tokenmesh.router._admission import FAILOVER, Admission, level
from tokenmesh.router._cancels import WorkerCancels
from tokenmesh.router._config import RouterConfig
from tokenmesh.router._metrics import RouterMetrics
from tokenmesh.router._pool import WorkerEntry, WorkerPool, prefix_key
from tokenmesh.router._relay import CALLER_CODES, Live, Progress, Relay, WorkerFailed, chunk, continuation
from tokenmesh.router._spares import Spares
from tokenmesh.router._validation import validate
from tokenmesh.tracing import from_metadata, inject, operation
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, worker_pb2, worker_pb2_grpc
from tokenmesh.validation import require_request_id

log = logging.getLogger(__name__)

CANCEL_TIMEOUT_S = 5.0
"""Longest a Cancel that goes to the workers waits for their answers (less when the caller's deadline is nearer)."""
TEARDOWN_WAIT_S = 2.0
"""How long Resume waits for this router's old stream of the same request_id to be torn down."""


def _trace_chunk(span: trace.Span, piece: inference_pb2.GenerateChunk, output: list[str] | None,
                 redactor: StreamRedactor | None) -> None:
    """Record a chunk on the generation's span.

    The first chunk as an event, the end's usage and finish reason as
    attributes; with content capture, the output (redacted as it streams) as
    an event at the end.
    """
    if piece.seq == 1:
        span.add_event("gen_ai.first_token")
    if redactor is not None and output is not None:
        output.append(redactor.feed(piece.text))
        if piece.finish_reason:
            span.add_event("gen_ai.choice", {"gen_ai.completion": "".join(output) + redactor.flush()})
    if piece.finish_reason:
        reason = label(piece.finish_reason, inference_pb2.FinishReason)
        span.set_attribute("gen_ai.response.finish_reasons", [reason])
        span.set_attribute("gen_ai.usage.input_tokens", piece.usage.prompt_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", piece.usage.completion_tokens)


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """Generate, Resume, Cancel, ListModels.

    Args:
        config: the router's settings.
        pool: the workers and the weight table in force.
        links: the router's links to its workers (the router opens one per worker it learns of).
        admission: grants worker slots, queueing by priority.

    """

    live: dict[str, Live]
    """Generations and resumes this router streams now, by request_id."""
    idle: asyncio.Event
    """Set while no generation or resume is being streamed by this router (the drain waits for it)."""
    draining: bool
    """Set when the router drains: new generations and resumes get UNAVAILABLE."""
    spares: Spares
    cancels: WorkerCancels
    _config: RouterConfig
    _pool: WorkerPool
    _admission: Admission
    _links: Links
    _relay: Relay
    metrics: RouterMetrics
    tracer: trace.Tracer | None
    """Spans per generation (None: tracing off)."""
    capture_content: bool
    """Prompts and outputs go into spans, redacted (OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT)."""

    def __init__(
        self,
        config: RouterConfig,
        pool: WorkerPool,
        links: Links,
        admission: Admission,
        metrics: RouterMetrics,
    ) -> None:
        self.metrics = metrics
        self.tracer = None
        self.capture_content = capture_enabled()
        self._config = config
        self._pool = pool
        self._admission = admission
        self._links = links
        self.live = {}
        self.idle = asyncio.Event()
        self.idle.set()
        self.draining = False
        self.spares = Spares(links)
        self.cancels = WorkerCancels(links)
        self._relay = Relay(config, self.spares, self.cancels)

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[inference_pb2.GenerateChunk]:
        """Admit, pick a worker, relay its chunks with seq 1..N; fail over when a worker fails."""
        try:
            self._refuse_if_draining()
            model = validate(request, self._pool, self._config.max_prompt_bytes)
            request_id = request.request_id or uuid.uuid4().hex
            if request_id in self.live:
                raise AlreadyExists(f"request_id {request_id!r} is live already; use a new id, or Resume it",
                                    reason="REQUEST_ID_LIVE", field="request_id")
        except MeshError as error:
            self.metrics.refused(label(error.grpc_code), request.labels.get("tenant", ""))
            raise
        base = inference_pb2.GenerateRequest()
        base.CopyFrom(request)
        base.request_id = request_id
        base.model = model.name
        if not request.HasField("max_tokens"):
            base.max_tokens = min(self._config.default_max_tokens, model.max_context)
        live = self._begin(request_id)
        progress = Progress()
        attempts = 0
        tenant = request.labels.get("tenant", "")
        key = prefix_key(request)
        track = self.metrics.generation(model.name, tenant)
        span = None if self.tracer is None else self._span(base, context, bool(key))
        redactor: StreamRedactor | None = None
        output: list[str] | None = None
        if span is not None and self.capture_content:
            redactor, output = StreamRedactor(), []
        logs.about(request_id, span)
        try:
            while True:
                forward = continuation(base, progress)
                if forward is None:
                    # Every requested token reached the caller; only the end was lost.
                    final = _final(request_id, model.name, progress, inference_pb2.FINISH_REASON_LENGTH)
                    track.chunk(final, "")
                    yield final
                    return
                # Workers that just failed are avoided (suspended) for a while. The
                # first attempt fails fast when no worker is live at all and
                # queues when all are busy; a failover waits, ahead of the queue.
                waited = time.monotonic()
                try:
                    entry = await self._acquire(model.name, request, tenant, key, context, live.cancelled,
                                                failover=attempts > 0)
                except Cancelled:
                    # Cancelled before a worker took it (queued, or between two workers): it ends
                    # as a cancelled generation on a worker does, with a final CANCELLED chunk.
                    final = _final(request_id, model.name, progress, inference_pb2.FINISH_REASON_CANCELLED)
                    track.chunk(final, "")
                    yield final
                    return
                if attempts == 0:
                    queued_s = time.monotonic() - waited
                    progress.timing.queue_ms = queued_s * 1000
                    track.queued(queued_s, request.priority)
                attempts += 1
                try:
                    relay = self._relay.run(entry, forward, live, context, progress,
                                            resumable=bool(request.request_id),
                                            trace_context=None if span is None else inject(span))
                    if span is not None:
                        span.set_attribute("tokenmesh.worker", entry.address)
                    async with contextlib.aclosing(relay):
                        async for piece in relay:
                            track.chunk(piece, entry.address)
                            if span is not None:
                                _trace_chunk(span, piece, output, redactor)
                            yield piece
                    return
                except WorkerFailed as failure:
                    self._pool.suspend(entry, self._config.stall_timeout_s, str(failure))
                    if span is not None:
                        span.add_event("tokenmesh.worker_failed", {"tokenmesh.worker": entry.address,
                                                                   "tokenmesh.failure": failure.kind,
                                                                   "tokenmesh.after_seq": progress.seq})
                    track.worker_failed(entry.address, failure.kind, migrated=0 < progress.seq
                                        and attempts <= self._config.max_migrations)
                    if attempts > self._config.max_migrations:
                        raise Unavailable(
                            f"generation {request_id} failed on {attempts} workers; last: {failure}"
                        ) from failure
                    if progress.seq == 0:
                        # Nothing reached the caller yet: simply run it elsewhere.
                        log.warning("worker %s could not start %s: %s", entry.address, request_id, failure)
                        continue
                    progress.migrations += 1
                    log.warning(
                        "worker %s failed %s after seq %d (%s); continuing on another worker",
                        entry.address, request_id, progress.seq, failure,
                    )
                finally:
                    self._admission.release(entry, tenant)
        except MeshError as error:
            track.failed(label(error.grpc_code), progress.seq > 0)
            if span is not None:
                span.set_attribute("error.type", error.grpc_code.name)
                span.set_status(StatusCode.ERROR, error.message)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            if not track.finished:
                track.failed("caller_gone", progress.seq > 0)
                if span is not None:  # recorded as what it was, not as OK
                    span.set_attribute("tokenmesh.outcome", "caller_gone")
                    span.set_status(StatusCode.ERROR, "the caller went away before the end")
            raise
        finally:
            self._end(request_id)
            if span is not None:
                span.set_attribute("tokenmesh.queue_ms", progress.timing.queue_ms)
                span.set_attribute("tokenmesh.migrations", progress.migrations)
                span.end()

    def _span(self, base: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any],
              prefixed: bool) -> trace.Span:
        """The generation's span, child of the caller's trace context (GenAI semantic conventions)."""
        assert self.tracer is not None
        name = operation(bool(base.messages))
        span = self.tracer.start_span(
            f"{name} {base.model}", context=from_metadata(context.invocation_metadata()), kind=trace.SpanKind.SERVER,
            attributes={
                "gen_ai.operation.name": name, "gen_ai.system": "tokenmesh", "gen_ai.request.model": base.model,
                "gen_ai.request.max_tokens": base.max_tokens, "gen_ai.response.id": base.request_id,
                "tokenmesh.policy": self._config.policy, "tokenmesh.prefix_affinity": prefixed,
            })
        if self.capture_content:  # opted in: the prompt, redacted
            prompt = base.prompt or "\n".join(f"{m.role}: {m.content}" for m in base.messages)
            span.add_event("gen_ai.user.message", {"gen_ai.prompt": redact(prompt)})
        return span

    def _refuse_if_draining(self) -> None:
        if self.draining:
            raise Unavailable("this router is draining (shutting down); send the call to another router",
                              reason="ROUTER_DRAINING")

    def _begin(self, request_id: str, *, resumed: bool = False) -> Live:
        """Count a stream of request_id as live on this router."""
        live = self.live[request_id] = Live(resumed=resumed)
        self.idle.clear()
        return live

    def _end(self, request_id: str) -> None:
        self.live.pop(request_id).ended.set()
        if not self.live:
            self.idle.set()

    async def _acquire(
        self,
        model: str,
        request: inference_pb2.GenerateRequest,
        tenant: str,
        key: str,
        context: grpc.aio.ServicerContext[Any, Any],
        abandon: asyncio.Future[None],
        *,
        failover: bool,
    ) -> WorkerEntry:
        """A worker slot through admission, within the caller's deadline; Cancelled once abandon is done."""
        timeout = self._config.failover_wait_s if failover else self._config.queue_timeout_s
        remaining = context.time_remaining()
        if remaining is not None:
            timeout = min(timeout, remaining)
        if not failover:
            return await self._admission.acquire(model, level(request.priority), tenant, timeout, key, abandon)
        # A failover waits, ahead of the queue, for a slot on a live worker: one that frees, or one that comes
        # back (its health, a table, the end of a suspension: the pool tells the admission of each).
        try:
            return await self._admission.acquire(model, FAILOVER, tenant, timeout, key, abandon)
        except ResourceExhausted:
            self._pool.require_live(model)  # none came back: say that, not "busy"
            raise

    async def Resume(  # noqa: N802 - gRPC method name
        self, request: inference_pb2.ResumeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[inference_pb2.GenerateChunk]:
        """Find the worker holding request_id; replay chunks after after_seq, then follow live."""
        try:
            async for piece in self._resume(request, context):
                yield piece
        except MeshError as error:
            self.metrics.resumes.labels(label(error.grpc_code)).inc()
            raise
        self.metrics.resumes.labels("ok").inc()

    async def _resume(
        self, request: inference_pb2.ResumeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[inference_pb2.GenerateChunk]:
        request_id = request.request_id
        require_request_id(request_id)
        held = self.live.get(request_id)
        if held is not None:
            # A caller that cancels its stream and resumes at once can overtake the
            # teardown of its old stream here: give that a moment to finish.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(held.ended.wait(), TEARDOWN_WAIT_S)
        if request_id in self.live:
            raise AlreadyExists(f"generation {request_id!r} is being streamed by this router already")
        self._refuse_if_draining()
        self._begin(request_id, resumed=True)  # so Generate and Cancel see it is being streamed here
        try:
            for entry in sorted(self._pool.entries.values(), key=lambda e: not e.healthy):
                call = self._links[entry.address].stub(worker_pb2_grpc.WorkerStub).Attach(
                    worker_pb2.AttachRequest(request_id=request_id, after_seq=request.after_seq),
                    timeout=context.time_remaining(),
                )
                try:
                    event = await call.read()
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.OUT_OF_RANGE:  # it holds it, but not from after_seq
                        raise from_rpc_error(exc) from exc
                    continue  # not there (NOT_FOUND) or not reachable: ask the next worker
                try:
                    while event is not grpc.aio.EOF:
                        if event.WhichOneof("event") == "error":
                            if event.error.error_class in CALLER_ERROR_CLASSES:
                                raise from_generation_error(event.error, entry.address)
                            raise Unavailable(f"generation {request_id} failed on its worker: {event.error.message}")
                        yield chunk(event, request_id, "")
                        if event.WhichOneof("event") == "end":
                            return
                        event = await call.read()
                except grpc.aio.AioRpcError as exc:
                    if exc.code() in CALLER_CODES or exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        raise from_rpc_error(exc) from exc  # e.g. this caller reads too slowly
                    raise Unavailable(
                        f"worker {entry.address} holding {request_id} failed during Resume ({exc.code().name}); "
                        "a resumed stream is not moved to another worker"
                    ) from exc
                finally:
                    call.cancel()
                raise Unavailable(f"worker {entry.address} ended {request_id} without an end")
            raise NotFound(
                f"no worker holds generation {request_id!r}: unknown id, cancelled, or finished "
                "longer ago than the resume grace period"
            )
        finally:
            self._end(request_id)

    async def Cancel(  # noqa: N802 - gRPC method name
        self, request: inference_pb2.CancelRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> inference_pb2.CancelResponse:
        """Stop a generation: on this router's stream, or on whichever worker holds it."""
        try:
            response = await self._cancel(request, context)
        except MeshError as error:
            self.metrics.cancels.labels(label(error.grpc_code)).inc()
            raise
        self.metrics.cancels.labels("ok").inc()
        return response

    async def _cancel(
        self, request: inference_pb2.CancelRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> inference_pb2.CancelResponse:
        request_id = request.request_id
        require_request_id(request_id)
        live = self.live.get(request_id)
        if live is not None and not live.resumed:
            live.cancel()  # one still waiting for a worker slot ends now
            if live.call is not None:
                with contextlib.suppress(grpc.aio.UsageError, grpc.aio.AioRpcError):
                    stop = worker_pb2.WorkerCommand(cancel=worker_pb2.CancelGeneration(reason="Cancel"))
                    await write(live.call, stop)
            return inference_pb2.CancelResponse(cancelled=True)
        # No stream of this router runs it (or a Resume follows it): the worker that holds it stops it.
        remaining = context.time_remaining()
        # Answer before the caller's deadline passes, so it learns NOT_FOUND rather than DEADLINE_EXCEEDED.
        timeout = CANCEL_TIMEOUT_S if remaining is None else min(CANCEL_TIMEOUT_S, 0.9 * remaining)
        held, not_asked = await self.cancels.everywhere(request_id, timeout)
        if not held:
            unknown = f"no live generation with request_id {request_id!r}"
            if not_asked:
                raise NotFound(f"{unknown} on the workers that answered; could not ask {', '.join(not_asked)}")
            raise NotFound(unknown)
        return inference_pb2.CancelResponse(cancelled=True)

    async def ListModels(  # noqa: N802 - gRPC method name
        self, request: inference_pb2.ListModelsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> inference_pb2.ListModelsResponse:
        """Models of the live workers."""
        response = inference_pb2.ListModelsResponse()
        for _, (info, count) in sorted(self._pool.models().items()):
            model = response.models.add()
            model.CopyFrom(info)
            model.workers = count
        return response


def _final(
    request_id: str, model: str, progress: Progress, reason: inference_pb2.FinishReason
) -> inference_pb2.GenerateChunk:
    """The last chunk of a generation the router ends itself (no worker sent an end)."""
    return inference_pb2.GenerateChunk(
        request_id=request_id, seq=progress.seq + 1, model=model, finish_reason=reason,
        usage=inference_pb2.Usage(completion_tokens=progress.tokens),
        migrations=progress.migrations, timing=progress.timing,
    )
