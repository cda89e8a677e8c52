"""``tokenmesh.v1.Inference`` on the router: Generate with failover, Resume, Cancel, ListModels, GenerateStream.

One attempt on one worker is :class:`~tokenmesh.router._relay.Relay`'s; this
module decides what happens around it: admission, which failures move the
stream to another worker, and the streams this router holds by request_id.
GenerateStream carries many Generate and Resume streams on one call
(:mod:`tokenmesh.router._stream`), each run by Generate or Resume itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, cast

import grpc
from opentelemetry import trace

from tokenmesh import logs
from tokenmesh.errors import (
    AlreadyExists,
    Cancelled,
    MeshError,
    NotFound,
    ResourceExhausted,
    Unavailable,
    from_rpc_error,
    label,
)
from tokenmesh.links import Links
from tokenmesh.redaction import capture_enabled
from tokenmesh.router._admission import FAILOVER, Admission, level
from tokenmesh.router._cancels import WorkerCancels
from tokenmesh.router._config import RouterConfig
from tokenmesh.router._link import LinkSessions
from tokenmesh.router._metrics import RouterMetrics
from tokenmesh.router._observe import Observation, generation_span
from tokenmesh.router._outcome import AT_LIMIT, WorkerFailed, outcome
from tokenmesh.router._pool import Affinity, WorkerEntry, WorkerPool, affinity_of
from tokenmesh.router._quotas import Grant, Quotas
from tokenmesh.router._relay import Live, Progress, Relay, chunk, continuation, start_command, stop
from tokenmesh.router._spares import Spares
from tokenmesh.router._stream import StreamContext, StreamSession
from tokenmesh.router._stream import settings as stream_settings
from tokenmesh.router._validation import validate
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, worker_pb2, worker_pb2_grpc
from tokenmesh.validation import require_request_id

log = logging.getLogger(__name__)

CANCEL_TIMEOUT_S = 5.0
"""Longest a Cancel that goes to the workers waits for their answers (less when the caller's deadline is nearer)."""
TEARDOWN_WAIT_S = 2.0
"""How long Resume waits for this router's old stream of the same request_id to be torn down."""


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """Generate, Resume, Cancel, ListModels.

    Args:
        config: the router's settings.
        pool: the workers and the weight table in force.
        links: the router's links to its workers (the router opens one per worker it learns of).
        admission: grants worker slots, queueing by priority.
        metrics: the router's metrics.
        quotas: the tenants' quotas (default: none).

    """

    live: dict[str, Live]
    """Generations and resumes this router streams now, by request_id."""
    idle: asyncio.Event
    """Set while no generation or resume is being streamed by this router, nor any stream of a GenerateStream call
    (the drain waits for it)."""
    draining: bool
    """Set when the router drains: new generations and resumes get UNAVAILABLE."""
    spares: Spares
    cancels: WorkerCancels
    sessions: LinkSessions
    """The workers' Link sessions (with --worker-link auto; none: every attempt is a Worker/Generate call)."""
    stream_calls: set[StreamSession]
    """The GenerateStream calls open now."""
    open_streams: int
    """Streams open on GenerateStream calls (from their start until their end is taken to be sent)."""
    _config: RouterConfig
    _pool: WorkerPool
    _admission: Admission
    _links: Links
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
        links: Links,
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
        self._links = links
        self.live = {}
        self.idle = asyncio.Event()
        self.idle.set()
        self.draining = False
        self.stream_calls = set()
        self.open_streams = 0
        self.spares = Spares(links)
        self.cancels = WorkerCancels(links)
        self.sessions = LinkSessions()
        self._relay = Relay(config, self.spares, self.cancels, self.sessions)

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[inference_pb2.GenerateChunk]:
        """Admit, pick a worker, relay its chunks with seq 1..N; fail over when a worker fails."""
        tenant = request.labels.get("tenant", "")
        base, grant = await self._admitted(request, tenant)
        request_id = base.request_id
        affinity = affinity_of(request)
        observe = self._observe(base, tenant, affinity.source, context)
        live = self._begin(request_id)
        if isinstance(context, StreamContext):
            context.began(request_id, live)  # a GenerateStream stream: its cancel command is a Cancel of request_id
        progress = Progress()
        attempts, requeued = (
            0,
            False,
        )  # failed attempts in a row with no chunk between; refused by a worker at its limit
        try:
            while True:
                forward = continuation(base, progress)
                if forward is None:
                    # Every requested token reached the caller; only the end was lost.
                    yield self._final_here(base, progress, inference_pb2.FINISH_REASON_LENGTH, observe)
                    return
                try:
                    entry = await self._slot(
                        base, tenant, affinity, context, live, observe, progress, attempts, requeued
                    )
                except Cancelled:
                    # Cancelled before a worker took it (queued, or between two workers): it ends
                    # as a cancelled generation on a worker does, with a final CANCELLED chunk.
                    yield self._final_here(base, progress, inference_pb2.FINISH_REASON_CANCELLED, observe)
                    return
                attempts += 1
                seq_before = progress.seq
                try:
                    start = self._start(forward, progress, context, bool(request.request_id), observe)
                    relay = self._relay.run(entry, start, live, progress, observe.call_context)
                    observe.attempt(entry.address)
                    async with contextlib.aclosing(relay):
                        async for piece in relay:
                            observe.chunk(piece, entry.address)
                            grant.saw(piece)
                            yield piece
                    return
                except WorkerFailed as failure:
                    failed = (failure, progress.seq > seq_before)
                    attempts, requeued = self._attempt_failed(entry, failed, request_id, progress, attempts, observe)
                finally:
                    self._admission.release(entry, tenant)
        except MeshError as error:
            observe.failed(error, progress.seq > 0)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            observe.caller_gone(progress.seq > 0)
            raise
        finally:
            self._end(request_id)
            grant.settle()
            observe.end(progress.timing.queue_ms, progress.migrations)

    def _start(
        self,
        forward: inference_pb2.GenerateRequest,
        progress: Progress,
        context: grpc.aio.ServicerContext[Any, Any],
        resumable: bool,
        observe: Observation,
    ) -> worker_pb2.WorkerCommand:
        """The next attempt's start command: what is left to generate, traced under the generation's span."""
        return start_command(
            forward,
            progress,
            context,
            resumable=resumable,
            trace_context=observe.start_context,
            stream_interval_ms=self._config.stream_interval_ms,
        )

    async def _admitted(
        self, request: inference_pb2.GenerateRequest, tenant: str
    ) -> tuple[inference_pb2.GenerateRequest, Grant]:
        """The request as the router runs it, and its reservation in the tenant's quota; or the caller's error."""
        base = self._admit(request)
        try:
            grant = await self.quotas.reserve(base, tenant, lambda: self._pool.resolve_model(base.model).max_context)
            if base.request_id in self.live:  # started while Redis answered: the same id twice at once
                grant.settle()
                self._refuse_if_live(base.request_id)
        except MeshError as error:
            self.metrics.refused(label(error.grpc_code), tenant)
            raise
        return base, grant

    def _admit(self, request: inference_pb2.GenerateRequest) -> inference_pb2.GenerateRequest:
        """The request as the router runs it (its request_id, model and max_tokens set), or the caller's error."""
        try:
            self._refuse_if_draining()
            model = validate(request, self._pool, self._config.max_prompt_bytes)
            request_id = request.request_id or uuid.uuid4().hex
            self._refuse_if_live(request_id)
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

    def _observe(
        self,
        base: inference_pb2.GenerateRequest,
        tenant: str,
        affinity: str,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> Observation:
        """The generation's observer (metrics and span); from here on this task's log lines are about it."""
        span = generation_span(
            self.tracer,
            base,
            context.invocation_metadata(),
            policy=self._config.policy,
            affinity=affinity,
            capture_content=self.capture_content,
        )
        logs.about(base.request_id, span)
        return Observation(self.metrics.generation(base.model, tenant), span, capture_content=self.capture_content)

    async def _slot(
        self,
        base: inference_pb2.GenerateRequest,
        tenant: str,
        affinity: Affinity,
        context: grpc.aio.ServicerContext[Any, Any],
        live: Live,
        observe: Observation,
        progress: Progress,
        attempts: int,
        requeued: bool,
    ) -> WorkerEntry:
        """A worker slot for the next attempt (Cancelled once the generation is cancelled while it waits).

        Workers that just failed are avoided (suspended) for a while. The first
        attempt fails fast when no worker is live at all and queues when all
        are busy; a failover, and a start a worker refused at its limit (requeued), wait ahead of the queue.
        """
        waited = time.monotonic()
        failover = attempts > 0 or requeued
        entry = await self._acquire(base.model, base, tenant, affinity, context, live.cancelled, failover=failover)
        if not failover:
            queued_s = time.monotonic() - waited
            progress.timing.queue_ms = queued_s * 1000
            observe.queued(queued_s, base.priority)
        return entry

    def _attempt_failed(
        self,
        entry: WorkerEntry,
        failed: tuple[WorkerFailed, bool],
        request_id: str,
        progress: Progress,
        attempts: int,
        observe: Observation,
    ) -> tuple[int, bool]:
        """Take stock of an attempt that did not end; the attempts that count, and whether it was refused.

        failed: the failure, and whether the attempt delivered chunks before it. A worker at its limit is busy, not
        failed: that attempt does not count, and the generation waits again, ahead of the queue (:meth:`_refused`);
        any other failure fails over (:meth:`_fail_over`). ``--max-migrations`` bounds failed attempts in a row with
        no chunk delivered between them: after an attempt that moved the stream forward only its own failure
        counts (a long stream that keeps going through many worker deaths is not a hopeless one).
        """
        failure, moved = failed
        if moved:
            attempts = 1
        if failure.kind == AT_LIMIT:
            self._refused(entry, request_id)
            return attempts - 1, True
        self._fail_over(entry, failure, request_id, progress, attempts, observe)
        return attempts, False

    def _fail_over(
        self,
        entry: WorkerEntry,
        failure: WorkerFailed,
        request_id: str,
        progress: Progress,
        attempts: int,
        observe: Observation,
    ) -> None:
        """Take stock of a failed attempt: the worker is avoided a while; Unavailable after too many attempts.

        A ``slow`` generation does not suspend its worker: the worker is busy, not failing, and taking it out would
        move every new generation onto its (equally busy) peers.
        """
        if failure.kind != "slow":
            self._pool.suspend(entry, self._config.stall_timeout_s, str(failure))
        observe.worker_failed(
            entry.address, failure, progress.seq, migrated=0 < progress.seq and attempts <= self._config.max_migrations
        )
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
    def _final_here(
        base: inference_pb2.GenerateRequest,
        progress: Progress,
        reason: inference_pb2.FinishReason,
        observe: Observation,
    ) -> inference_pb2.GenerateChunk:
        """The last chunk of a generation the router ends itself (no worker sent an end), counted."""
        final = inference_pb2.GenerateChunk(
            request_id=base.request_id,
            seq=progress.seq + 1,
            model=base.model,
            finish_reason=reason,
            usage=inference_pb2.Usage(completion_tokens=progress.tokens),
            migrations=progress.migrations,
            timing=progress.timing,
        )
        observe.ended_here(final)
        return final

    def _refuse_if_live(self, request_id: str) -> None:
        if request_id in self.live:
            raise AlreadyExists(
                f"request_id {request_id!r} is live already; use a new id, or Resume it",
                reason="REQUEST_ID_LIVE",
                field="request_id",
            )

    def _refuse_if_draining(self) -> None:
        if self.draining:
            raise Unavailable(
                "this router is draining (shutting down); send the call to another router", reason="ROUTER_DRAINING"
            )

    def _begin(self, request_id: str, *, resumed: bool = False) -> Live:
        """Count a stream of request_id as live on this router."""
        live = self.live[request_id] = Live(resumed=resumed)
        self.idle.clear()
        return live

    def _end(self, request_id: str) -> None:
        self.live.pop(request_id).ended.set()
        if not self.live and not self.open_streams:
            self.idle.set()

    def drain(self) -> None:
        """Refuse new generations and resumes from now on; a GenerateStream call ends once its streams have."""
        self.draining = True
        for session in self.stream_calls:
            session.kick()

    async def _acquire(
        self,
        model: str,
        request: inference_pb2.GenerateRequest,
        tenant: str,
        affinity: Affinity,
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
            return await self._admission.acquire(model, level(request.priority), tenant, timeout, affinity, abandon)
        # A failover waits, ahead of the queue, for a slot on a live worker: one that frees, or one that comes
        # back (its health, a table, the end of a suspension: the pool tells the admission of each).
        try:
            return await self._admission.acquire(model, FAILOVER, tenant, timeout, affinity, abandon)
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
                call = (
                    self._links[entry.address]
                    .stub(worker_pb2_grpc.WorkerStub)
                    .Attach(
                        worker_pb2.AttachRequest(request_id=request_id, after_seq=request.after_seq),
                        timeout=context.time_remaining(),
                    )
                )
                try:
                    event = await call.read()
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.OUT_OF_RANGE:  # it holds it, but not from after_seq
                        raise from_rpc_error(exc) from exc
                    continue  # not there (NOT_FOUND) or not reachable: ask the next worker
                try:
                    while event is not grpc.aio.EOF and event.WhichOneof("event") != "error":
                        yield chunk(event, request_id, "")
                        if event.WhichOneof("event") == "end":
                            return
                        event = await call.read()
                    ended = None if event is grpc.aio.EOF else event.error
                    failure = outcome(ended, entry.address, received=True)
                except grpc.aio.AioRpcError as exc:
                    failure = outcome(exc, entry.address, received=True)
                finally:
                    call.cancel()
                raise _not_moved(failure, entry.address, request_id)
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
                    await stop(live.call)
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

    async def GenerateStream(  # noqa: N802 - gRPC method name
        self,
        request_iterator: AsyncIterator[inference_pb2.StreamCommands],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[inference_pb2.StreamEvents]:
        """Many generations and resumes on one call, each run by Generate or Resume; one message per send."""
        session = StreamSession(
            context,
            self._stream_source,
            self._stream_cancel,
            self._streams_opened,
            self._drains,
            self.metrics.stream_message,
            stream_settings(self._config.max_streams_per_connection),
            linger_s=self._config.stream_linger_us / 1e6,
        )
        self.stream_calls.add(session)
        try:
            async for message in session.run(request_iterator):
                yield message
        finally:
            self.stream_calls.discard(session)

    def _stream_source(
        self, command: inference_pb2.StreamCommand, context: StreamContext
    ) -> AsyncIterator[inference_pb2.GenerateChunk]:
        """A GenerateStream stream's chunks: Generate's or Resume's own, with the stream's deadline and metadata."""
        call = cast("grpc.aio.ServicerContext[Any, Any]", context)  # offers what Generate and Resume use of a call
        if command.HasField("generate"):
            return self.Generate(command.generate, call)
        return self.Resume(command.resume, call)

    async def _stream_cancel(self, context: StreamContext) -> None:
        """A stream's cancel command: Inference/Cancel of its generation (one not admitted yet is cancelled then)."""
        if not context.request_id:
            context.cancel_asked = True
            return
        with contextlib.suppress(MeshError):  # NotFound: it raced the generation's end
            await self.Cancel(
                inference_pb2.CancelRequest(request_id=context.request_id),
                cast("grpc.aio.ServicerContext[Any, Any]", context),
            )

    def _streams_opened(self, change: int) -> None:
        self.open_streams += change
        if self.open_streams:
            self.idle.clear()
        elif not self.live:
            self.idle.set()

    def _drains(self) -> bool:
        return self.draining

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


def _not_moved(failure: WorkerFailed | MeshError, worker: str, request_id: str) -> MeshError:
    """A Resume's error for how its attempt ended: a worker failure is reported, not failed over."""
    if isinstance(failure, MeshError):
        return failure
    error = Unavailable(
        f"worker {worker} holding {request_id} failed during Resume ({failure}); "
        "a resumed stream is not moved to another worker"
    )
    error.__cause__ = failure
    return error
