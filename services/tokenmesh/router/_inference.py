"""``tokenmesh.v1.Inference`` on the router: Generate with failover; Resume, Cancel and GenerateStream in their rooms.

One attempt on one worker is :class:`~tokenmesh.router._relay.Relay`'s; this
module decides what happens around it: admission, which failures move the
stream to another worker, and how a generation ends when no worker ends it.
A generation's state is one :class:`~tokenmesh.router._generation.Generation`.
Resume is :mod:`tokenmesh.router._resume`'s, Cancel :func:`tokenmesh.router._cancels.cancel`,
and GenerateStream (:mod:`tokenmesh.router._stream`) runs each of its streams
with Generate or Resume itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from opentelemetry import trace

from tokenmesh import logs
from tokenmesh.errors import Cancelled, MeshError, ResourceExhausted, Unavailable, label
from tokenmesh.redaction import capture_enabled
from tokenmesh.router import _resume
from tokenmesh.router._admission import FAILOVER, Admission, level
from tokenmesh.router._cancels import WorkerCancels, cancel
from tokenmesh.router._config import RouterConfig
from tokenmesh.router._generation import Caller, Generation
from tokenmesh.router._live import Live, LiveTable
from tokenmesh.router._metrics import RouterMetrics
from tokenmesh.router._observe import Observation, generation_span
from tokenmesh.router._outcome import AT_LIMIT, WorkerFailed
from tokenmesh.router._pool import WorkerEntry, WorkerPool, affinity_of
from tokenmesh.router._quotas import Quotas
from tokenmesh.router._relay import Relay, continuation, start_command
from tokenmesh.router._stream import StreamCalls, StreamContext, Streams
from tokenmesh.router._stream import settings as stream_settings
from tokenmesh.router._transport import WorkerTransports
from tokenmesh.router._validation import validate
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, worker_pb2

log = logging.getLogger(__name__)


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """Generate, Resume, Cancel, GenerateStream, ListModels.

    Args:
        config: the router's settings.
        pool: the workers and the weight table in force.
        transports: the road to each worker (the router service owns it).
        admission: grants worker slots, queueing by priority.
        metrics: the router's metrics.
        quotas: the tenants' quotas (default: none).

    """

    live: LiveTable
    """What this router streams now, by request_id, and whether it drains (the drain waits for ``live.idle``)."""
    streams: StreamCalls
    """The GenerateStream calls open now."""
    cancels: WorkerCancels
    _config: RouterConfig
    _pool: WorkerPool
    _admission: Admission
    _transports: WorkerTransports
    _relay: Relay
    quotas: Quotas
    """Per-tenant quotas: each generation reserves its worst case before it is admitted."""
    metrics: RouterMetrics
    tracer: trace.Tracer
    """Spans per generation (OpenTelemetry's no-op tracer while tracing is off)."""
    capture_content: bool
    """Prompts and outputs go into spans, redacted (OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT)."""

    def __init__(
        self,
        config: RouterConfig,
        pool: WorkerPool,
        transports: WorkerTransports,
        admission: Admission,
        metrics: RouterMetrics,
        quotas: Quotas | None = None,
    ) -> None:
        self.metrics = metrics
        self.quotas = quotas if quotas is not None else Quotas("", config.quota_window_s)
        self.tracer = trace.NoOpTracer()
        self.capture_content = capture_enabled()
        self._config = config
        self._pool = pool
        self._admission = admission
        self._transports = transports
        self.live = LiveTable()
        streams = Streams(
            self._stream_source,
            self._stream_cancel,
            self.live.opened,
            lambda: self.live.draining,
            metrics.stream_message,
        )
        self.streams = StreamCalls(
            streams, stream_settings(config.max_streams_per_connection), config.stream_linger_us / 1e6
        )
        self.cancels = WorkerCancels(transports.links)
        self._relay = Relay(config, transports, self.cancels)

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: inference_pb2.GenerateRequest, context: Caller, began: Callable[[str, Live], None] | None = None
    ) -> AsyncIterator[inference_pb2.GenerateChunk]:
        """Admit, pick a worker, relay its chunks with seq 1..N; fail over when a worker fails.

        began is told the admitted generation (a GenerateStream stream: its cancel command is a Cancel of it).
        """
        gen = await self._generation(request, context)
        if began is not None:
            began(gen.request_id, gen.live)
        progress, observe = gen.progress, gen.observe
        try:
            while True:
                forward = continuation(gen.base, progress)
                if forward is None:
                    # Every requested token reached the caller; only the end was lost.
                    yield self._final_here(gen, inference_pb2.FINISH_REASON_LENGTH)
                    return
                try:
                    entry = await self._slot(gen)
                except Cancelled:
                    # Cancelled before a worker took it (queued, or between two workers): it ends
                    # as a cancelled generation on a worker does, with a final CANCELLED chunk.
                    yield self._final_here(gen, inference_pb2.FINISH_REASON_CANCELLED)
                    return
                gen.attempts += 1
                seq_before = progress.seq
                try:
                    relay = self._relay.run(entry, self._start(gen, forward), gen.live, progress, observe.call_context)
                    observe.attempt(entry.address)
                    async with contextlib.aclosing(relay):
                        async for piece in relay:
                            observe.chunk(piece, entry.address)
                            gen.grant.saw(piece)
                            yield piece
                    return
                except WorkerFailed as failure:
                    self._attempt_failed(gen, entry, failure, moved=progress.seq > seq_before)
                finally:
                    self._admission.release(entry, gen.tenant)
        except MeshError as error:
            observe.failed(error, progress.seq > 0)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            observe.caller_gone(progress.seq > 0)
            raise
        finally:
            self.live.end(gen.request_id)
            gen.grant.settle()
            observe.end(progress.timing.queue_ms, progress.migrations)

    async def _generation(self, request: inference_pb2.GenerateRequest, caller: Caller) -> Generation:
        """The admitted generation: checked, its quota reserved, observed and live; or the caller's error."""
        tenant = request.labels.get("tenant", "")
        base = self._admit(request)
        try:
            grant = await self.quotas.reserve(base, tenant, lambda: self._pool.resolve_model(base.model).max_context)
            if base.request_id in self.live.by_id:  # started while Redis answered: the same id twice at once
                grant.settle()
                self.live.refuse_if_live(base.request_id)
        except MeshError as error:
            self.metrics.refused(label(error.grpc_code), tenant)
            raise
        affinity = affinity_of(request)
        observe = self._observe(base, tenant, affinity.source, caller)
        live = self.live.begin(base.request_id)
        return Generation(base, caller, tenant, affinity, observe, live, grant, resumable=bool(request.request_id))

    def _admit(self, request: inference_pb2.GenerateRequest) -> inference_pb2.GenerateRequest:
        """The request as the router runs it (its request_id, model and max_tokens set), or the caller's error."""
        try:
            self.live.refuse_if_draining()
            model = validate(request, self._pool, self._config.max_prompt_bytes)
            request_id = request.request_id or uuid.uuid4().hex
            self.live.refuse_if_live(request_id)
        except MeshError as error:
            self.metrics.refused(label(error.grpc_code), request.labels.get("tenant", ""))
            raise
        base = inference_pb2.GenerateRequest()
        base.CopyFrom(request)
        base.request_id = request_id
        base.model = model.name
        if not request.HasField("max_tokens"):
            base.max_tokens = min(self._config.default_max_tokens, model.max_context)
        return base

    def _observe(self, base: inference_pb2.GenerateRequest, tenant: str, affinity: str, caller: Caller) -> Observation:
        """The generation's observer (metrics and span); from here on this task's log lines are about it."""
        span = generation_span(
            self.tracer,
            base,
            caller.invocation_metadata(),
            policy=self._config.policy,
            affinity=affinity,
            capture_content=self.capture_content,
        )
        logs.about(base.request_id, span)
        return Observation(self.metrics.generation(base.model, tenant), span, capture_content=self.capture_content)

    def _start(self, gen: Generation, forward: inference_pb2.GenerateRequest) -> worker_pb2.WorkerCommand:
        """The next attempt's start command: what is left to generate, traced under the generation's span."""
        return start_command(
            forward,
            gen.progress,
            gen.caller,
            resumable=gen.resumable,
            trace_context=gen.observe.start_context,
            stream_interval_ms=self._config.stream_interval_ms,
        )

    async def _slot(self, gen: Generation) -> WorkerEntry:
        """A worker slot for the next attempt (Cancelled once the generation is cancelled while it waits).

        Workers that just failed are avoided (suspended) for a while. The first
        attempt fails fast when no worker is live at all and queues when all
        are busy; a failover, and a start a worker refused at its limit (requeued), wait ahead of the queue.
        """
        waited = time.monotonic()
        failover = gen.attempts > 0 or gen.requeued
        entry = await self._acquire(gen, failover=failover)
        if not failover:
            queued_s = time.monotonic() - waited
            gen.progress.timing.queue_ms = queued_s * 1000
            gen.observe.queued(queued_s, gen.base.priority)
        return entry

    async def _acquire(self, gen: Generation, *, failover: bool) -> WorkerEntry:
        """A worker slot through admission, within the caller's deadline; Cancelled once the generation is."""
        timeout = self._config.failover_wait_s if failover else self._config.queue_timeout_s
        remaining = gen.caller.time_remaining()
        if remaining is not None:
            timeout = min(timeout, remaining)
        model, abandon = gen.base.model, gen.live.cancelled
        if not failover:
            priority = level(gen.base.priority)
            return await self._admission.acquire(model, priority, gen.tenant, timeout, gen.affinity, abandon)
        # A failover waits, ahead of the queue, for a slot on a live worker: one that frees, or one that comes
        # back (its health, a table, the end of a suspension: the pool tells the admission of each).
        try:
            return await self._admission.acquire(model, FAILOVER, gen.tenant, timeout, gen.affinity, abandon)
        except ResourceExhausted:
            self._pool.require_live(model)  # none came back: say that, not "busy"
            raise

    def _attempt_failed(self, gen: Generation, entry: WorkerEntry, failure: WorkerFailed, *, moved: bool) -> None:
        """Take stock of an attempt that did not end (moved: it delivered chunks before it failed).

        A worker at its limit is busy, not failed: that attempt does not count, and the generation waits again,
        ahead of the queue (:meth:`_refused`); any other failure fails over (:meth:`_fail_over`).
        ``--max-migrations`` bounds failed attempts in a row with no chunk delivered between them: after an
        attempt that moved the stream forward only its own failure counts (a long stream that keeps going through
        many worker deaths is not a hopeless one).
        """
        if moved:
            gen.attempts = 1
        gen.requeued = failure.kind == AT_LIMIT
        if gen.requeued:
            gen.attempts -= 1
            self._refused(entry, gen.request_id)
            return
        self._fail_over(gen, entry, failure)

    def _fail_over(self, gen: Generation, entry: WorkerEntry, failure: WorkerFailed) -> None:
        """Take stock of a failed attempt: the worker is avoided a while; Unavailable after too many attempts.

        A ``slow`` generation does not suspend its worker: the worker is busy, not failing, and taking it out would
        move every new generation onto its (equally busy) peers.
        """
        progress, attempts, request_id = gen.progress, gen.attempts, gen.request_id
        if failure.kind != "slow":
            self._pool.suspend(entry, self._config.stall_timeout_s, str(failure))
        migrated = 0 < progress.seq and attempts <= self._config.max_migrations
        gen.observe.worker_failed(entry.address, failure, progress.seq, migrated=migrated)
        if attempts > self._config.max_migrations:
            raise Unavailable(f"generation {request_id} failed on {attempts} workers; last: {failure}") from failure
        if progress.seq == 0:
            # Nothing reached the caller yet: simply run it elsewhere.
            log.warning("worker %s could not start %s: %s", entry.address, request_id, failure)
            return
        progress.migrations += 1
        log.warning(
            "worker %s failed %s after seq %d (%s); continuing on another worker",
            entry.address,
            request_id,
            progress.seq,
            failure,
        )

    def _refused(self, entry: WorkerEntry, request_id: str) -> None:
        """Take stock of a start the worker refused at its limit (another router fills it too); it waits again.

        The worker is not suspended (it is busy, not failing: avoiding it would leave its free slots idle once
        the other routers' generations end); this router sends it no more than what it runs there now, for a while.
        """
        self._pool.refused(entry)
        self.metrics.worker_refusals.labels(entry.address).inc()
        log.info("worker %s is at its limit; %s waits for a slot again", entry.address, request_id)

    @staticmethod
    def _final_here(gen: Generation, reason: inference_pb2.FinishReason) -> inference_pb2.GenerateChunk:
        """The last chunk of a generation the router ends itself (no worker sent an end), counted."""
        progress = gen.progress
        final = inference_pb2.GenerateChunk(
            request_id=gen.request_id,
            seq=progress.seq + 1,
            model=gen.base.model,
            finish_reason=reason,
            usage=inference_pb2.Usage(completion_tokens=progress.tokens),
            migrations=progress.migrations,
            timing=progress.timing,
        )
        gen.observe.ended_here(final)
        return final

    def drain(self) -> None:
        """Refuse new generations and resumes from now on; a GenerateStream call ends once its streams have."""
        self.live.draining = True
        self.streams.drain()

    async def Resume(  # noqa: N802 - gRPC method name
        self, request: inference_pb2.ResumeRequest, context: Caller
    ) -> AsyncIterator[inference_pb2.GenerateChunk]:
        """Find the worker holding request_id; replay chunks after after_seq, then follow live."""
        try:
            async for piece in _resume.follow(request, context, self.live, self._pool, self._transports.links):
                yield piece
        except MeshError as error:
            self.metrics.resumes.labels(label(error.grpc_code)).inc()
            raise
        self.metrics.resumes.labels("ok").inc()

    async def Cancel(  # noqa: N802 - gRPC method name
        self, request: inference_pb2.CancelRequest, context: Caller
    ) -> inference_pb2.CancelResponse:
        """Stop a generation: on this router's stream, or on whichever worker holds it."""
        try:
            await cancel(request.request_id, context, self.live, self.cancels)
        except MeshError as error:
            self.metrics.cancels.labels(label(error.grpc_code)).inc()
            raise
        self.metrics.cancels.labels("ok").inc()
        return inference_pb2.CancelResponse(cancelled=True)

    async def GenerateStream(  # noqa: N802 - gRPC method name
        self,
        request_iterator: AsyncIterator[inference_pb2.StreamCommands],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[inference_pb2.StreamEvents]:
        """Many generations and resumes on one call, each run by Generate or Resume; one message per send."""
        async for message in self.streams.serve(request_iterator, context):
            yield message

    def _stream_source(
        self, command: inference_pb2.StreamCommand, context: StreamContext
    ) -> AsyncIterator[inference_pb2.GenerateChunk]:
        """A GenerateStream stream's chunks: Generate's or Resume's own, with the stream's deadline and metadata."""
        if command.HasField("generate"):
            return self.Generate(command.generate, context, context.began)
        return self.Resume(command.resume, context)

    async def _stream_cancel(self, context: StreamContext) -> None:
        """A stream's cancel command: Inference/Cancel of its generation (one not admitted yet is cancelled then)."""
        if not context.request_id:
            context.cancel_asked = True
            return
        with contextlib.suppress(MeshError):  # NotFound: it raced the generation's end
            await self.Cancel(inference_pb2.CancelRequest(request_id=context.request_id), context)

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
